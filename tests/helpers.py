"""What the tests share: tiny configs, small batches and tokenizers, and the parity assertions.

Test modules import from here (`from helpers import ...`; pyproject.toml puts tests/ on the import path). conftest.py
holds only fixtures and pytest hooks, and no test module imports another.
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import CompileConfig, T5Config, T5ForConditionalGeneration

from archlab import DecoderConfig, DecoderForCausalLM, Seq2SeqConfig, Seq2SeqForConditionalGeneration
from archlab.conversion import FAMILIES
from archlab.conversion.t5 import archlab_state_dict_to_t5, t5_state_dict_to_archlab
from archlab.modeling.catalogue import MLP_LAYER_TYPES, POSITION_SCHEMES, SEQ2SEQ_POSITION_SCHEMES
from archlab.modeling.configuration_decoder import ROPE_TYPES

REPO = Path(__file__).resolve().parents[1]

# ---- tiny configs ------------------------------------------------------------------------------------------------

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# Seq2SeqConfig's token ids are its defaults: pad 0, bos 1 (also the decoder start), eos 2.
TINY_SEQ2SEQ = dict(
    vocab_size=61,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=48,
    decoder_ffn_dim=48,
    max_position_embeddings=64,
    dropout=0.0,
)

# The scripts' `--config_overrides` for a tiny model (the vocabulary comes from the tokenizer).
TINY_DECODER_OVERRIDES = (
    "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2"
)
TINY_SEQ2SEQ_OVERRIDES = (
    "d_model=32,encoder_ffn_dim=64,decoder_ffn_dim=64,encoder_layers=1,decoder_layers=1,"
    "encoder_attention_heads=2,decoder_attention_heads=2"
)


def tiny_decoder_config(**overrides) -> DecoderConfig:
    return DecoderConfig(**{**TINY, **overrides})


def tiny_seq2seq_config(**overrides) -> Seq2SeqConfig:
    return Seq2SeqConfig(**{**TINY_SEQ2SEQ, **overrides})


def tiny_config_for(config_class: type, **overrides):
    """The tiny config of a registered config class: `tiny_<family>_config` above (`archlab_seq2seq` ->
    `tiny_seq2seq_config`), so every family added to the registry gets export-tested once it has one."""
    family = config_class.model_type.removeprefix("archlab_")
    builder = globals().get(f"tiny_{family}_config")
    if builder is None:
        pytest.fail(f"tests/helpers.py needs `tiny_{family}_config` so {config_class.__name__} models are tested")
    return builder(**overrides)


# ---- every catalogue variant, for decoding (fast_decoding.py's tests) ------------------------------------------

# `rope_parameters` per rope type: generation (6 + 12 tokens) runs past `original_max_position_embeddings` (8), so
# the length-dependent types switch frequencies while decoding.
ROPE_PARAMETERS = {
    "default": {},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 8},
    "longrope": {
        "short_factor": [1.0] * 4,
        "long_factor": [4.0] * 4,
        "factor": 16.0,
        "original_max_position_embeddings": 8,
    },
    "llama3": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
    "proportional": {"partial_rotary_factor": 0.5},
}
WINDOW = 4  # well inside the 18 tokens generated
LOCAL_GLOBAL = ("full_attention", "sliding_attention")  # Gemma2's interleaved local and global layers
# Llama 4's attention: chunked rotating layers with a QK-norm without a gain after RoPE, NoPE global layers with the
# temperature tuning (a floor scale of 4 bites within the tokens generated)
LLAMA4_ATTENTION = dict(
    attention_chunk_size=WINDOW,
    layer_types=["chunked_attention", "full_attention"],
    nope_layers=[1],
    use_qk_norm=True,
    qk_norm_after_rope=True,
    qk_norm_weight=False,
    qk_norm_nope_layers=False,
    attn_temperature_tuning=True,
    floor_scale=4,
    attn_scale=0.5,
)
# Llama 4's experts: the sigmoid of the top-1 logit weighs the chosen expert's input, an ungated shared expert
LLAMA4_EXPERTS = dict(
    num_local_experts=4,
    num_experts_per_tok=1,
    router_score_function="sigmoid",
    norm_topk_prob=False,
    routing_weights_on_input=True,
    shared_expert_intermediate_size=32,
    shared_expert_gate=False,
)
DECODER_VARIANTS = {
    **{f"positions_{kind}": dict(position_embedding_type=kind) for kind in POSITION_SCHEMES},
    **{
        f"rope_{kind}": dict(rope_parameters={"rope_type": kind, "rope_theta": 1e4, **ROPE_PARAMETERS[kind]})
        for kind in ROPE_TYPES
    },
    "learned_positions_from_mask": dict(
        position_embedding_type="learned", position_ids_from_attention_mask=True, position_embedding_offset=2
    ),
    **{f"all_{kind}": dict(sliding_window=WINDOW, layer_types=[kind, kind]) for kind in LOCAL_GLOBAL},
    "local_global": dict(sliding_window=WINDOW, layer_types=list(LOCAL_GLOBAL)),
    "alibi_local_global": dict(position_embedding_type="alibi", sliding_window=WINDOW, layer_types=list(LOCAL_GLOBAL)),
    # Llama 4's chunked attention: each query sees its own block of WINDOW positions
    "all_chunked_attention": dict(attention_chunk_size=WINDOW, layer_types=["chunked_attention"] * 2),
    "llama4_attention": LLAMA4_ATTENTION,  # (above)
    # Mistral 3's query scaling: every rotating layer's queries scaled up at each step of 4 positions (its own
    # position ids: a left-padded row counts from its first token)
    "query_scaling": dict(query_scaling_beta=0.5, query_scaling_length=WINDOW),
    "rope_per_layer_type": dict(  # Gemma3: local layers with their own base, the global ones scaled
        sliding_window=WINDOW,
        layer_types=list(LOCAL_GLOBAL),
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
        },
    ),
    # RoPE interleaved with NoPE layers (Llama 4's iRoPE: local layers rotate, the global ones see no positions)
    "nope_global_layers": dict(
        nope_layers=[1], sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
    ),
    # μP's constants as Granite sets them: embeddings, each sub-layer's output, the scores and the logits scaled
    "mup_multipliers": dict(
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logit_scale=0.25
    ),
    "prefix_lm": dict(prefix_lm=True),
    "prefix_lm_alibi": dict(prefix_lm=True, position_embedding_type="alibi"),
    "softcapping_eager_attention": dict(attn_logit_softcapping=2.0, final_logit_softcapping=5.0),  # no sdpa here
    # OLMo 2's two choices: each sub-layer's output normed before the residual add, QK-norm over the projections
    "output_norm": dict(norm_position="output"),
    "qk_norm_over_projection": dict(use_qk_norm=True, qk_norm_scope="projection"),
    # a QK-norm gain per head (Command R+'s is a LayerNorm: tests/conversion and the catalogue variants)
    "qk_norm_per_head_gains": dict(use_qk_norm=True, qk_norm_scope="per_head"),
    # Hunyuan's QK-norm, applied to the rotated queries and keys
    "qk_norm_after_rope": dict(use_qk_norm=True, qk_norm_after_rope=True),
    # gated attention (AFMoE, Qwen3-Next): a sigmoid gate per channel on the heads' output
    "gated_attention": dict(attention_output_gate="elementwise"),
    # Sub-LN (Foundation Transformers, BitNet): norms before o_proj and down_proj, BitNet's ReLU² gated MLP
    "sub_layer_norm": dict(sub_layer_norm=True, hidden_act="relu2"),
    # multi-head latent attention (DeepSeek-V2/V3): keys and values expanded from a cached latent; queries through
    # their own latent, YaRN with DeepSeek's attention mscale
    "latent_attention": dict(
        num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
    ),
    "latent_attention_query_rank_yarn": dict(
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    # GPT-OSS's attention: a learned sink logit per head, on local and global layers
    "attention_sinks": dict(attention_sinks=True, sliding_window=WINDOW, layer_types=list(LOCAL_GLOBAL)),
    "moe": dict(num_local_experts=4, num_experts_per_tok=2),
    # DeepSeek-V3's router (GLM-4.5): sigmoid scores, a correction bias to choose, a routed scale; an ungated shared
    # expert
    "moe_sigmoid_router": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        router_score_function="sigmoid",
        router_correction_bias=True,
        routed_scaling_factor=2.5,
        shared_expert_intermediate_size=32,
        shared_expert_gate=False,
    ),
    "moe_group_limited_router": dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        router_score_function="sigmoid",
        router_correction_bias=True,
        router_groups=4,
        router_top_groups=2,
    ),
    # GPT-OSS's layer: sinks, biases everywhere, a router with a bias, experts with biases and the clamped SwiGLU
    "moe_gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        attention_sinks=True,
        attention_bias=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=1.0,
        swiglu_up_offset=1.0,
        hidden_act="quick_gelu",
    ),
    "moe_llama4": LLAMA4_EXPERTS,  # (above)
    "moe_shared_expert_dense_sparse": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=32,
        mlp_layer_types=list(MLP_LAYER_TYPES),
    ),
}
# fast_decoding.static_cache_blocker: these decode with the dynamic cache, its one-line notice naming what they need
NO_STATIC_CACHE_NOTICES = {"rope_dynamic": "dynamic RoPE"}
NO_STATIC_CACHE = set(NO_STATIC_CACHE_NOTICES)

SEQ2SEQ_VARIANTS = {
    **{f"positions_{kind}": dict(position_embedding_type=kind) for kind in SEQ2SEQ_POSITION_SCHEMES},
    "relative_bias_per_layer": dict(position_embedding_type="relative_bias", relative_attention_bias_per_layer=True),
    "pre_norm_gqa": dict(norm_position="pre", decoder_key_value_heads=2),
}


def randomised(model):
    """Weights of std 0.5 (norms near 1), so the logits are far from ties and the outputs vary."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5, generator=generator)
            else:
                parameter.normal_(0.0, 0.5, generator=generator)
    return model.eval()


def decoder_variant(name: str) -> DecoderForCausalLM:
    """The tiny decoder of `DECODER_VARIANTS[name]`, randomised, in eval mode."""
    return randomised(DecoderForCausalLM(tiny_decoder_config(**DECODER_VARIANTS[name])))


def seq2seq_variant(name: str) -> Seq2SeqForConditionalGeneration:
    """The tiny encoder-decoder of `SEQ2SEQ_VARIANTS[name]` (T5 buckets sized for it), randomised, in eval mode."""
    buckets = dict(relative_attention_num_buckets=8, relative_attention_max_distance=16)
    return randomised(Seq2SeqForConditionalGeneration(tiny_seq2seq_config(**buckets, **SEQ2SEQ_VARIANTS[name])))


# ---- tokenizers --------------------------------------------------------------------------------------------------


def trace_only_compile_regions(monkeypatch) -> None:
    """accelerate's `compile_regions` with dynamo's eager backend: the compiled paths of the CUDA suites and the
    profile traced on CPU, no code generated (that the path runs, in seconds)."""
    import accelerate.utils

    compile_regions = accelerate.utils.compile_regions
    monkeypatch.setattr(
        accelerate.utils, "compile_regions", lambda module, **kw: compile_regions(module, **kw, backend="eager")
    )


def trace_only_torch_compile(monkeypatch) -> None:
    """`torch.compile` with dynamo's eager backend, whatever backend is asked for: a compiled path traced on CPU,
    no code generated."""
    compile_model = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_model(model, **{**kw, "backend": "eager"}))


def forbid(monkeypatch, module, name: str, message: str) -> None:
    """Replace `module.name` with a function that fails the test with `message` if it is called (an expensive step
    that a check must come before: loading data, training a tokenizer)."""

    def never(*args, **kwargs):
        raise AssertionError(message)

    monkeypatch.setattr(module, name, never)


def digit_tokenizer():
    """Word-level tokenizer over the digits 0-9 (ids 3..12) with <pad>=0, <s>=1, </s>=2 (Seq2SeqConfig's ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{str(d): d + 3 for d in range(10)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def character_tokenizer():
    """One token per character (a-z, 0-9, space) after <pad>=0, <s>=1, </s>=2, decoded by concatenation: stop strings
    can span tokens. Left padding, as decoder-only generation wants."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = string.ascii_lowercase + string.digits + " "
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(characters)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


# ---- parity assertions -------------------------------------------------------------------------------------------


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4, msg: str = "") -> None:
    """Every element of `actual` within `rtol` x max|expected| of `expected`.

    The rounding error of a float32 sum follows the size of its largest terms, not of its result, and its exact value
    follows the CPU's summation order (AVX2 and AVX-512 kernels differ): a fixed absolute or an element-wise relative
    tolerance fails the small entries of a tensor with large ones (a gradient of 1e-3 next to one of 3) on some hosts.
    The default is the fp32 logit-parity standard (1e-4 on logits of order 1) taken relative to the scale. Infinite
    entries (banned tokens' scores) must be equal; the scale is that of the finite ones."""
    expected = expected.detach()
    finite = expected[torch.isfinite(expected)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    torch.testing.assert_close(
        actual.detach(),
        expected,
        rtol=0.0,
        atol=rtol * scale,
        msg=lambda text: f"{msg + ': ' if msg else ''}{text} (allowed: {rtol:g} x max|expected| {scale:.3g})",
    )


def seq2seq_incremental_logits(model, source, mask, target, prefix: int = 1) -> torch.Tensor:
    """Decoder logits for `target` computed with the cache: the first `prefix` tokens in one call (which also runs
    the encoder), then one token per call reusing the encoder output; to compare with one full forward."""
    with torch.no_grad():
        step = model(input_ids=source, attention_mask=mask, decoder_input_ids=target[:, :prefix], use_cache=True)
        logits, cache = [step.logits], step.past_key_values
        for t in range(prefix, target.shape[1]):
            step = model(
                encoder_outputs=(step.encoder_last_hidden_state,),
                attention_mask=mask,
                decoder_input_ids=target[:, t : t + 1],
                past_key_values=cache,
                use_cache=True,
            )
            logits.append(step.logits)
            cache = step.past_key_values
    return torch.cat(logits, 1)


# ---- T5 references: T5 v1.0 / v1.1 and, with their own shapes, mT5 and UMT5 --------------------------------------

T5_VOCAB = 61
# d_kv * num_heads (36) != d_model (32), as in T5 v1.1 small (6 heads of 64 on d_model 512)
T5_SHAPE = dict(
    vocab_size=T5_VOCAB,
    d_model=32,
    d_kv=12,
    d_ff=48,
    num_layers=2,
    num_heads=3,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=20,
    dropout_rate=0.0,
    decoder_start_token_id=0,
)
T5_VERSIONS = {
    "v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),  # tied head, output scaled by d_model^-0.5
    "v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),  # gelu_new GeGLU, separate head
}


def t5_reference(version: str, std: float = 0.3) -> T5ForConditionalGeneration:
    reference = T5ForConditionalGeneration(T5Config(**T5_SHAPE, **T5_VERSIONS[version])).eval()
    if version == "v1.1":
        # transformers 5 ties T5's head at construction even for v1.1 (and unties it when a checkpoint has its own)
        reference.lm_head.weight = torch.nn.Parameter(torch.empty(T5_VOCAB, 32))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "layer_norm" in name:
                parameter.uniform_(0.5, 1.5, generator=generator)
            else:  # 0.3: large enough that greedy decoding does not repeat one token
                parameter.normal_(0.0, std, generator=generator)
    return reference


def t5_pair(version: str, std: float = 0.3) -> tuple[T5ForConditionalGeneration, Seq2SeqForConditionalGeneration]:
    reference = t5_reference(version, std)
    config = FAMILIES["t5"].archlab_config(reference.config.to_dict())
    ours = Seq2SeqForConditionalGeneration(config).eval()
    ours.load_state_dict(t5_state_dict_to_archlab(reference.state_dict(), config), strict=True)
    return reference, ours


def t5_batch():
    """Two sources (the second right-padded) and two target prefixes starting with T5's start token (pad = 0)."""
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(2, T5_VOCAB, (2, 11), generator=generator)
    mask = torch.ones_like(source)
    mask[1, 6:] = 0
    source[1, 6:] = 0
    target = torch.randint(2, T5_VOCAB, (2, 8), generator=generator)
    target[:, 0] = 0
    return source, mask, target


def check_logits_and_loss_match(reference, ours) -> None:
    """fp32 logits within 1e-4, the encoder output and the loss with labels equal."""
    source, mask, target = t5_batch()
    with torch.no_grad():
        expected = reference(input_ids=source, attention_mask=mask, decoder_input_ids=target)
        got = ours(input_ids=source, attention_mask=mask, decoder_input_ids=target)
        assert expected.logits.std() > 0.05  # not a degenerate comparison
        assert (got.logits - expected.logits).abs().max() <= 1e-4
        torch.testing.assert_close(got.encoder_last_hidden_state, expected.encoder_last_hidden_state)
        labels = target.masked_fill(torch.tensor([[False] * 6 + [True] * 2, [False] * 8]), -100)
        expected_loss = reference(input_ids=source, attention_mask=mask, labels=labels).loss
        got_loss = ours(input_ids=source, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(got_loss, expected_loss, atol=1e-5, rtol=1e-5)


def training_gradients(reference, ours) -> tuple[dict, dict]:
    """One training step's gradients of both models (dropout is 0 in the shapes), archlab's in the reference's
    names."""
    reference.train(), ours.train()
    source, mask, target = t5_batch()
    labels = target.roll(-1, 1)
    reference(input_ids=source, attention_mask=mask, labels=labels).loss.backward()
    ours(input_ids=source, attention_mask=mask, labels=labels).loss.backward()
    grads = {name: p.grad for name, p in ours.named_parameters(remove_duplicate=False)}
    grads["final_logits_bias"] = torch.zeros_like(ours.final_logits_bias)
    expected = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False)}
    return archlab_state_dict_to_t5(grads, ours.config), expected


def check_generation_matches(reference, ours, generate_kwargs: dict) -> None:
    """Greedy or beam search gives the reference's tokens exactly."""
    source, mask, _ = t5_batch()
    kwargs = dict(input_ids=source, attention_mask=mask, max_new_tokens=12, do_sample=False, **generate_kwargs)
    expected = reference.generate(**kwargs)
    got = ours.generate(**kwargs)
    assert torch.equal(got, expected)
    assert len(set(expected[:, 1:].flatten().tolist())) > 2  # the outputs are not one repeated token


def check_incremental_and_eager_equal_full(ours) -> None:
    """Cached one-token decoding and the eager kernels reproduce the full sdpa forward."""
    source, mask, target = t5_batch()
    with torch.no_grad():
        full = ours(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    incremental = seq2seq_incremental_logits(ours, source, mask, target)
    with torch.no_grad():
        ours.set_attn_implementation("eager")
        eager = ours(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    assert_close_to_scale(incremental, full)  # logits up to 5: a fixed 1e-5 is below float32 rounding there
    assert_close_to_scale(eager, full)


def run_pythons_at_once(runs: list[tuple[str, dict[str, str]]], cwd: Path | None = None) -> list:
    """Each `(code, env)` of `runs` in its own fresh interpreter (`python -c code` with exactly `env`), all started
    at once (each costs ~10 s of imports on 2 cores): their `subprocess.CompletedProcess`es, in order."""
    started = [
        (
            command := [sys.executable, "-c", code],
            subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        )
        for code, env in runs
    ]
    done = []
    for command, process in started:
        stdout, stderr = process.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
    return done


# ---- combinations of catalogue choices -------------------------------------------------------------------------


def choice_fields(concerns: dict[str, dict[str, dict]], choices) -> dict:
    """The config fields of `choices`, each a (concern, choice) of `concerns` (concern -> choice -> fields)."""
    fields: dict = {}
    for concern, name in choices:
        fields.update(concerns[concern][name])
    return fields


def choice_names(choices) -> str:
    return "+".join(name for _, name in choices)


class AllPairsDesign:
    """Tiny models such that every pair of choices of two concerns that builds on its own meets in at least one model
    that builds: a greedy all-pairs design (Cohen et al. 1997, AETG), seeded, so the same models every run. Each model
    starts from the first pair not yet covered and adds one choice or none per other concern, the best of 40 random
    candidates. `build(choices)` makes the config and raises ValueError where the choices cannot be combined."""

    def __init__(self, concerns: dict[str, dict[str, dict]], build) -> None:
        self.concerns, self.build = concerns, build
        self.choices = [(concern, name) for concern, names in concerns.items() for name in names]
        self._refused: tuple | None = None
        self._models: tuple | None = None

    def builds(self, choices) -> bool:
        try:
            self.build(choices)
        except ValueError:
            return False
        return True

    def pairs(self) -> list[tuple]:
        return [pair for pair in itertools.combinations(self.choices, 2) if pair[0][0] != pair[1][0]]

    def refused_pairs(self) -> tuple[tuple, ...]:
        if self._refused is None:
            self._refused = tuple(pair for pair in self.pairs() if not self.builds(pair))
        return self._refused

    def buildable_pairs(self) -> set[tuple]:
        return set(self.pairs()) - set(self.refused_pairs())

    def covered_pairs(self) -> set[tuple]:
        return {pair for model in self.models() for pair in itertools.combinations(model, 2)}

    def models(self) -> tuple[tuple, ...]:
        if self._models is None:
            self._models = self._design()
        return self._models

    def _design(self) -> tuple[tuple, ...]:
        uncovered, rng, design = self.buildable_pairs(), random.Random(0), []
        while uncovered:
            seed_pair = min(uncovered, key=lambda pair: [self.choices.index(choice) for choice in pair])
            best, best_gain = seed_pair, 1
            for _ in range(40):
                model = list(seed_pair)
                taken = {concern for concern, _ in seed_pair}
                for concern in rng.sample(list(self.concerns), len(self.concerns)):
                    choice = None if concern in taken else rng.choice([None, *self.concerns[concern]])
                    if choice is not None:
                        model.append((concern, choice))
                model = tuple(sorted(model, key=self.choices.index))
                gain = sum(pair in uncovered for pair in itertools.combinations(model, 2))
                if gain > best_gain and self.builds(model):
                    best, best_gain = model, gain
            design.append(best)
            uncovered -= set(itertools.combinations(best, 2))
        return tuple(design)


# ---- archlab's decoding loops on CPU -----------------------------------------------------------------------------


def cpu_compile_config(fullgraph: bool = True) -> CompileConfig:
    """A `CompileConfig` under which transformers compiles the decoding step on CPU too (its `_compile_all_devices`
    testing hook), so `generate` on the static cache takes archlab's loops as it does by default on CUDA."""
    config = CompileConfig(backend="eager", mode=None, fullgraph=fullgraph)
    config._compile_all_devices = True
    return config


def count_archlab_loops(monkeypatch) -> list[str]:
    """Run archlab's greedy and beam loops with their steps uncompiled, and record which ran ("greedy", "beams")."""
    from archlab.modeling import beam_loop, decoding_loop, fast_decoding

    calls: list[str] = []

    def counted(name, loop):
        return lambda *args, **kwargs: calls.append(name) or loop(*args, **kwargs)

    monkeypatch.setattr(fast_decoding, "decode", counted("greedy", decoding_loop.decode))
    monkeypatch.setattr(fast_decoding, "beam_search", counted("beams", beam_loop.beam_search))
    monkeypatch.setattr(fast_decoding, "compiled_decoding_step", lambda model, config: decoding_loop.decoding_step)
    monkeypatch.setattr(fast_decoding, "compiled_beam_step", lambda model, config: beam_loop.beam_step)
    return calls
