"""How generate's own loops (decoding_loop.py, beam_loop.py) compile their step: the `CompileConfig` of the call, or
the model's default with inductor's options `TUNED_STEP_OPTIONS` added on the devices listed in `TUNED_STEP_DEVICES`.

With `coordinate_descent_tuning`, inductor rewrites a product of one row (a batch-1 decoding step's every GEMV) as
a Triton reduction whose block sizes it tunes while compiling (`torch._inductor.decomposition.mm`), the setting
gpt-fast decodes with; the reduction can take in the element-wise work beside it (the norm's scale before a
projection, SwiGLU before the down projection). cuBLAS's GEMVs reached 42-77 % of an H100's bandwidth in the
decode-1 profile (docs/gpu.md). The mode's own options (reduce-overhead: CUDA graphs) are kept.

The other candidate, `combo_kernels`, has inductor launch independent element-wise kernels of a step as one (a
layer's query RoPE, key RoPE with its cache write and value cache write follow the same product and need not wait
for each other): the profile counted ~15 launches a layer, each a few µs of a 1.98 ms step at batch 1.

`TUNED_STEP_DEVICES` stays empty until `--suite cuda-tuning` measures the settings against the default on a GPU.
A `CompileConfig` passed to `generate` is used exactly as given.
"""

from __future__ import annotations

from transformers import CompileConfig

# Devices on which the loops' step, with no CompileConfig of the call's own, compiles with `TUNED_STEP_OPTIONS`.
TUNED_STEP_DEVICES: tuple[str, ...] = ()
# The inductor options added there (cuda-tuning's rows measure each: coordinate descent, combo kernels, both)
TUNED_STEP_OPTIONS: dict[str, bool] = {"coordinate_descent_tuning": True}


def step_compile_config(model, generation_config) -> CompileConfig:
    """The config the loops compile their step with: the generation config's own, or the model's default with
    `TUNED_STEP_OPTIONS` added where the model's device is in `TUNED_STEP_DEVICES` and the default is inductor with
    no options of its own."""
    if generation_config.compile_config is not None:
        return generation_config.compile_config
    config = model._default_compile_config()
    if model.device.type not in TUNED_STEP_DEVICES or config.backend != "inductor" or config.options is not None:
        return config
    from torch._inductor import list_mode_options

    options = {**list_mode_options(config.mode), **TUNED_STEP_OPTIONS}
    # torch.compile takes a mode or options, not both: the mode's options are in `options`
    return CompileConfig(
        fullgraph=config.fullgraph, dynamic=config.dynamic, backend="inductor", mode=None, options=options
    )


__all__ = ["TUNED_STEP_DEVICES", "TUNED_STEP_OPTIONS", "step_compile_config"]
