"""Liger Kernel on archlab models (src/archlab/liger.py): which modules get which kernel and which are left as they
are, the registration that makes `TrainingArguments(use_liger_kernel=True)` apply them, and that a patched model
computes the loss and gradients of the plain one.

Liger's kernels run where CUDA is. On a CPU the tests that run them (`runs_kernels`) are skipped in this process and
run by `test_kernels_through_the_triton_interpreter` in a fresh one under Triton's interpreter
(tests/triton_interpreter.py). Skipped as a whole where liger-kernel is not installed (it is not in the `dev` extra:
it brings Triton, ~290 MB to download and ~1 GB installed).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("liger_kernel") is None:
    pytest.skip("liger-kernel is not installed", allow_module_level=True)

from datasets import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import archlab
from archlab.liger import apply_liger_kernel_to_archlab, register_with_liger_when_loaded
from archlab.modeling.attention import Attention
from archlab.modeling.feed_forward import GatedMLP
from archlab.modeling.normalization import LayerNorm, OffsetRMSNorm, RMSNorm
from archlab.modeling.rotary import apply_rotary

from helpers import assert_close_to_scale, tiny_decoder_config, tiny_seq2seq_config
from triton_interpreter import INTERPRETING, fill_interpreter_gaps, is_interpreted, run_pytest_interpreted

KERNELS_RUN_HERE = torch.cuda.is_available() or INTERPRETING
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
runs_kernels = pytest.mark.skipif(
    not KERNELS_RUN_HERE, reason="runs Liger's kernels: on CPU, test_kernels_through_the_triton_interpreter runs it"
)

PARTIAL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
# Decoder configs covering every kernel and every option the fused loss takes.
DECODERS = {
    "llama": {},
    "gemma2-like": dict(  # (1 + w) norms, GeGLU, sandwich blocks, QK-norm, partial rotary, soft-cap, z-loss, head bias
        norm_type="offset_rms_norm",
        hidden_act="gelu_pytorch_tanh",
        norm_position="sandwich",
        use_qk_norm=True,
        rope_parameters=PARTIAL_ROPE,
        final_logit_softcapping=5.0,
        lm_z_loss_coef=1e-3,
        lm_head_bias=True,
    ),
    "neox-like": dict(norm_type="layer_norm", norm_bias=True, norm_position="parallel", hidden_act="silu"),
    "sub-ln": dict(sub_layer_norm=True),  # Sub-LN: a norm between the SwiGLU kernel and the down projection
    "rope-per-layer-type": dict(  # Gemma3's form: a partial RoPE on one layer type only
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        rope_parameters={
            "sliding_attention": dict(PARTIAL_ROPE, partial_rotary_factor=1.0),
            "full_attention": PARTIAL_ROPE,
        },
    ),
    # each sub-layer's output normed before the residual add (the norm's output gradient is the residual's), QK-norm
    # over the whole projections
    "olmo2-like": dict(norm_position="output", use_qk_norm=True, qk_norm_scope="projection"),
}
SEQ2SEQS = {
    "marian": {},  # post-LayerNorm with biases, ReLU FFN, `final_logits_bias`
    "gated-rms": dict(norm_type="rms_norm", norm_position="pre", mlp_type="gated", activation_function="silu"),
}


@pytest.fixture(autouse=True)
def _interpreter_gaps(monkeypatch):
    """Under Triton's interpreter, Liger's kernels need its two gaps filled (tests/triton_interpreter.py)."""
    if INTERPRETING:
        import liger_kernel.transformers.functional  # noqa: F401  (loads the kernel modules to fill)

        fill_interpreter_gaps(monkeypatch, "liger_kernel")


def _decoder(**overrides) -> archlab.DecoderForCausalLM:
    return archlab.DecoderForCausalLM(tiny_decoder_config(**overrides))


def _patched(module) -> bool:
    return "forward" in module.__dict__ and hasattr(module, "liger_kernel")


# ---- registration -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_import_archlab_leaves_liger_alone_until_liger_loads_then_registers() -> None:
    """A fresh process: `import archlab` imports no Liger; importing Liger the way Trainer does registers archlab."""
    code = (
        "import sys, archlab\n"
        "assert 'liger_kernel' not in sys.modules, 'import archlab imported liger_kernel'\n"
        "from liger_kernel.transformers import _apply_liger_kernel_to_instance\n"  # transformers' integration
        "from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN as table\n"
        "assert table['archlab_decoder'] is table['archlab_seq2seq'] is archlab.apply_liger_kernel_to_archlab\n"
        "assert sys.modules['liger_kernel.transformers.monkey_patch'].__loader__.__class__.__name__ != "
        "'_RunAfterExec'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_registration_when_liger_was_loaded_first(monkeypatch) -> None:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN as table

    for model_type in ("archlab_decoder", "archlab_seq2seq"):
        monkeypatch.delitem(table, model_type, raising=False)
    register_with_liger_when_loaded()
    assert table["archlab_decoder"] is table["archlab_seq2seq"] is apply_liger_kernel_to_archlab


# ---- which module gets which kernel (nothing runs) -----------------------------------------------------------------


def test_llama_recipe_gets_every_kernel() -> None:
    model = _decoder()
    report = apply_liger_kernel_to_archlab(model)
    layers = model.config.num_hidden_layers
    assert report.applied == {
        "rms_norm": 2 * layers + 1,
        "swiglu": layers,
        "rope": layers,
        "fused_linear_cross_entropy": 1,
    }
    assert not report.left_as_is
    assert all(_patched(m) for m in model.modules() if isinstance(m, (RMSNorm, GatedMLP)))
    assert all(m.rotate is not apply_rotary for m in model.modules() if isinstance(m, Attention))
    assert callable(model.lm_head.fused_linear_cross_entropy)
    fresh = _decoder()  # the classes are untouched
    assert not any(hasattr(m, "liger_kernel") for m in fresh.modules())
    assert fresh.model.layers[0].self_attn.rotate is apply_rotary


def test_olmo2_output_norms_and_projection_qk_norms_get_the_rms_norm_kernel() -> None:
    model = _decoder(**DECODERS["olmo2-like"])
    report = apply_liger_kernel_to_archlab(model)
    layers = model.config.num_hidden_layers
    assert report.applied["rms_norm"] == 4 * layers + 1 and not report.left_as_is  # 2 output norms, q_norm, k_norm
    assert all(_patched(m) for m in model.modules() if isinstance(m, RMSNorm))


def test_gemma_norms_and_geglu_get_their_kernels() -> None:
    model = _decoder(**DECODERS["gemma2-like"])
    report = apply_liger_kernel_to_archlab(model)
    assert report.applied["geglu"] == model.config.num_hidden_layers and not report.left_as_is
    assert all(_patched(m) for m in model.modules() if isinstance(m, OffsetRMSNorm))


@pytest.mark.parametrize(
    ("build", "left_as_is"),
    [
        (lambda: _decoder(mlp_type="plain", hidden_act="gelu"), "plain MLP"),
        (lambda: _decoder(hidden_act="gelu"), "gated MLP with GELUActivation"),  # exact GELU: Liger's is tanh
        (lambda: _decoder(norm_type="layer_norm", norm_bias=False), "LayerNorm without bias"),
        (
            lambda: _decoder(mlp_layer_types=["sparse"] * 2, num_local_experts=4, num_experts_per_tok=2),
            "routed experts",
        ),
        (lambda: archlab.EncoderForMaskedLM(tiny_seq2seq_config()), "masked-LM head"),
        (lambda: archlab.Seq2SeqForConditionalGeneration(tiny_seq2seq_config()), "plain FFN"),
    ],
    ids=["plain-mlp", "exact-gelu-glu", "bias-free-layernorm", "moe-experts", "masked-lm-head", "seq2seq-relu-ffn"],
)
def test_variants_liger_does_not_compute_are_left_as_they_are_and_listed(build, left_as_is, caplog) -> None:
    model = build()
    untouched = {name for name, module in model.named_modules() if "forward" not in module.__dict__}
    with caplog.at_level(logging.WARNING, logger="archlab.liger"):
        report = apply_liger_kernel_to_archlab(model)
    assert report.left_as_is[left_as_is] > 0
    lines = [r.getMessage() for r in caplog.records if r.name == "archlab.liger"]
    assert len(lines) == 1 and "left as they are: " in lines[0] and left_as_is in lines[0], lines
    for name, module in model.named_modules():
        if not _patched(module):
            assert name in untouched, f"{name} lost its forward without being marked"
    kinds = {"plain MLP": "mlp", "gated MLP with GELUActivation": "mlp", "routed experts": "experts"}
    if left_as_is in kinds:
        assert not any(_patched(m) for n, m in model.named_modules() if n.endswith(kinds[left_as_is]))
    if left_as_is == "LayerNorm without bias":
        assert not any(_patched(m) for m in model.modules() if isinstance(m, LayerNorm))


def test_seq2seq_gets_layer_norm_and_the_fused_loss() -> None:
    model = archlab.Seq2SeqForConditionalGeneration(tiny_seq2seq_config())
    report = apply_liger_kernel_to_archlab(model)
    assert report.applied["layer_norm"] > 0 and report.applied["fused_linear_cross_entropy"] == 1
    gated = archlab.Seq2SeqForConditionalGeneration(tiny_seq2seq_config(**SEQ2SEQS["gated-rms"]))
    assert apply_liger_kernel_to_archlab(gated).applied["swiglu"] == 4  # two encoder and two decoder layers


def test_arguments_switch_kernels_off() -> None:
    model = _decoder()
    report = apply_liger_kernel_to_archlab(model, rope=False, fused_linear_cross_entropy=False)
    assert report.left_as_is["rope (switched off)"] == model.config.num_hidden_layers
    assert report.left_as_is["fused_linear_cross_entropy (switched off)"] == 1
    assert not hasattr(model.lm_head, "fused_linear_cross_entropy")
    assert all(m.rotate is apply_rotary for m in model.modules() if isinstance(m, Attention))


def test_patching_twice_is_patching_once() -> None:
    model = _decoder()
    first = apply_liger_kernel_to_archlab(model)
    forward = model.model.norm.forward
    assert apply_liger_kernel_to_archlab(model) == first
    assert model.model.norm.forward.__func__ is forward.__func__


def test_without_a_model_nothing_is_patched() -> None:
    assert apply_liger_kernel_to_archlab(model=None) is None  # Liger's class-level path: archlab patches instances


def test_patched_model_saves_and_reloads_as_a_plain_model(tmp_path: Path) -> None:
    model = _decoder().eval()
    reference = copy.deepcopy(model)
    apply_liger_kernel_to_archlab(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not any(hasattr(m, "liger_kernel") for m in loaded.modules())
    assert loaded.state_dict().keys() == reference.state_dict().keys()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    ids = torch.randint(3, 90, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=0)


# ---- the patched model computes what the plain one does (kernels run) --------------------------------------------


def _loss_and_gradients(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_training_step(plain, batch: dict) -> None:
    plain = plain.to(DEVICE).train()
    patched = copy.deepcopy(plain)
    apply_liger_kernel_to_archlab(patched)
    batch = {key: value.to(DEVICE) for key, value in batch.items()}
    loss, grads = _loss_and_gradients(plain, batch)
    patched_loss, patched_grads = _loss_and_gradients(patched, batch)
    assert_close_to_scale(patched_loss, loss, msg="loss")
    assert patched_grads.keys() == grads.keys()
    largest = max(grad.abs().max().item() for grad in grads.values())
    for name, grad in grads.items():
        # 1e-4 of each gradient's scale, and at least 1e-7 of the largest: a key bias's gradient is zero up to
        # rounding (softmax ignores a shift along a query's row), and its own scale is that rounding noise
        atol = max(1e-4 * grad.abs().max().item(), 1e-7 * largest)
        torch.testing.assert_close(
            patched_grads[name], grad, rtol=0, atol=atol, msg=lambda text, n=name: f"{n}: {text}"
        )
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():  # inference: norms, MLPs and RoPE patched, logits from the plain head
        assert_close_to_scale(patched.eval()(**inputs).logits, plain.eval()(**inputs).logits, msg="logits")


@runs_kernels
@pytest.mark.parametrize("variant", DECODERS)
def test_patched_decoder_matches_plain_decoder(variant: str) -> None:
    ids = torch.randint(3, 90, (2, 9))
    labels = ids.masked_fill(torch.rand(ids.shape) < 0.2, -100)  # ignored targets too
    _assert_same_training_step(_decoder(**DECODERS[variant]), {"input_ids": ids, "labels": labels})


@runs_kernels
@pytest.mark.parametrize("variant", SEQ2SEQS)
def test_patched_seq2seq_matches_plain_seq2seq(variant: str) -> None:
    model = archlab.Seq2SeqForConditionalGeneration(tiny_seq2seq_config(**SEQ2SEQS[variant]))
    model.final_logits_bias.normal_()  # Marian's constant bias after the head, inside the fused loss
    source, target = torch.randint(3, 60, (2, 7)), torch.randint(3, 60, (2, 6))
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(target)
    _assert_same_training_step(model, {"input_ids": source, "labels": target, "decoder_input_ids": decoder_input_ids})


def _counting_dataset(rows: int = 8, length: int = 12) -> Dataset:
    starts = torch.randint(3, 60, (rows,)).tolist()
    return Dataset.from_list(
        [{"input_ids": list(range(s, s + length)), "labels": list(range(s, s + length))} for s in starts]
    )


@runs_kernels
def test_plain_trainer_with_use_liger_kernel_patches_and_trains_like_without(tmp_path: Path) -> None:
    """`transformers.Trainer`, nothing archlab-specific: the flag patches the model when training starts; losses of
    two steps and the evaluation loss (which Trainer computes with `skip_logits=True`) equal the plain run's."""
    data = _counting_dataset()
    histories = {}
    for use_liger in (False, True):
        args = TrainingArguments(
            output_dir=str(tmp_path / str(use_liger)),
            use_liger_kernel=use_liger,
            max_steps=2,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=4,
            prediction_loss_only=True,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            seed=0,
            use_cpu=DEVICE == "cpu",
            disable_tqdm=True,
        )
        torch.manual_seed(0)
        model = _decoder()
        trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
        trainer.train()
        histories[use_liger] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        histories[use_liger].append(trainer.evaluate()["eval_loss"])
        patched = [m.liger_kernel for m in model.modules() if hasattr(m, "liger_kernel")]
        assert bool(patched) == use_liger
    assert {"rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"} <= set(patched)
    torch.testing.assert_close(torch.tensor(histories[True]), torch.tensor(histories[False]), rtol=1e-4, atol=1e-5)


# ---- on a CPU: the kernel tests above, through Triton's interpreter ------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernels run in this process")
def test_kernels_through_the_triton_interpreter() -> None:
    result = run_pytest_interpreted(__file__, "-m", "not slow", "-rs")
    summary = result.stdout[-4000:]
    assert result.returncode == 0, summary + result.stderr[-2000:]
    assert " skipped" not in summary.splitlines()[-1], summary  # every kernel test ran there


def test_liger_kernels_are_interpreted_exactly_when_the_process_says_so() -> None:
    from liger_kernel.ops import rms_norm

    assert is_interpreted(rms_norm._rms_norm_forward_kernel) == INTERPRETING
