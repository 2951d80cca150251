"""Model folders on disk for the converter: read `config.json` and safetensors weights, write a folder that is
complete or absent. Weights are safetensors only; pickled checkpoints are refused."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import PreTrainedConfig, PreTrainedModel

from .family import ConversionError, StateDict


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder} has no config.json: not a Hugging Face model folder.")
    return json.loads(path.read_text())


# PEFT's files beside a model's weights (an adapter saved into the model's folder): neither the model's weights nor
# something to copy (transformers reads a folder holding `adapter_config.json` as an adapter of another base model)
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def weight_files(folder: Path) -> list[Path]:
    """The model's safetensors files: those its index names, else `model.safetensors`, else every `*.safetensors`
    but an adapter's."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    return sorted(p for p in folder.glob("*.safetensors") if p.name not in ADAPTER_FILES)


def load_state_dict(folder: Path) -> StateDict:
    """All tensors of a folder's `model.safetensors` or the shards its index names (pickles are refused; a PEFT
    adapter saved beside them is not the model's)."""
    files = weight_files(folder)
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" It has pickled weights ({', '.join(pickles)}); re-save them as safetensors first." if pickles else ""
        raise ConversionError(f"{folder} has no *.safetensors weights.{hint}")
    state_dict: StateDict = {}
    for file in files:
        if not file.is_file():
            raise ConversionError(f"{file} is missing: model.safetensors.index.json names it.")
        try:
            state_dict.update(load_file(str(file)))
        except SafetensorError as error:  # a truncated or empty file
            raise ConversionError(f"{file} is damaged or not a safetensors file ({error}).") from None
    return state_dict


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config and other non-weight, non-code files travel along."""
    skip_suffixes = {".safetensors", ".bin", ".pt", ".pth", ".py"}
    skip_names = {"config.json", "model.safetensors.index.json", "README.md", *ADAPTER_FILES}
    for path in src.iterdir():
        if path.is_file() and path.suffix not in skip_suffixes and path.name not in skip_names:
            shutil.copy2(path, dst / path.name)


def write_model(
    model_class: type[PreTrainedModel], config: PreTrainedConfig, state_dict: StateDict, src: Path, dst: Path
) -> Path:
    """`model_class(config)` holding exactly `state_dict`, saved to `dst` with `src`'s side files. The model is built
    on the meta device and takes the tensors as they are (no second copy); `dst` is written in a temporary folder
    beside it and renamed into place."""
    with torch.device("meta"):
        model = model_class(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    # Tie only when the head is the embedding: T5Config always says tie_word_embeddings=True, though T5 v1.1
    # checkpoints carry their own head (transformers unties those at load time for the same reason). Tied tensors
    # (the head, BERT's head bias) may then be missing: tying fills them.
    head = state_dict.get("lm_head.weight")
    tied = getattr(config, "tie_word_embeddings", False) and (
        head is None or torch.equal(head, model.get_input_embeddings().weight)
    )
    missing = [k for k in missing if not (tied and k in model.all_tied_weights_keys)]
    if missing or unexpected:
        raise ConversionError(
            f"Weights do not match {model_class.__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}."
        )
    if tied:
        model.tie_weights()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        model.save_pretrained(tmp)
        copy_side_files(src, tmp)
        if dst.exists():
            dst.rmdir()
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


__all__ = ["copy_side_files", "load_state_dict", "read_config", "write_model"]
