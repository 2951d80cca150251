"""training/sampling.py: text from the trained model after a run, and when the scripts leave it out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from archlab.training.sampling import sample_unless_sharded


@pytest.mark.parametrize("fsdp", [False, True])
def test_no_sample_from_a_model_fsdp_sharded_and_one_line_says_how(fsdp, capsys):
    """Under FSDP each process's parameters are its shard: `finetune.py`'s example answer generated from them (only
    `pretrain.py` skipped its sample). Both scripts now go through this guard."""
    calls = []
    sample_unless_sharded(SimpleNamespace(is_fsdp_enabled=fsdp), "out/run", lambda: calls.append("sampled"))
    printed = capsys.readouterr().out
    if fsdp:
        assert calls == []
        assert "No sample under FSDP: `python scripts/generate.py --model_name_or_path out/run`" in printed
    else:
        assert calls == ["sampled"]
        assert printed == ""
