"""How generate's own loops (decoding_loop.py, beam_loop.py) compile their step: the `CompileConfig` of the call, or
the model's default with inductor's options `TUNED_STEP_OPTIONS` added on the devices listed in
`TUNED_STEP_DEVICES`.

The default on CUDA adds `combo_kernels`: inductor launches independent element-wise kernels of a step as one (a
layer's query RoPE, key RoPE with its cache write and value cache write follow the same product and need not wait
for each other). Measured with `--suite cuda-tuning` on an H100 (dense 1.1B, bf16, batch 1, 128 + 256 tokens, each
setting against the plain default on the same weights in one run): 616 against 591 tok/s (1.04x), a first call of 18
s, and 272 kernels a step in the profile after (339 before the combo kernels and step_masks.py). The other settings
measured lost there and stay opt-in through a `CompileConfig` of the call: `coordinate_descent_tuning` (a product of
one row rewritten as a Triton reduction with tuned block sizes, gpt-fast's setting) 0.94x at batch 1 and 0.97x at
batch 16 with a 54-76 s first call; with FlexAttention 0.97x; all three 1.01x. cuBLAS's GEMVs stay faster than
inductor's reductions on that GPU. The mode's own options (reduce-overhead: CUDA graphs) are kept. A `CompileConfig`
passed to `generate` is used exactly as given.

On Hopper and later, `DEPENDENT_LAUNCH_OPTIONS` too (inductor's `triton.enable_pdl`): with archlab's decoding kernels
launched the same way (triton_launch.py), the batch-1 step ran at 1.25x the combo-kernel step on an H200
(`--suite cuda-tuning`, 886 against 709 tok/s).
"""

from __future__ import annotations

from transformers import CompileConfig

from .triton_launch import has_dependent_launch

# Devices on which the loops' step, with no CompileConfig of the call's own, compiles with `TUNED_STEP_OPTIONS`.
TUNED_STEP_DEVICES: tuple[str, ...] = ("cuda",)
# The inductor options added there (cuda-tuning's rows measure the candidates against the plain default)
TUNED_STEP_OPTIONS: dict[str, bool] = {"combo_kernels": True}
# ... and on a GPU of compute capability 9 or more (Hopper): inductor's kernels launched dependent on the kernel
# before, as archlab's own are (triton_launch.py's PDL twins)
DEPENDENT_LAUNCH_OPTIONS: dict[str, bool] = {"triton.enable_pdl": True}


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
    if has_dependent_launch(model.device):
        options.update(DEPENDENT_LAUNCH_OPTIONS)
    # torch.compile takes a mode or options, not both: the mode's options are in `options`
    return CompileConfig(
        fullgraph=config.fullgraph, dynamic=config.dynamic, backend="inductor", mode=None, options=options
    )


__all__ = ["DEPENDENT_LAUNCH_OPTIONS", "TUNED_STEP_DEVICES", "TUNED_STEP_OPTIONS", "step_compile_config"]
