"""`FollowsGenericHead`: a class attribute of an archlab task head read from transformers' generic head of the same
task (`GenericForSequenceClassification`, the base of Llama's, Mistral's, Mixtral's, Qwen's ... classifiers) at
each access, so that a load-time rule set there for every stock family reaches archlab's head too.

TRL's `RewardTrainer`, given a causal LM folder by path, sets `_keys_to_ignore_on_load_missing` (`score.weight`, the
new head) and `_keys_to_ignore_on_load_unexpected` (`lm_head.`, the unused LM head) on
`GenericForSequenceClassification` for the duration of the load: the stock classifiers then load without
transformers' load report, while archlab's printed it.
"""

from __future__ import annotations

from typing import Any


class FollowsGenericHead:
    """A class attribute whose value is `generic`'s attribute of the same name (None where it has none). An instance
    attribute of that name (`PreTrainedModel.post_init` sets the model's own sets of patterns) takes precedence."""

    def __init__(self, generic: type) -> None:
        self.generic = generic

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        return getattr(self.generic, self.name, None)
