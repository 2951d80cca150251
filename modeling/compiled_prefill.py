"""The prefill of the compiled decoding loops, compiled too: a prompt's forward on a GPU waits on the host otherwise.

`generate` runs the prompt's forward (the prefill) eagerly, in transformers' loops and in archlab's compiled loops
(decoding_loop.py, beam_loop.py) alike, and compiles only the one-token steps. On an H100 the 1.1B Llama-shaped
model's 2,048-token prefill is ~8 ms of kernels, and its eager forward takes ~26 ms: Python launching ~380 kernels,
the GPU busy a third of the time (scripts/profile_cuda.py's `prefill`; 18 % MFU). Compiling the layers one region
each still leaves the GPU idle 60 % of the time (each region's call has its own guards and wrappers: ~0.5 ms a
layer); compiled whole, the forward is one guard check and one generated function launching kernels back to back.

With `generate(..., compile_prefill=True)` (or `compile_prefill = True` on the generation config), `prefill` runs
generate's prefill (`GenerationMixin._prefill`) with `model.forward` compiled whole: dynamic shapes (`dynamic=True`:
one graph for every prompt length and cache length, so a new prompt does not compile again; one more for prompts
without left padding, to which transformers gives no mask over the empty cache: SDPA's `is_causal`); on CUDA the prompt
padded on the right to one of a few bucket lengths and the forward compiled in mode "reduce-overhead", replaying a
CUDA graph recorded once per bucket (`bucketed_forward`, prefill_buckets.py: a graph per prompt length would record
nearly every call; where the prompt cannot be padded, no CUDA graphs); one graph (`fullgraph`: a graph break, like a
compiler failure, is found before anything runs, and the prefill then runs eagerly on the same state, with one
logged line), kept on the model for the next call. It applies where the loops run (CUDA by default,
`compile_config._compile_all_devices` elsewhere) to a decoder's prefill over a static cache already allocated: the
first call of a new cache size runs its prefill eagerly, since the cache allocates its tensors (and marks their
addresses static) inside its first update, which a compiled graph must not do; generate keeps the cache for the next
call (fast_decoding.py), so later calls take the compiled prefill. An encoder-decoder's prefill is one decoder token
after the encoder: nothing to gain.

Measured on an H100 (1.1B model, bf16, docs/gpu.md): the time to first token of a 2,048-token prompt through
`generate` 18.3 ms against Llama's 26.2 ms (1.46×; 26 % MFU, the rest generate's own host work around the forward),
but the compile took 68 s, in the second call. So it is asked for, not the default: worth it for a process that
serves many long prompts, not for a few calls.

To shorten that compile, each decoder block's forward is a nested compile region while the prefill compiles and
runs (`nested_block_regions`, `torch.compiler.nested_compile_region`). Dynamo still traces every layer (a block
takes the cache object and returns None beside its hidden states, so no traced region is reused as it is), but the
layers after the first trace to one subgraph, which AOT autograd and inductor compile once instead of once per
layer (`TORCH_LOGS=hierarchical_compile`). On CPU, 22 tiny layers, a fresh inductor cache each: a direct forward
compiled in 60.9 s unrolled and 22.7 s with regions (warm 2.64 against 2.76 ms), and `generate`'s first call with
`compile_prefill=True` (the decoding step's compile included) took 66.9 s against 42.1 s, the same tokens, a warm
call of 4 new tokens ~9.5 against ~10.5 ms (the regions' calls on the host); the GPU's numbers are for
`cuda-tuning`'s last row. (The cache's layers read their length from their keys' size, not from an int attribute,
or each layer's trace would carry a symbol of its own and none would match: cache_spans.py.) Float attributes are
specialised meanwhile (a region would lift a norm's epsilon as a symbolic float, which torch's fused RMSNorm
refuses). Models with a mixture of experts keep the unrolled graph: their blocks leave the router's logits on the
module, a side effect a region may not have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from .cache_names import cache_in
from .cache_spans import mark_head_sizes_static, rewind_lengths, self_attention_layers, shared_positions
from .compile_fallback import eager_on_compiler_failure
from .prefill_buckets import padded_prefill_inputs


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


# Whether the compiled prefill compiles each decoder block as a nested compile region (module docstring)
NESTED_REGIONS = True
# Each block class's forward as a region, made once: the compiled prefill's guards check the very same function
_REGION_FORWARDS: dict[type, Callable] = {}


def region_block_classes(model) -> list[type]:
    """The classes of `model`'s decoder blocks whose forward the prefill compiles as a nested region: every block's,
    where none holds a mixture of experts; none otherwise, or without `NESTED_REGIONS`."""
    from .moe import SparseMoeBlock

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not NESTED_REGIONS or layers is None or len(layers) == 0:
        return []
    if any(isinstance(module, SparseMoeBlock) for layer in layers for module in layer.children()):
        return []
    return sorted({type(layer) for layer in layers}, key=lambda cls: cls.__qualname__)


@contextlib.contextmanager
def nested_block_regions(model) -> Iterator[None]:
    """While compiling and running the prefill: each class of `region_block_classes(model)` with its forward as a
    `torch.compiler.nested_compile_region` (a no-op in eager code), float attributes specialised."""
    classes = region_block_classes(model)
    if not classes:
        yield
        return
    originals = {cls: cls.__dict__.get("forward") for cls in classes}
    try:
        for cls in classes:
            if cls not in _REGION_FORWARDS:
                _REGION_FORWARDS[cls] = torch.compiler.nested_compile_region(cls.forward)
            cls.forward = _REGION_FORWARDS[cls]
        with torch._dynamo.config.patch(specialize_float=True):
            yield
    finally:
        for cls, forward in originals.items():
            if forward is None:
                del cls.forward
            else:
                cls.forward = forward


def compiled_prefill_forward(model, compile_config, graphs: bool = False):
    """`model.forward` compiled for prefills (module docstring), kept on the model while the backend and the forward
    are the same; with `graphs`, in mode "reduce-overhead" (CUDA graphs, one recorded per prompt length: for prompts
    padded to buckets, prefill_buckets.py); eager where the compiler fails."""
    eager = model.forward
    key = (compile_config.backend, eager)
    kept = getattr(model, "_compiled_prefill", None)
    if kept is None or kept[0] != key:
        kept = (key, {})
        model._compiled_prefill = kept
    if graphs not in kept[1]:
        mode = {"mode": "reduce-overhead"} if graphs else {}
        compiled = torch.compile(eager, backend=compile_config.backend, dynamic=True, fullgraph=True, **mode)
        fallback = eager_on_compiler_failure(model, compiled, eager, "the prefill", (torch._dynamo.exc.Unsupported,))

        def forward(*args, **kwargs):
            # contiguous tensor inputs: a prompt sliced by the caller (a non-contiguous mask) would otherwise fail a
            # stride guard of the dynamic graph and compile it again
            kwargs = {name: _contiguous(value) for name, value in kwargs.items()}
            _static_head_sizes(cache_in(kwargs))
            return fallback(*args, **kwargs)

        kept[1][graphs] = forward
    return kept[1][graphs]


def _static_head_sizes(cache) -> None:
    """The heads and head size of the cache's tensors marked static (once per tensor). Under `dynamic=True` they
    would be symbols that the first trace specialises at once (they must equal the weights'), and dynamo gives equal
    sizes one symbol (duck sizing): a prompt as long as the head size (a 64-token bucket and head_dim 64) would be
    specialised with it, and the next length would compile the whole forward again. The batch stays dynamic (a new
    batch size does not compile again; prefill_buckets.py keeps a bucket off the batch size), and so does duck sizing
    (the layers' traces share the cache length's symbol, which lets their nested compile regions match)."""
    for layer in self_attention_layers(cache) if cache is not None else []:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if torch.is_tensor(tensor):
                mark_head_sizes_static(tensor)  # (a cache's spanned layers marked theirs when they allocated them)


def _contiguous(value):
    if torch.is_tensor(value):
        return value.contiguous()
    if isinstance(value, dict):  # generate's masks, one per layer type
        return {name: _contiguous(item) for name, item in value.items()}
    return value


def records_graphs(compile_config) -> bool:
    """Whether a padded prefill compiles in mode "reduce-overhead" (CUDA graphs): where the call's compile config
    is inductor in that mode (generate's default)."""
    return compile_config.backend == "inductor" and compile_config.mode == "reduce-overhead"


def bucketed_forward(model, compile_config, cache):
    """The forward a compiled prefill calls: the prompt padded to its bucket where it can be (prefill_buckets.py),
    through the forward compiled with CUDA graphs (`records_graphs`), the pads rewound from the cache after and the
    logits taken out of the graph's memory; else the compiled forward as it is."""
    plain = compiled_prefill_forward(model, compile_config)
    graphs = records_graphs(compile_config)
    padded_forward = compiled_prefill_forward(model, compile_config, graphs=graphs)

    def forward(*args, **kwargs):
        padded = padded_prefill_inputs(model, cache, kwargs)
        if padded is None:
            return plain(*args, **kwargs)
        inputs, pads = padded
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last call's decoding graphs' outputs are dead
        outputs = padded_forward(*args, **inputs)
        rewind_lengths(cache, pads)  # the pads' positions, after the prompt's
        outputs.logits = outputs.logits.clone()  # a CUDA graph's output is overwritten by its next replay
        return outputs

    return forward


def prefill(model, input_ids: torch.LongTensor, generation_config, model_kwargs: dict):
    """generate's prefill, with `model.forward` compiled (`bucketed_forward`) where `prefill_blocker` finds nothing
    against it. Called by the compiled loops, so only where generate compiles its decoding steps."""
    if prefill_blocker(model, generation_config, model_kwargs) is not None:
        chunked = generation_config.prefill_chunk_size is not None  # (several forwards, each of its own length)
        with contextlib.nullcontext() if chunked else shared_positions(cache_in(model_kwargs)):
            return model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    compile_config = generation_config.compile_config or model._default_compile_config()
    forward = bucketed_forward(model, compile_config, cache_in(model_kwargs))
    own_forward = model.__dict__.get("forward")  # an instance-level forward (accelerate's hooks) is kept
    model.forward = forward
    try:
        with nested_block_regions(model):
            return model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    finally:
        if own_forward is None:
            del model.forward
        else:
            model.forward = own_forward


__all__ = [
    "NESTED_REGIONS",
    "bucketed_forward",
    "check_compile_prefill",
    "compiled_prefill_forward",
    "nested_block_regions",
    "prefill",
    "prefill_blocker",
    "records_graphs",
    "region_block_classes",
]
