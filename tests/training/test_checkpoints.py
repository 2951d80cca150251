"""training/checkpoints.py: what a resumed run must keep from its checkpoint."""

from __future__ import annotations

import json

import pytest
from transformers import TrainingArguments

from archlab.training.checkpoints import RUN_FACTS, check_resumed_run_facts, check_training_state


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


def test_a_resume_in_another_weights_dtype_is_refused_naming_the_flag(tmp_path):
    """A resume with another --dtype loaded the checkpoint's weights and optimizer state cast to it and trained on in
    another precision, without a word."""
    (tmp_path / RUN_FACTS).write_text(json.dumps({"examples_per_step": 8, "weights_dtype": "bfloat16"}))
    with pytest.raises(ValueError) as raised:
        check_resumed_run_facts(str(tmp_path), {"examples_per_step": 8, "weights_dtype": "float32"})
    assert "was trained with --dtype (the weights' dtype) = 'bfloat16', but these flags give 'float32'" in str(
        raised.value
    )
    assert "the resumed run would train the rest of the run in another precision" in str(raised.value)
    check_resumed_run_facts(str(tmp_path), {"examples_per_step": 8, "weights_dtype": "bfloat16"})


@pytest.mark.parametrize("saved", ["", "rng_state.pth", "rng_state_1.pth", "optimizer.pt", "scheduler.pt"])
@pytest.mark.parametrize("max_steps", [6, 3])
def test_a_checkpoint_saved_with_the_weights_alone_is_refused_unless_the_run_is_over(tmp_path, saved, max_steps):
    """A --save_only_model checkpoint has no optimizer, scheduler or RNG state: the Trainer resumed from it without a
    word, with fresh AdamW moments and the learning-rate schedule started over (measured: steps 4-6 of a 6-step cosine
    run at 2e-3, 1.87e-3, 1.5e-3 instead of 1e-3, 5e-4, 1.3e-4). At the end of the run nothing trains."""
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 3, "max_steps": 3, "num_train_epochs": 1}))
    if saved:
        (tmp_path / saved).write_bytes(b"")
    args = TrainingArguments(str(tmp_path / "out"), max_steps=max_steps, use_cpu=True, report_to=[])
    if saved or max_steps == 3:
        check_training_state(str(tmp_path), args)
    else:
        with pytest.raises(ValueError, match="was saved with --save_only_model and holds the weights alone"):
            check_training_state(str(tmp_path), args)
    check_training_state(None, args)
