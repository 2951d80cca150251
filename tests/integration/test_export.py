"""torch.export across the catalogue (docs/ecosystem.md has the table): every decoder variant, the encoder-decoder's
and the masked LM export their forward without a cache with a dynamic batch and length, and the program equals
eager at other sizes, with padding; the task heads (sequence and token classification, question answering, on the
decoder and the encoder) export as they are called, with a static and a dynamic batch and length, and ONNX Runtime
runs them to eager's outputs; transformers' ExecuTorch recipes (`TorchExportableModuleForDecoderOnlyLM` and
`Seq2SeqLMExportableModule`, static caches) decode token by token exactly as eager greedy decoding.

Left out: `rope_dynamic` (transformers' dynamic RoPE branches on the data: export refuses it) and `rope_longrope`
(the exported program keeps the frequencies the eager model last used), both exactly as on `LlamaForCausalLM`.
"""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.executorch import Seq2SeqLMExportableModule, TorchExportableModuleForDecoderOnlyLM

import archlab
from archlab import DecoderForCausalLM, EncoderForMaskedLM

from helpers import (
    DECODER_VARIANTS,
    assert_close_to_scale,
    randomised,
    seq2seq_variant,
    tiny_decoder_config,
    tiny_seq2seq_config,
)

pytestmark = pytest.mark.slow

UPSTREAM_FAILURES = {"rope_dynamic", "rope_longrope"}  # Llama's the same: see the module docstring
BLOCKS = {  # the concerns DECODER_VARIANTS leaves at the default
    "post_norm": dict(norm_position="post"),
    "sandwich_norm": dict(norm_position="sandwich"),
    "parallel_block": dict(norm_position="parallel"),
    "parallel_shared_norm": dict(norm_position="parallel_shared_norm", norm_type="layer_norm"),
    "deepnorm": dict(norm_position="deepnorm"),
    "qk_norm": dict(use_qk_norm=True),
    "mqa": dict(num_key_value_heads=1),
    "mha": dict(num_key_value_heads=4),
    "plain_gelu_mlp": dict(mlp_type="plain", hidden_act="gelu"),
    "geglu_offset_norm_scaled_embeddings": dict(
        hidden_act="gelu_pytorch_tanh", norm_type="offset_rms_norm", scale_embedding=True, embedding_layernorm=True
    ),
    "biases": dict(attention_bias=True, mlp_bias=True, lm_head_bias=True),
    "t5_bias_local_global": dict(
        position_embedding_type="relative_bias", sliding_window=4, layer_types=["full_attention", "sliding_attention"]
    ),
}
DECODERS = sorted(set(DECODER_VARIANTS) - UPSTREAM_FAILURES) + sorted(BLOCKS)


def _decoder(name: str) -> DecoderForCausalLM:
    fields = DECODER_VARIANTS[name] if name in DECODER_VARIANTS else BLOCKS[name]
    return randomised(DecoderForCausalLM(tiny_decoder_config(**fields)))


class _Logits(torch.nn.Module):
    """Tensors in, logits out, no cache."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids=None):
        extra = {} if decoder_input_ids is None else {"decoder_input_ids": decoder_input_ids}
        if not isinstance(self.model, EncoderForMaskedLM):
            extra["use_cache"] = False
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits


def _inputs(rows: int, cols: int, seq2seq: bool, left: bool = True) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(3, 61, (rows, cols))
    mask = torch.ones_like(ids)
    if left:
        mask[-1, : cols // 3] = 0
    else:
        mask[-1, cols - cols // 3 :] = 0
    return (ids, mask) + ((torch.randint(3, 61, (rows, cols - 2)),) if seq2seq else ())


def _export_matches_eager(model, seq2seq: bool = False, padded_rows_matter: bool = False) -> None:
    module = _Logits(model).eval()
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    shapes = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
    if seq2seq:
        shapes["decoder_input_ids"] = {0: batch, 1: torch.export.Dim("target")}
    program = torch.export.export(module, _inputs(2, 9, seq2seq), dynamic_shapes=shapes, strict=False).module()
    for rows, cols, left in ((2, 9, True), (3, 13, True), (1, 5, True), (4, 21, False)):
        feed = _inputs(rows, cols, seq2seq, left)
        with torch.no_grad():
            expected, got = module(*feed), program(*feed)
        keep = slice(None) if padded_rows_matter else feed[1].bool()  # a padded position's logits mean nothing
        assert_close_to_scale(got[keep], expected[keep], msg=f"{rows}x{cols}")


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_variant_exports_with_dynamic_shapes_equal_to_eager(name):
    _export_matches_eager(_decoder(name))


@pytest.mark.parametrize("name", ["prefix_lm", "prefix_lm_alibi"])
def test_prefix_lm_exports_with_prefix_lengths_as_an_input(name):
    model = _decoder(name)

    def logits(input_ids, attention_mask, prefix_lengths):
        return model(
            input_ids=input_ids, attention_mask=attention_mask, prefix_lengths=prefix_lengths, use_cache=False
        ).logits

    module = _Logits(model)
    module.forward = logits
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    shapes = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}, "prefix_lengths": {0: batch}}
    example = (*_inputs(2, 9, False, left=False), torch.tensor([3, 5]))
    program = torch.export.export(module, example, dynamic_shapes=shapes, strict=False).module()
    for rows, cols in ((2, 9), (3, 13), (1, 5)):
        ids, mask = _inputs(rows, cols, False, left=False)
        prefix = torch.randint(0, cols, (rows,))
        with torch.no_grad():
            expected, got = logits(ids, mask, prefix), program(ids, mask, prefix)
        assert_close_to_scale(got[mask.bool()], expected[mask.bool()], msg=f"{rows}x{cols}")


@pytest.mark.parametrize("name", ["positions_sinusoidal", "relative_bias_per_layer", "pre_norm_gqa"])
def test_seq2seq_exports_with_dynamic_shapes_equal_to_eager(name):
    _export_matches_eager(seq2seq_variant(name), seq2seq=True, padded_rows_matter=True)


def test_masked_lm_exports_with_dynamic_shapes_equal_to_eager():
    config = tiny_seq2seq_config(
        position_embedding_type="relative_bias", relative_attention_num_buckets=8, relative_attention_max_distance=16
    )
    _export_matches_eager(randomised(EncoderForMaskedLM(config)))


T5_BIAS = dict(
    position_embedding_type="relative_bias", relative_attention_num_buckets=8, relative_attention_max_distance=16
)
HEADS = {  # name: (class, config fields); every head once, the sequence classifier beyond the dense recipe too
    "decoder_sequence": ("DecoderForSequenceClassification", {}),
    "decoder_sequence_moe_shared_expert": (
        "DecoderForSequenceClassification",
        dict(num_local_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32),
    ),
    "decoder_sequence_t5_bias": ("DecoderForSequenceClassification", T5_BIAS),
    "decoder_sequence_alibi_local_global": (
        "DecoderForSequenceClassification",
        dict(position_embedding_type="alibi", sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    ),
    "decoder_token": ("DecoderForTokenClassification", {}),
    "decoder_question_answering": ("DecoderForQuestionAnswering", {}),
    "encoder_sequence": ("EncoderForSequenceClassification", {}),
    "encoder_sequence_t5_bias": ("EncoderForSequenceClassification", T5_BIAS),
    "encoder_token": ("EncoderForTokenClassification", {}),
    "encoder_question_answering": ("EncoderForQuestionAnswering", {}),
}


def _head(name: str):
    class_name, fields = HEADS[name]
    config = (tiny_decoder_config if class_name.startswith("Decoder") else tiny_seq2seq_config)(num_labels=3, **fields)
    return randomised(getattr(archlab, class_name)(config))


def _head_outputs_match(name: str, got, expected, mask: torch.Tensor, msg: str) -> None:
    """Every tensor of the output (logits; start and end logits), per token on the unpadded positions only."""
    assert len(got) == len(expected), msg
    per_token = "Sequence" not in HEADS[name][0]
    for got_part, expected_part in zip(got, expected):
        keep = mask.bool() if per_token else slice(None)
        assert_close_to_scale(torch.as_tensor(got_part)[keep], expected_part[keep], msg=msg)


HEAD_SIZES = ((2, 9, True), (3, 13, True), (1, 5, True), (4, 21, False))


def _head_inputs(name: str, rows: int, cols: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # the encoder's classifier pools its first token ([CLS]): its rows are padded on the right, as BERT's
    return _inputs(rows, cols, False, left=left and name.startswith("decoder"))


@pytest.mark.parametrize("name", list(HEADS))
def test_task_head_exports_as_called_with_static_and_dynamic_shapes_equal_to_eager(name):
    """The model itself, called as `model(input_ids=..., attention_mask=...)`, no wrapper: its output class comes
    out of the program. The decoder's sequence classifier returned a `DynamicCache` there (`config.use_cache`), which
    `torch.export` refused; the sliding layers' cache also pinned the length of a dynamic export."""
    model = _head(name)
    ids, mask = _head_inputs(name, 2, 9, True)
    static = torch.export.export(model, (), {"input_ids": ids, "attention_mask": mask}, strict=False).module()
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    shapes = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
    kwargs = {"input_ids": ids, "attention_mask": mask}
    dynamic = torch.export.export(model, (), kwargs, dynamic_shapes=shapes, strict=False).module()
    with torch.no_grad():
        _head_outputs_match(name, static(**kwargs).to_tuple(), model(**kwargs).to_tuple(), mask, "static 2x9")
        for rows, cols, left in HEAD_SIZES:
            ids, mask = _head_inputs(name, rows, cols, left)
            got, expected = dynamic(input_ids=ids, attention_mask=mask), model(input_ids=ids, attention_mask=mask)
            _head_outputs_match(name, got.to_tuple(), expected.to_tuple(), mask, f"{rows}x{cols}")


@pytest.mark.parametrize("name", list(HEADS))
def test_task_head_onnx_export_runs_in_onnxruntime_with_eager_outputs(name, tmp_path):
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    model = _head(name)
    outputs = ["start_logits", "end_logits"] if "question" in name else ["logits"]
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    ids, mask = _head_inputs(name, 2, 9, True)
    torch.onnx.export(  # the model itself, with gradients enabled, as docs/ecosystem.md's call
        model,
        (),
        tmp_path / "model.onnx",
        kwargs={"input_ids": ids, "attention_mask": mask},
        dynamo=True,
        dynamic_shapes={"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}},
        input_names=["input_ids", "attention_mask"],
        output_names=outputs,
    )
    session = ort.InferenceSession(str(tmp_path / "model.onnx"))
    assert [output.name for output in session.get_outputs()] == outputs
    for rows, cols, left in HEAD_SIZES:
        ids, mask = _head_inputs(name, rows, cols, left)
        got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).to_tuple()
        _head_outputs_match(name, [torch.from_numpy(array) for array in got], expected, mask, f"{rows}x{cols}")


PROMPT, NEW = 5, 12


def _greedy_without_cache(model, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, logits = prompt, []
    with torch.no_grad():
        for _ in range(NEW):
            last = model(input_ids=ids, use_cache=False).logits[:, -1]
            logits.append(last)
            ids = torch.cat([ids, last.argmax(-1, keepdim=True)], 1)
    return ids, torch.stack(logits, 1)


# latent attention caches latents, which the recipe's cache (sized from the config before the first update) cannot hold
LATENT_CACHES = {name for name, fields in DECODER_VARIANTS.items() if fields.get("kv_lora_rank")}


@pytest.mark.parametrize("name", sorted(set(DECODERS) - LATENT_CACHES))
def test_executorch_recipe_decodes_as_eager_greedy(name):
    """transformers' recipe for decoder-only LMs (a static cache; sliding layers keep every key and the mask cuts at
    the window), fed one token at a time as its `generate` does, past the 4-token windows."""
    model = _decoder(name)
    model.generation_config.cache_implementation = "static"
    prompt = torch.randint(3, 97, (1, PROMPT))
    expected_ids, expected_logits = _greedy_without_cache(model, prompt)
    recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=PROMPT + NEW)
    with torch.no_grad():
        program = recipe.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0])).module()
        for position in range(PROMPT):
            out = program(input_ids=prompt[:, position : position + 1], cache_position=torch.tensor([position]))
        ids, logits = prompt, []
        for _ in range(NEW):
            logits.append(out[:, -1])
            ids = torch.cat([ids, out[:, -1].argmax(-1, keepdim=True)], 1)
            out = program(input_ids=ids[:, -1:], cache_position=torch.tensor([ids.shape[1] - 1]))
    assert torch.equal(ids, expected_ids)
    assert_close_to_scale(torch.stack(logits, 1), expected_logits)


@pytest.mark.parametrize("name", sorted(LATENT_CACHES))
def test_the_executorch_recipe_is_refused_for_latent_attention_with_the_reason(name):
    model = _decoder(name)
    model.generation_config.cache_implementation = "static"
    recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=PROMPT + NEW)
    with pytest.raises(Exception, match="multi-head latent attention caches one latent of `kv_lora_rank`=16"):
        recipe.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))


@pytest.mark.parametrize("name", ["positions_sinusoidal", "relative_bias_per_layer"])
def test_seq2seq_executorch_recipe_decodes_as_eager_greedy(name):
    """`Seq2SeqLMExportableModule`'s encoder and decoder programs, driven from archlab's decoder start token (its
    own `generate` starts from 0, T5's)."""
    model = seq2seq_variant(name)
    start = model.config.decoder_start_token_id
    source = torch.randint(3, 61, (1, 7))
    expected, expected_logits = torch.tensor([[start]]), []
    with torch.no_grad():
        for _ in range(NEW):
            last = model(input_ids=source, decoder_input_ids=expected, use_cache=False).logits[:, -1]
            expected_logits.append(last)
            expected = torch.cat([expected, last.argmax(-1, keepdim=True)], 1)
    recipe = Seq2SeqLMExportableModule(model, max_hidden_seq_length=64, max_cache_length=32)
    recipe.export(encoder_input_ids=torch.ones(1, 10, dtype=torch.long), decoder_input_ids=torch.tensor([[start]]))
    ids, logits = torch.tensor([[start]]), []
    with torch.no_grad():
        encoded = recipe.exported_encoder.module()(source)
        for step in range(NEW):
            last = recipe.exported_decoder.module()(ids[:, -1:], encoded, torch.tensor([step]))[:, -1]
            logits.append(last)
            ids = torch.cat([ids, last.argmax(-1, keepdim=True)], 1)
    assert torch.equal(ids, expected)
    assert_close_to_scale(torch.stack(logits, 1), torch.stack(expected_logits, 1))
