"""PEFT LoRA (Hu et al. 2021) on archlab models: adapters on the attention and MLP projections (and the MoE experts'
stacked weights through `target_parameters`) train, save, reload, and `merge_and_unload` gives the adapter model's
logits with a plain archlab model that `AutoModel*.from_pretrained` loads. Adapter configs without `target_modules`
find PEFT's defaults for Llama's and Bart's module names (archlab.modeling.peft_defaults).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM  # noqa: E402

from archlab import (  # noqa: E402
    DecoderForCausalLM,
    DecoderForSequenceClassification,
    EncoderForMaskedLM,
    Seq2SeqForConditionalGeneration,
)
from archlab.modeling.import_hooks import after_import  # noqa: E402
from archlab.modeling.peft_defaults import PEFT_CONSTANTS_MODULE, register_with_peft  # noqa: E402

from helpers import tiny_decoder_config, tiny_seq2seq_config  # noqa: E402
from isolated import check, run_without_archlab  # noqa: E402

DECODER_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQ2SEQ_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def _decoder_batch(vocab: int = 97) -> dict[str, torch.Tensor]:
    """Counting sequences (a learnable task), one row left-padded."""
    ids = torch.arange(12)[None, :] + torch.tensor([[5], [20], [40], [60]])
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _seq2seq_batch(vocab: int = 61) -> dict[str, torch.Tensor]:
    """Copy the source shifted by one (a learnable task)."""
    source = torch.arange(9)[None, :] + torch.tensor([[5], [15], [30], [45]])
    return {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": source[:, :7] + 1}


CASES = {
    "decoder": (
        lambda: DecoderForCausalLM(tiny_decoder_config()),
        DECODER_TARGETS,
        _decoder_batch,
        AutoModelForCausalLM,
        "CAUSAL_LM",
    ),
    "seq2seq": (
        lambda: Seq2SeqForConditionalGeneration(tiny_seq2seq_config(decoder_start_token_id=0)),
        SEQ2SEQ_TARGETS,
        _seq2seq_batch,
        AutoModelForSeq2SeqLM,
        "SEQ_2_SEQ_LM",
    ),
}


def _logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**batch).logits  # with labels: the seq2seq model shifts them into its decoder inputs


def _train(model, batch: dict[str, torch.Tensor], steps: int = 12) -> list[float]:
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", list(CASES))
def test_lora_trains_saves_reloads_and_merges(tmp_path, family):
    build, targets, make_batch, auto_class, task_type = CASES[family]
    base = build()
    base.save_pretrained(tmp_path / "base")
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    batch = make_batch()

    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets, task_type=task_type)
    model = get_peft_model(base, config)
    wrapped = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == set(targets)  # every projection kind got an adapter
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    losses = _train(model, batch)
    assert losses[-1] < losses[0] - 0.1, losses  # it learns
    frozen = {
        k.replace("base_model.model.", "").replace(".base_layer", ""): v
        for k, v in model.state_dict().items()
        if "lora_" not in k
    }
    for name, value in base_state.items():  # the base weights did not move
        torch.testing.assert_close(frozen[name], value, rtol=0, atol=0)

    adapted = _logits(model, batch)
    assert (adapted - _logits(auto_class.from_pretrained(tmp_path / "base"), batch)).abs().max() > 1e-3
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

    reloaded = PeftModel.from_pretrained(auto_class.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(_logits(reloaded, batch), adapted, rtol=0, atol=1e-5)

    merged = reloaded.merge_and_unload()
    assert type(merged).__name__ == type(base).__name__
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(_logits(merged, batch), adapted, rtol=0, atol=1e-4)

    merged.save_pretrained(tmp_path / "merged")
    torch.testing.assert_close(
        _logits(auto_class.from_pretrained(tmp_path / "merged"), batch), adapted, rtol=0, atol=1e-4
    )


def test_lora_on_moe_experts_trains_reloads_and_merges(tmp_path):
    """PEFT's `target_parameters` puts LoRA on the experts' stacked weights (E, out, in), which archlab stores in
    transformers v5's layout (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`)."""
    base = DecoderForCausalLM(tiny_decoder_config(num_local_experts=4, num_experts_per_tok=2))
    base.save_pretrained(tmp_path / "base")
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model = get_peft_model(base, config)
    expert_adapters = [n for n, p in model.named_parameters() if p.requires_grad and ".experts." in n]
    assert len(expert_adapters) == 2 * 2 * 2  # 2 layers x 2 stacked weights x (A, B)
    batch = _decoder_batch()
    losses = _train(model, batch)
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if ".experts." in n and "lora_B" in n)
    adapted = _logits(model, batch)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(_logits(reloaded, batch), adapted, rtol=0, atol=1e-5)
    merged = reloaded.merge_and_unload()
    assert type(merged) is DecoderForCausalLM
    torch.testing.assert_close(_logits(merged, batch), adapted, rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("head", ["lora", "modules_to_save"])
def test_an_adapted_lm_head_is_what_the_training_loss_reads(case, head):
    """The chunked training loss reads the head's weight directly; a head PEFT wraps (a LoRA layer on `lm_head`, or
    a trained copy of it through `modules_to_save`) must run through its module instead, so the training loss is the
    adapted head's: equal to the unchunked loss, and the adapter gets a gradient."""
    build, targets, batch_fn, _, task = CASES[case]
    torch.manual_seed(0)
    model = build()
    extra = dict(target_modules=[*targets, "lm_head"]) if head == "lora" else dict(modules_to_save=["lm_head"])
    extra.setdefault("target_modules", targets)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, task_type=task, **extra))
    with torch.no_grad():  # an adapted head that differs from the base head
        for name, parameter in peft_model.named_parameters():
            if "lm_head" in name and parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    peft_model.train()
    batch = batch_fn()
    assert model.config.lm_loss_chunk_size > 0
    chunked = peft_model(**batch).loss
    chunked.backward()
    adapter_grads = [p.grad for n, p in peft_model.named_parameters() if "lm_head" in n and p.requires_grad]
    assert adapter_grads and all(g is not None and g.abs().sum() > 0 for g in adapter_grads)
    model.config.lm_loss_chunk_size = 0
    torch.testing.assert_close(peft_model(**batch).loss, chunked, rtol=1e-5, atol=1e-6)


def test_prefix_tuning_generates_with_its_prefix():
    """PEFT's prefix tuning hands its prefix cache as `past_key_values` beside generate's own (empty) `cache`
    (transformers 5.24's name): generate's tokens are those of a forward-by-forward greedy loop through the adapter
    model, and differ from the plain model's (transformers' stock models keep the new name and drop the prefix)."""
    from peft import PrefixTuningConfig

    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    adapted = get_peft_model(model, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)).eval()
    with torch.no_grad():
        for parameter in adapted.prompt_encoder.parameters():
            parameter.mul_(30)  # a prefix large enough to change the tokens
    ids = torch.randint(3, 97, (1, 10), generator=torch.Generator().manual_seed(1))
    reference = ids
    with torch.no_grad():
        for _ in range(5):
            logits = adapted(input_ids=reference, attention_mask=torch.ones_like(reference)).logits
            reference = torch.cat([reference, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        plain = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    generated = adapted.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    assert torch.equal(generated, reference)
    assert not torch.equal(generated, plain)


def test_prefix_tuning_a_sequence_classifier_pools_each_rows_last_token():
    """PEFT's prefix tuning prepends its virtual tokens' columns to the attention mask; the classifier multiplied the
    whole mask by the input's positions and failed (`The size of tensor a (6) must match the size of tensor b
    (10)`) where `LlamaForSequenceClassification`, which pools from the ids, runs. A right-padded row gives its
    logits alone, and the loss (with the auxiliary LM term) runs."""
    from peft import PrefixTuningConfig

    model = DecoderForSequenceClassification(tiny_decoder_config(num_labels=3, classifier_lm_loss_weight=0.5))
    adapted = get_peft_model(model.eval(), PrefixTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4)).eval()
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    with torch.no_grad():
        out = adapted(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 2]))
        alone = adapted(input_ids=ids[1:, :4], attention_mask=mask[1:, :4]).logits
    torch.testing.assert_close(out.logits[1:], alone, atol=1e-5, rtol=1e-4)
    assert torch.isfinite(out.loss)


def test_seq2seq_prefix_tuning_sized_for_the_decoders_key_value_heads():
    """PEFT sizes a prefix from `num_attention_heads` and the width: a decoder with GQA is refused by name, with the
    sizes to give; given them, the adapter trains and generates."""
    from peft import PrefixTuningConfig

    config = tiny_seq2seq_config(decoder_key_value_heads=2, decoder_start_token_id=0)
    batch = _seq2seq_batch()
    sized_by_peft = PrefixTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=3)
    with pytest.raises(ValueError, match="decoder_key_value_heads"):
        get_peft_model(Seq2SeqForConditionalGeneration(config), sized_by_peft)(**batch)
    head_dim = config.d_model // config.decoder_attention_heads
    sized = PrefixTuningConfig(
        task_type="SEQ_2_SEQ_LM", num_virtual_tokens=3, num_attention_heads=2, token_dim=2 * head_dim
    )
    adapted = get_peft_model(Seq2SeqForConditionalGeneration(config), sized)
    adapted(**batch).loss.backward()
    assert all(p.grad is not None for p in adapted.prompt_encoder.parameters() if p.requires_grad)
    assert adapted.generate(input_ids=batch["input_ids"], max_new_tokens=3).shape[0] == 4


DEFAULT_TARGET_CASES = {
    "decoder": (lambda: DecoderForCausalLM(tiny_decoder_config()), "CAUSAL_LM"),
    "seq2seq": (lambda: Seq2SeqForConditionalGeneration(tiny_seq2seq_config()), "SEQ_2_SEQ_LM"),
    "masked_lm": (lambda: EncoderForMaskedLM(tiny_seq2seq_config()), None),
}


@pytest.mark.parametrize("case", DEFAULT_TARGET_CASES)
def test_lora_without_target_modules_adapts_queries_and_values(case, monkeypatch):
    """PEFT refused archlab's model types without `target_modules`; they take Llama's and Bart's defaults."""
    from peft.utils import constants

    for table in (
        constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING,
        constants.TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING,
    ):
        for model_type in ("archlab_decoder", "archlab_seq2seq"):
            monkeypatch.delitem(table, model_type, raising=False)
    after_import(PEFT_CONSTANTS_MODULE, register_with_peft)  # PEFT is loaded: registers at once
    build, task_type = DEFAULT_TARGET_CASES[case]
    model = get_peft_model(build(), LoraConfig(task_type=task_type))
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"q_proj", "v_proj"}
    attentions = [module for module in model.modules() if hasattr(module, "q_proj") and hasattr(module, "v_proj")]
    assert attentions and all(hasattr(a.q_proj, "lora_A") and hasattr(a.v_proj, "lora_A") for a in attentions)


@pytest.mark.slow
def test_import_archlab_leaves_peft_alone_until_peft_loads_then_registers() -> None:
    code = (
        "import sys, archlab\n"
        "assert 'peft' not in sys.modules, 'import archlab imported peft'\n"
        "from peft import LoraConfig, get_peft_model\n"
        "from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as table\n"
        "assert table['archlab_decoder'] == table['llama'] and table['archlab_seq2seq'] == table['bart']\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("peft_first", [False, True])
def test_a_remote_code_model_without_archlab_finds_peft_defaults_too(tmp_path, peft_first) -> None:
    """The saved model's own copy of the code registers PEFT's defaults, whether PEFT is imported before the model
    loads or after."""
    DecoderForCausalLM(tiny_decoder_config()).save_pretrained(tmp_path / "model")
    peft_import = "from peft import LoraConfig, get_peft_model\n"
    code = (
        (peft_import if peft_first else "")
        + "from transformers import AutoModelForCausalLM\n"
        + f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'model')!r}, trust_remote_code=True)\n"
        + ("" if peft_first else peft_import)
        + "model = get_peft_model(model, LoraConfig(task_type='CAUSAL_LM'))\n"
        + "print(sorted({n.rsplit('.', 1)[-1] for n, m in model.named_modules() if hasattr(m, 'lora_A')}))\n"
    )
    assert check(run_without_archlab(code, tmp_path / "run")).strip().splitlines()[-1] == "['q_proj', 'v_proj']"


def test_moe_helpers_find_a_router_and_experts_that_peft_wraps(monkeypatch):
    """LoRA on the router's and the experts' weights (`target_parameters`) puts them inside PEFT's `ParamWrapper`,
    which does not forward their attributes: `count_parameters` counts the wrapped model (it read `gate.top_k`),
    reentrant checkpointing still says that a trained router's losses train nothing (it read the frozen
    `gate.weight`), and the fused decoding step leaves such a layer to its own forward (it read `experts.gated`,
    and `gate.weight` without the adapter)."""
    from archlab import count_parameters
    from archlab.modeling import decode_block, moe

    config = tiny_decoder_config(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
    expected = count_parameters(DecoderForCausalLM(config))
    lora = LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["mlp.gate.weight", "mlp.experts.gate_up_proj"])
    model = get_peft_model(DecoderForCausalLM(config), lora)
    counts = count_parameters(model)
    added = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert counts["total"] == expected["total"] + added and counts["embedding"] == expected["embedding"]

    warned = []
    monkeypatch.setattr(moe.logger, "warning_once", warned.append)
    model.train()
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(3, 97, (2, 8))
    model(input_ids=ids, labels=ids)
    assert len(warned) == 1 and "use_reentrant" in warned[0]

    monkeypatch.setattr(decode_block, "moe_decode_applies", lambda experts, hidden: experts.gated)
    monkeypatch.setattr(decode_block, "gemv_applies", lambda *tensors, **kwargs: True)
    hidden = torch.randn(1, 1, config.hidden_size)
    plain = DecoderForCausalLM(config).eval().model.layers[0]
    assert decode_block._moe_fits(plain, hidden)  # the check this test relies on passes for a plain layer
    assert not decode_block._moe_fits(model.eval().base_model.model.model.layers[0], hidden)

    # a balancing router (DeepSeek-V3's correction bias) inside the wrapper counts its loads and moves its biases
    balancing = dict(router_score_function="sigmoid", router_correction_bias=True, router_bias_update_rate=0.1)
    model = get_peft_model(DecoderForCausalLM(tiny_decoder_config(**dict(config.to_diff_dict(), **balancing))), lora)
    model.train()(input_ids=ids, labels=ids)
    router = next(m for m in model.modules() if isinstance(m, moe.TopKRouter))
    assert router.expert_load.sum() == ids.numel() * 2  # tokens x k
    router.expert_load.copy_(torch.tensor([3.0, 1.0, 0.0, 0.0]))
    assert moe.update_router_biases(model) == config.num_hidden_layers
    torch.testing.assert_close(router.e_score_correction_bias, torch.tensor([-0.1, 0.0, 0.1, 0.1]))  # mean 1


EMBEDDING_CASES = {
    "decoder": (lambda: DecoderForCausalLM(tiny_decoder_config()), 97, "CAUSAL_LM"),
    "seq2seq": (lambda: Seq2SeqForConditionalGeneration(tiny_seq2seq_config(decoder_start_token_id=0)), 61, None),
    "masked_lm": (lambda: EncoderForMaskedLM(tiny_seq2seq_config()), 61, None),
}


@pytest.mark.parametrize("case", EMBEDDING_CASES)
def test_lora_on_the_token_embeddings_runs_and_still_checks_ids(case):
    """LoRA on `embed_tokens` (as on Llama's or Bart's) wraps the embedding in PEFT's `Embedding`, which has no
    `num_embeddings`: the forward's token-id check read it and every forward failed. The check stays."""
    build, vocab, task = EMBEDDING_CASES[case]
    model = build().eval()
    ids = torch.arange(3, 11)[None, :]
    inputs = {"input_ids": ids} | ({"decoder_input_ids": ids[:, :4]} if case == "seq2seq" else {})
    with torch.no_grad():
        before = model(**inputs).logits
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["embed_tokens"], task_type=task)).eval()
    assert any(type(m).__name__ == "Embedding" and hasattr(m, "lora_embedding_A") for m in adapted.modules())
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_embedding_" in name:  # (PEFT starts A at zero)
                parameter.normal_()
        assert (adapted(**inputs).logits - before).abs().max() > 1e-3
        with pytest.raises(ValueError, match=f"outside the model's vocabulary: `vocab_size` is {vocab}"):
            adapted(**(inputs | {"input_ids": ids + vocab}))


def test_lora_on_scaled_token_embeddings_adds_the_delta_its_merged_weights_add():
    """Under `scale_embedding` the embedding module scales its output (√d, as Gemma's); PEFT's LoRA `Embedding`
    scales its adapter's output by the base layer's `embed_scale`. The unmerged adapter must give what its merged
    weights give (an unscaled delta differed by the adapter's whole effect × (√d − 1))."""
    torch.manual_seed(0)
    model = DecoderForCausalLM(tiny_decoder_config(scale_embedding=True)).eval()
    config = LoraConfig(r=2, target_modules=["embed_tokens"], init_lora_weights=False, task_type="CAUSAL_LM")
    adapted = get_peft_model(model, config).eval()
    ids = torch.arange(3, 11)[None, :]
    with torch.no_grad():
        unmerged = adapted(input_ids=ids).logits
        merged = adapted.merge_and_unload()(input_ids=ids).logits
    torch.testing.assert_close(unmerged, merged, rtol=0, atol=1e-5 * merged.abs().max().item())


HEAD_ADAPTERS = {
    "EncoderForSequenceClassification": ("SEQ_CLS", EncoderForMaskedLM),
    "EncoderForTokenClassification": ("TOKEN_CLS", EncoderForMaskedLM),
    "DecoderForSequenceClassification": ("SEQ_CLS", DecoderForCausalLM),
    "DecoderForTokenClassification": ("TOKEN_CLS", DecoderForCausalLM),
    "DecoderForQuestionAnswering": ("QUESTION_ANS", DecoderForCausalLM),
}


@pytest.mark.parametrize("head", list(HEAD_ADAPTERS))
def test_a_task_heads_adapter_reloaded_on_its_base_folder_gives_its_outputs(tmp_path, head):
    """A task head fine-tuned with LoRA from a pretrained folder (PEFT saves the adapters and `classifier`/`score`/
    `qa_outputs`), reloaded on that folder and merged, gives the adapted model's outputs. The encoder's sequence
    classifier's pooler, new on a masked LM's folder and not saved by PEFT, was drawn afresh at each load: its
    reloaded logits differed by 0.048 here."""
    import archlab

    task_type, body_class = HEAD_ADAPTERS[head]
    head_class = getattr(archlab, head)
    config = tiny_seq2seq_config() if body_class is EncoderForMaskedLM else tiny_decoder_config()
    body_class(config).save_pretrained(tmp_path / "base")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [20, 21, 22, 23, 24, 25]])

    def outputs(model) -> torch.Tensor:
        with torch.no_grad():
            output = model(input_ids=ids)
        return output.start_logits if task_type == "QUESTION_ANS" else output.logits

    torch.manual_seed(1)
    adapter = LoraConfig(task_type=task_type, target_modules=["q_proj", "v_proj"], r=4, init_lora_weights=False)
    tuned = get_peft_model(head_class.from_pretrained(tmp_path / "base", num_labels=3), adapter).eval()
    expected = outputs(tuned)
    tuned.save_pretrained(tmp_path / "adapter")
    torch.manual_seed(2)  # another draw for whatever the folders lack
    base = head_class.from_pretrained(tmp_path / "base", num_labels=3)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(outputs(reloaded.eval()), expected)
    torch.testing.assert_close(outputs(reloaded.merge_and_unload().eval()), expected, rtol=1e-5, atol=1e-6)
