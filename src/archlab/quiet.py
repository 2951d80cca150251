"""Silences one message other libraries print as a side effect of archlab's ordinary operations, and nothing else.

With DeepSpeed installed (archlab's `dev` extra), every `save_pretrained`, checkpoint conversion and `Trainer`
construction goes through accelerate's `extract_model_from_parallel`, which imports DeepSpeed only to check whether
the model is a `DeepSpeedEngine`. On a machine without a GPU that first import makes DeepSpeed log "Setting
accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." (to stdout). The filter
drops that record only when the import comes from that check: where DeepSpeed is imported to be used, and for every
other DeepSpeed message, the output is unchanged.
"""

from __future__ import annotations

import logging
import sys

_DEEPSPEED_LOGGER = "DeepSpeed"  # the name deepspeed.utils.logging gives its logger
_CPU_FALLBACK = "Setting accelerator to CPU"
_PROBE = "extract_model_from_parallel"  # accelerate's unwrap helper that imports DeepSpeed for an isinstance check


class _DeepSpeedProbeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(_CPU_FALLBACK):
            return True
        frame = sys._getframe()
        while frame is not None:
            if frame.f_code.co_name == _PROBE:
                return False
            frame = frame.f_back
        return True


def quiet_deepspeed_probe() -> None:
    """Install the filter on DeepSpeed's logger (once; DeepSpeed need not be installed or imported yet)."""
    logger = logging.getLogger(_DEEPSPEED_LOGGER)
    if not any(isinstance(f, _DeepSpeedProbeFilter) for f in logger.filters):
        logger.addFilter(_DeepSpeedProbeFilter())


__all__ = ["quiet_deepspeed_probe"]
