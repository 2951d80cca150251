"""The prefill of the compiled decoding loops, compiled too: a prompt's forward on a GPU waits on the host otherwise.

`generate` runs the prompt's forward (the prefill) eagerly, in transformers' loops and in archlab's compiled loops
(decoding_loop.py, beam_loop.py) alike, and compiles only the one-token steps. On an H100 the 1.1B Llama-shaped
model's 2,048-token prefill is ~8 ms of kernels, and its eager forward takes ~26 ms: Python launching ~380 kernels,
the GPU busy a third of the time (scripts/profile_cuda.py's `prefill`; 18 % MFU). Compiling the layers one region
each still leaves the GPU idle 60 % of the time (each region's call has its own guards and wrappers: ~0.5 ms a
layer); compiled whole, the forward is one guard check and one generated function launching kernels back to back.

With `generate(..., compile_prefill=True)` (or `compile_prefill = True` on the generation config), `prefill` runs
generate's prefill (`GenerationMixin._prefill`) with `model.forward` compiled whole: dynamic shapes (`dynamic=True`:
one graph for every prompt length and cache length, so a new prompt does not compile again), no CUDA graphs (one
would be recorded per length), one graph (`fullgraph`: a graph break, like a compiler failure, is found before
anything runs, and the prefill then runs eagerly on the same state, with one logged line), kept on the model for the
next call. It applies where the loops run (CUDA by default, `compile_config._compile_all_devices` elsewhere) to a
decoder's prefill over a static cache already allocated: the first call of a new cache size runs its prefill
eagerly, since the cache allocates its tensors (and marks their addresses static) inside its first update, which a
compiled graph must not do; generate keeps the cache for the next call (fast_decoding.py), so later calls take the
compiled prefill. An encoder-decoder's prefill is one decoder token after the encoder: nothing to gain.

Measured on an H100 (1.1B model, bf16, docs/gpu.md): the time to first token of a 2,048-token prompt through
`generate` 18.3 ms against Llama's 26.2 ms (1.46×; 26 % MFU, the rest generate's own host work around the forward),
but the compile took 68 s, in the second call. So it is asked for, not the default: worth it for a process that
serves many long prompts, not for a few calls.
"""

from __future__ import annotations

import torch

from .cache_names import cache_in
from .cache_spans import self_attention_layers
from .compile_fallback import eager_on_compiler_failure


def check_compile_prefill(generation_config) -> None:
    """`compile_prefill`, where a generation config has it, must be a bool: a ValueError naming it otherwise."""
    value = getattr(generation_config, "compile_prefill", False)
    if not isinstance(value, bool):
        raise ValueError(f"`compile_prefill` must be True or False, got {value!r}.")


def prefill_blocker(model, generation_config, model_kwargs: dict) -> str | None:
    """Why this call's prefill runs eagerly, or None when `prefill` compiles it."""
    if not getattr(generation_config, "compile_prefill", False):
        return "not asked for (generate(..., compile_prefill=True))"
    if model.config.is_encoder_decoder:
        return "an encoder-decoder's prefill is one decoder token"
    if generation_config.prefill_chunk_size is not None:
        return "chunked prefill (transformers compiles its chunks itself)"
    cache = cache_in(model_kwargs)
    layers = self_attention_layers(cache) if cache is not None else None
    if not layers or not all(getattr(layer, "is_initialized", False) for layer in layers):
        return "the static cache allocates its tensors in this prefill (its first call)"
    return None


def compiled_prefill_forward(model, compile_config):
    """`model.forward` compiled for prefills (module docstring), kept on the model while the backend and the forward
    are the same; eager where the compiler fails."""
    eager = model.forward
    key = (compile_config.backend, eager)
    kept = getattr(model, "_compiled_prefill", None)
    if kept is None or kept[0] != key:
        compiled = torch.compile(eager, backend=compile_config.backend, dynamic=True, fullgraph=True)
        fallback = eager_on_compiler_failure(model, compiled, eager, "the prefill", (torch._dynamo.exc.Unsupported,))

        def forward(*args, **kwargs):
            # contiguous tensor inputs: a prompt sliced by the caller (a non-contiguous mask) would otherwise fail a
            # stride guard of the dynamic graph and compile it again
            kwargs = {name: value.contiguous() if torch.is_tensor(value) else value for name, value in kwargs.items()}
            return fallback(*args, **kwargs)

        kept = (key, forward)
        model._compiled_prefill = kept
    return kept[1]


def prefill(model, input_ids: torch.LongTensor, generation_config, model_kwargs: dict):
    """generate's prefill, with `model.forward` compiled (`compiled_prefill_forward`) where `prefill_blocker` finds
    nothing against it. Called by the compiled loops, so only where generate compiles its decoding steps."""
    if prefill_blocker(model, generation_config, model_kwargs) is not None:
        return model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    compile_config = generation_config.compile_config or model._default_compile_config()
    forward = compiled_prefill_forward(model, compile_config)
    own_forward = model.__dict__.get("forward")  # an instance-level forward (accelerate's hooks) is kept
    model.forward = forward
    try:
        return model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    finally:
        if own_forward is None:
            del model.forward
        else:
            model.forward = own_forward


__all__ = ["check_compile_prefill", "compiled_prefill_forward", "prefill", "prefill_blocker"]
