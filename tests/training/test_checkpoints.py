"""training/checkpoints.py: what a resumed run must keep from its checkpoint."""

from __future__ import annotations

import json

import pytest

from archlab.training.checkpoints import RUN_FACTS, check_resumed_run_facts


@pytest.mark.parametrize(
    "facts, named, hint",
    [
        ({"examples_per_step": 8, "block_size": 32}, "--block_size = 64, but these flags give 32", False),
        ({"examples_per_step": 4, "block_size": 64}, "x processes = 8, but these flags give 4", True),
    ],
)
def test_a_refused_resume_names_the_flag_and_hints_at_a_split_for_the_batch_only(tmp_path, facts, named, hint):
    """The refusal of another --block_size ended with the batch size's hint (another per-device batch size is
    fine ...), which says nothing about the block size that differs."""
    (tmp_path / RUN_FACTS).write_text(json.dumps({"examples_per_step": 8, "block_size": 64}))
    with pytest.raises(ValueError) as raised:
        check_resumed_run_facts(str(tmp_path), facts)
    assert named in str(raised.value)
    assert ("another per-device batch size is fine" in str(raised.value)) == hint
    check_resumed_run_facts(str(tmp_path), {"examples_per_step": 8, "block_size": 64})  # the same facts resume
