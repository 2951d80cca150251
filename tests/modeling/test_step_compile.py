"""How the decoding loops compile their step (modeling/step_compile.py): a CompileConfig passed to generate is used
as given; otherwise the model's default, with the tuned inductor options added (and the mode's own options kept,
torch.compile taking options or a mode, not both) only on the devices listed: CUDA by default, not the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig, GenerationConfig

from archlab import DecoderForCausalLM
from archlab.modeling import step_compile
from archlab.modeling.step_compile import step_compile_config

from helpers import tiny_decoder_config


def _model():
    return DecoderForCausalLM(tiny_decoder_config()).eval()


def test_a_config_of_the_call_is_used_as_given(monkeypatch):
    monkeypatch.setattr(step_compile, "TUNED_STEP_DEVICES", ("cpu",))
    own = CompileConfig(mode="max-autotune", fullgraph=True)
    assert step_compile_config(_model(), GenerationConfig(compile_config=own)) is own


def test_the_default_is_tuned_only_on_the_listed_devices(monkeypatch):
    model = _model()
    assert step_compile_config(model, GenerationConfig()) == CompileConfig()  # CPU is not listed by default
    monkeypatch.setattr(step_compile, "TUNED_STEP_DEVICES", ())
    assert step_compile_config(model, GenerationConfig()) == CompileConfig()
    monkeypatch.setattr(step_compile, "TUNED_STEP_DEVICES", ("cpu",))
    monkeypatch.setattr(step_compile, "TUNED_STEP_OPTIONS", {"coordinate_descent_tuning": True})
    tuned = step_compile_config(model, GenerationConfig())
    assert tuned.mode is None and tuned.backend == "inductor"
    assert tuned.options == {"triton.cudagraphs": True, "coordinate_descent_tuning": True}  # reduce-overhead's kept
    assert (tuned.fullgraph, tuned.dynamic) == (CompileConfig().fullgraph, CompileConfig().dynamic)
    assert step_compile_config(model, GenerationConfig()) == tuned  # equal configs: the kept compiled step is reused
    monkeypatch.setattr(step_compile, "TUNED_STEP_OPTIONS", {"combo_kernels": True})
    combined = step_compile_config(model, GenerationConfig())
    assert combined.options == {"triton.cudagraphs": True, "combo_kernels": True}
    assert combined != tuned  # another setting: another compiled step


def test_a_default_with_another_backend_or_options_is_left_as_it_is(monkeypatch):
    model = _model()
    monkeypatch.setattr(step_compile, "TUNED_STEP_DEVICES", ("cpu",))
    for default in (CompileConfig(backend="tpu", mode="default"), CompileConfig(options={"max_autotune": True})):
        monkeypatch.setattr(model, "_default_compile_config", lambda default=default: default)
        assert step_compile_config(model, GenerationConfig()) is default


@pytest.mark.parametrize(
    "options",
    [
        step_compile.TUNED_STEP_OPTIONS,
        {"coordinate_descent_tuning": True},
        {"coordinate_descent_tuning": True, "combo_kernels": True},
    ],
)
def test_torch_compile_takes_the_tuned_config(options, monkeypatch):
    monkeypatch.setattr(step_compile, "TUNED_STEP_DEVICES", ("cpu",))
    monkeypatch.setattr(step_compile, "TUNED_STEP_OPTIONS", options)
    torch._dynamo.reset()
    tuned = step_compile_config(_model(), GenerationConfig())
    compiled = torch.compile(lambda x: (x * 2).sum(-1), **tuned.to_dict())
    x = torch.arange(6.0).reshape(2, 3)
    torch.testing.assert_close(compiled(x), (x * 2).sum(-1))


class _ModelOnCuda:
    """What `step_compile_config` reads of a model, for one on a CUDA device (none is needed to build the config)."""

    device = torch.device("cuda", 0)

    def _default_compile_config(self):
        return CompileConfig()


@pytest.mark.parametrize("capability, dependent", [((9, 0), True), ((10, 0), True), ((8, 0), False), ((8, 9), False)])
def test_on_hopper_and_later_inductor_s_kernels_launch_dependent_on_the_one_before(capability, dependent, monkeypatch):
    """`triton.enable_pdl` beside the combo kernels where the GPU has programmatic dependent launch (compute
    capability 9 and later), as archlab's own decoding kernels are launched there (triton_launch.py)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    options = step_compile_config(_ModelOnCuda(), GenerationConfig()).options
    assert options["combo_kernels"] and options["triton.cudagraphs"]
    assert options.get("triton.enable_pdl", False) is dependent


def test_a_rocm_build_gets_no_dependent_launches(monkeypatch):
    """torch's ROCm build calls AMD GPUs "cuda" and reports their architecture as the capability (an MI300: 9.4):
    programmatic dependent launch is NVIDIA's (inductor refuses it under ROCm too)."""
    from archlab.modeling import triton_launch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert "triton.enable_pdl" not in step_compile_config(_ModelOnCuda(), GenerationConfig()).options
    like = torch.empty(0, device="meta")
    monkeypatch.setattr(type(like), "is_cuda", property(lambda self: True))
    assert not triton_launch.pdl_launch(like)
