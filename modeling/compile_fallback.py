"""Compiled decoding code that falls back to eager: one logged line when the compiler fails, and one when it starts.

generate's compiled pieces (the decoding steps of decoding_loop.py and beam_loop.py, transformers' compiled forward
in fast_decoding.py, the prefill of compiled_prefill.py) must not turn a compiler failure (no working Triton for this
GPU, an inductor error) into an error in the middle of `generate`, and a first call waiting tens of seconds for the
compiler on CUDA should say why.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Where the compiler fails, or a call would pass dynamo's recompile limit under fullgraph=True, the call runs eagerly
# (one warning says so). The tests set it False (tests/conftest.py): there a compile error or a test's own recompile
# limit (`recompile_limit=1`: one graph for every span) fails the test, where eager decoding would give the same
# tokens unseen. dynamo's `error_on_recompile` always raises (`RecompileError`): whoever sets it asked for the error.
FALL_BACK_TO_EAGER = True


def announce_compiling(model, what: str) -> None:
    """On CUDA, one line per process and model class the first time `what` is compiled: generate's first calls then
    wait for the compiler, and whoever waits should know why and how to skip it."""
    if model.device.type == "cuda":
        logger.warning_once(
            f"{type(model).__name__}: compiling {what} — the first calls of a new batch size or length take tens of "
            "seconds, later ones reuse it; generate(..., disable_compile=True) decodes without compiling."
        )


def eager_on_compiler_failure(model, compiled, eager, what: str, failures: tuple = ()):
    """`compiled`, until the compiler fails on it (no working Triton for this GPU, an inductor error; also the
    exception types in `failures`): then one logged line names the cause and `eager` runs from then on. The failure
    comes before the compiled graph runs (the compiled pieces have no graph breaks), so the call is retried on the
    same state. On CUDA one line says that `what` is being compiled (`announce_compiling`)."""
    announce_compiling(model, what)
    current = [compiled]
    told = []

    def call(*args, **kwargs):
        try:
            return current[0](*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as error:
            # a new specialisation past dynamo's recompile limit under fullgraph=True: raised before anything ran;
            # this call runs eagerly, the specialisations compiled so far keep their graphs
            if current[0] is eager or not FALL_BACK_TO_EAGER:
                raise
            if not told:
                told.append(True)
                name = type(model).__name__
                logger.warning(f"{name}: {what} past dynamo's recompile limit runs eagerly ({type(error).__name__}).")
            return eager(*args, **kwargs)
        except (torch._dynamo.exc.BackendCompilerFailed, *failures) as error:
            if current[0] is eager or not FALL_BACK_TO_EAGER:
                raise
            cause = getattr(error, "inner_exception", None) or error.__cause__ or error
            logger.warning(
                f"Compiling {what} failed ({type(cause).__name__}: {cause}); {type(model).__name__} decodes eagerly."
            )
            current[0] = eager
            return eager(*args, **kwargs)

    return call
