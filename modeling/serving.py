"""`transformers serve` loads archlab decoders: their class is put where its model manager looks for it.

transformers' serving model manager (`transformers.cli.serving.model_manager`) loads a folder's model as
`getattr(transformers, config.architectures[0]).from_pretrained(...)`, a lookup in transformers' own namespace: it
misses every class transformers does not define, registered with the Auto classes or remote code alike, and the
server stops with `module transformers has no attribute DecoderForCausalLM`. `expose_decoder_to_serve` adds
`DecoderForCausalLM` to the transformers module that the model manager reads, the moment the manager's module is
loaded (`import_hooks.after_import`). configuration_decoder.py asks for it, because the manager loads a folder's
config before its model: with archlab imported, and from a saved folder's own copy of the code
(`transformers serve <folder> --trust-remote-code`, where archlab is not installed).
"""

from __future__ import annotations

from types import ModuleType

SERVE_MODEL_MANAGER_MODULE = "transformers.cli.serving.model_manager"


def expose_decoder_to_serve(model_manager: ModuleType) -> None:
    """Make `DecoderForCausalLM` an attribute of the transformers module the serving model manager looks classes up
    in, unless transformers has a class of that name itself. The last archlab copy loaded is the one served (archlab's
    own, or a folder's remote code); either loads any archlab decoder folder. A manager module without that
    namespace (a transformers version that finds classes another way) is left as it is."""
    from .modeling_decoder import DecoderForCausalLM

    namespace = getattr(model_manager, "transformers", None)
    if not isinstance(namespace, ModuleType):  # a manager that looks its classes up otherwise: nothing to add to, and
        return  # failing here would fail its import, the whole server with it
    name = DecoderForCausalLM.__name__
    existing = getattr(namespace, name, None)
    if existing is not None and existing.__module__.startswith("transformers."):
        return
    setattr(namespace, name, DecoderForCausalLM)


__all__ = ["SERVE_MODEL_MANAGER_MODULE", "expose_decoder_to_serve"]
