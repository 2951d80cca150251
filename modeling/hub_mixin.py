"""`HubMixin`: what archlab's `PreTrainedModel` bases add for sharing models safely.

- Loading refuses pickled weights: `from_pretrained` defaults to `use_safetensors=True`, so a folder or Hub repo
  with only `pytorch_model.bin` fails with a clear error instead of unpickling it. Opt in explicitly with
  `use_safetensors=False` (transformers then loads it with `torch.load(weights_only=True)`).
  Saving needs nothing: transformers 5 writes safetensors only.
- `auto_map` names every head of the family: `save_pretrained` of, say, a causal LM also lists the base model and
  the classification head of the same file, so `AutoModelForSequenceClassification.from_pretrained(folder,
  trust_remote_code=True)` can start fine-tuning from a shared causal LM where archlab is not installed.
  (transformers itself writes only the saved class's own entry; the code for all of them is in the copied file.)
- A config that cannot be saved fails `save_pretrained` before anything is written (transformers would first create
  the folder and copy the code into it).
- Saving into a folder that holds an earlier save with the other layout (one `model.safetensors` against shards and
  their index) leaves no stale weights behind: transformers removes old shards but not an old single file, which
  `from_pretrained` then prefers over the new shards, silently loading the earlier weights.

Part of the flat `modeling/` folder copied next to saved models, so the same rules hold when loaded as remote code.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


class HubMixin:
    """Put before `PreTrainedModel` in the bases of a family's `...PreTrainedModel`."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike | None, *args: Any, **kwargs: Any):
        if kwargs.get("use_safetensors") is None:  # None is transformers' "safetensors, else fall back to pickle"
            kwargs["use_safetensors"] = True
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except OSError as error:
            if kwargs["use_safetensors"] is not True or "safetensors" not in str(error):
                raise
            folder = os.path.join(os.fspath(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
            pickled = (".bin", ".bin.index.json")
            if os.path.isdir(folder) and not any(name.endswith(pickled) for name in os.listdir(folder)):
                raise  # no pickled weights either: transformers' "no file named model.safetensors" is the whole story
            raise OSError(
                f"{error}\narchlab loads safetensors weights only, because unpickling a checkpoint "
                "(pytorch_model.bin) can run arbitrary code. If you trust this checkpoint, pass "
                "`use_safetensors=False` to load it, then `save_pretrained` it to get safetensors."
            ) from error

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        validate = getattr(self.config, "validate", None)
        if callable(validate) and not os.path.isfile(save_directory) and not getattr(self, "_hf_peft_config_loaded", 0):
            # transformers checks the config when it writes config.json, after creating the folder and copying the
            # bundled code into it: a config that cannot be saved would leave a folder of code files and nothing else
            validate()
        if getattr(type(self), "_auto_class", None) is not None:
            family = self._family_auto_map()
            if family:
                auto_map = dict(getattr(self.config, "auto_map", None) or {})
                self.config.auto_map = {**family, **auto_map}
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True) and os.path.isdir(save_directory):
            remove_the_other_layout(save_directory)
        return result

    def _family_auto_map(self) -> dict[str, str]:
        """{auto class: "module.Class"} for every registered class of this config in this class's module file."""
        module = sys.modules[type(self).__module__]
        module_name = type(self).__module__.rsplit(".", 1)[-1]
        family = {}
        for obj in sorted(vars(module).values(), key=lambda o: getattr(o, "__name__", "")):
            auto_class = getattr(obj, "__dict__", {}).get("_auto_class") if isinstance(obj, type) else None
            if (
                auto_class is None
                or obj.__module__ != type(self).__module__
                or obj.config_class is not self.config_class
            ):
                continue
            family.setdefault(
                auto_class if isinstance(auto_class, str) else auto_class.__name__, f"{module_name}.{obj.__name__}"
            )
        return family


SINGLE_FILE, SHARD_INDEX = "model.safetensors", "model.safetensors.index.json"


def remove_the_other_layout(folder: str | os.PathLike) -> None:
    """After a save into `folder`: an index whose shards are all there is the save just written, and a single
    weights file beside it is stale; an index with shards missing (transformers removed them, having written a
    single file) is stale itself."""
    index = os.path.join(folder, SHARD_INDEX)
    if not os.path.isfile(index):
        return
    with open(index, encoding="utf-8") as f:
        shards = set(json.load(f).get("weight_map", {}).values())
    if not all(os.path.isfile(os.path.join(folder, shard)) for shard in shards):
        os.remove(index)
    elif SINGLE_FILE not in shards and os.path.isfile(os.path.join(folder, SINGLE_FILE)):
        os.remove(os.path.join(folder, SINGLE_FILE))


__all__ = ["HubMixin"]
