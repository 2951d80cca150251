"""archlab.model_cards: model cards (README.md with Hub metadata) for saved archlab folders.

`write_model_card(folder, base_model=..., datasets=..., eval_results=..., trainer_state=...)` renders the
`model_card.md` template with huggingface_hub's `ModelCard` from what the folder holds.
"""

from .card import write_model_card

__all__ = ["write_model_card"]
