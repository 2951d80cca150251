"""src/archlab/quiet.py: with DeepSpeed installed, saving a model and converting a checkpoint print nothing from
DeepSpeed, while DeepSpeed's own messages (its CPU fallback note when it is imported to be used, any other record)
still come through.

DeepSpeed logs its note once per process, at its first import, so each end-to-end check runs in a fresh
interpreter; CUDA is hidden there so DeepSpeed falls back to the CPU (and would print the note) on any machine.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import pytest

import archlab  # installs the filter

from helpers import run_pythons_at_once, tiny_decoder_config

NOTE = "Setting accelerator to CPU"
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed not installed")


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("DeepSpeed", logging.WARNING, "real_accelerator.py", 1, message, None, None)


def extract_model_from_parallel(record: logging.LogRecord) -> bool:
    """Stands in for accelerate's helper of the same name: the filter looks for it on the stack."""
    return logging.getLogger("DeepSpeed").filter(record)


def test_filter_drops_only_the_cpu_note_of_accelerates_isinstance_probe():
    note = _record(f"{NOTE}. If you have GPU or other accelerator, we were unable to detect it.")
    assert not extract_model_from_parallel(note)
    assert logging.getLogger("DeepSpeed").filter(note)  # DeepSpeed imported to be used: the note stays
    assert extract_model_from_parallel(_record("ZeRO stage 3 offload: not enough CPU memory"))


def _fresh_pythons(codes: list[str], cwd: Path) -> list[str]:
    """What each of `codes` prints, each run in its own fresh interpreter, all at once."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    printed = []
    for run in run_pythons_at_once([(code, env) for code in codes], cwd):
        assert run.returncode == 0, run.stderr
        printed.append(run.stdout + run.stderr)
    return printed


@pytest.mark.slow
@needs_deepspeed
def test_save_and_conversion_print_no_deepspeed_note_but_a_direct_import_does(tmp_path):
    archlab.DecoderForCausalLM(tiny_decoder_config()).save_pretrained(tmp_path / "model")
    saved, converted, imported = _fresh_pythons(
        [
            "import archlab\n"
            f"archlab.DecoderForCausalLM.from_pretrained({str(tmp_path / 'model')!r}).save_pretrained('again')\n",
            "from archlab.scripts.convert_checkpoint import main\n"
            f"main([{str(tmp_path / 'model')!r}, 'llama', '--to', 'llama'])\n",
            "import archlab, deepspeed\n",
        ],
        tmp_path,
    )
    assert (tmp_path / "again" / "config.json").exists()
    assert NOTE not in saved, saved
    assert (tmp_path / "llama" / "config.json").exists()
    assert NOTE not in converted, converted
    # The same interpreter set-up does print it when DeepSpeed is imported directly: the checks above can fail.
    assert NOTE in imported, imported
