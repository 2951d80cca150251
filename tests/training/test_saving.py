"""training/saving.py: the final save of the scripts."""

from __future__ import annotations

from types import SimpleNamespace

from archlab.training import saving


class _Accelerator:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def wait_for_everyone(self) -> None:
        self.calls.append("wait")


def test_every_process_takes_part_in_gathering_the_weights(tmp_path):
    """Under FSDP or DeepSpeed ZeRO-3 each process holds a shard of the weights, and `Trainer.save_model` gathers the
    whole weights from all of them: a process that does not write must still call it (before, only the main process
    saved, from its own shard), and then write nothing."""
    calls: list = []
    trainer = SimpleNamespace(
        args=SimpleNamespace(should_save=False),
        accelerator=_Accelerator(calls),
        model=SimpleNamespace(config=SimpleNamespace(use_cache=False)),
        save_model=lambda output_dir, _internal_call=False: calls.append(("save_model", _internal_call)),
    )
    saving.save_final(trainer, tokenizer=None, output_dir=str(tmp_path))
    assert calls == ["wait", ("save_model", True), "wait"]  # no push of its own (_internal_call)
    assert list(tmp_path.iterdir()) == []
