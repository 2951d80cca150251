"""HubMixin: pickled weights are refused unless opted in; saves are safetensors only; auto_map lists every head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import AutoModelForCausalLM

from archlab import DecoderForCausalLM, registration

from helpers import tiny_config_for, tiny_decoder_config
from isolated import check, run_without_archlab

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def _pickled_only_folder(tmp_path: Path) -> tuple[Path, DecoderForCausalLM]:
    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    folder = tmp_path / "pickled"
    model.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder, model


def test_save_writes_safetensors_and_no_pickles(tmp_path):
    DecoderForCausalLM(tiny_decoder_config()).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not [path for path in tmp_path.iterdir() if path.suffix in PICKLE_SUFFIXES]


@pytest.mark.parametrize("loader", [DecoderForCausalLM, AutoModelForCausalLM], ids=["class", "auto"])
@pytest.mark.parametrize("use_safetensors", [None, True])
def test_pickled_weights_are_refused_by_default(tmp_path, loader, use_safetensors):
    folder, _ = _pickled_only_folder(tmp_path)
    kwargs = {} if use_safetensors is None else {"use_safetensors": use_safetensors}
    with pytest.raises(OSError, match="use_safetensors=False"):
        loader.from_pretrained(folder, **kwargs)


def test_opting_in_loads_pickled_weights(tmp_path):
    folder, model = _pickled_only_folder(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=False).eval()
    ids = torch.randint(3, 97, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.slow  # a fresh interpreter
def test_pickled_weights_are_refused_by_the_remote_code_too(tmp_path):
    folder, _ = _pickled_only_folder(tmp_path)
    code = f"""
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
except OSError as error:
    assert "use_safetensors=False" in str(error), error
    print("refused")
model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True, use_safetensors=False)
print(type(model).__module__)
"""
    out = check(run_without_archlab(code, tmp_path / "run")).split()
    assert out[0] == "refused" and out[1].startswith("transformers_modules.")


@pytest.mark.parametrize("entry", registration.MODEL_REGISTRY, ids=lambda entry: entry[2].__name__)
def test_auto_map_lists_every_head_defined_in_the_saved_file(tmp_path, entry):
    auto_class, config_class, model_class = entry
    model_class(tiny_config_for(config_class)).save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    module = model_class.__module__
    expected = {
        auto.__name__: f"{module.rsplit('.', 1)[-1]}.{cls.__name__}"
        for auto, config, cls in registration.MODEL_REGISTRY
        if config is config_class and cls.__module__ == module
    }
    expected.update(  # the masked LM's folder opens as its encoder (`EncoderModel`), not as an encoder-decoder
        (auto.__name__, f"{module.rsplit('.', 1)[-1]}.{cls.__name__}")
        for auto, cls in registration.AUTO_MAP_ONLY
        if cls.__module__ == module
    )
    expected["AutoConfig"] = f"{config_class.__module__.rsplit('.', 1)[-1]}.{config_class.__name__}"
    assert auto_map == expected
    # every entry's code is in the folder
    for reference in auto_map.values():
        assert (tmp_path / f"{reference.split('.')[0]}.py").is_file()


def test_a_config_that_cannot_be_saved_fails_before_anything_is_written(tmp_path):
    """transformers creates the folder and copies the bundled code before it checks the config (when writing
    config.json): an invalid config left a folder of code files only. It fails first now, and nothing is written."""
    model = DecoderForCausalLM(tiny_decoder_config())
    model.config.num_hidden_layers = 1  # `layer_types` still lists 2 layers
    with pytest.raises(StrictDataclassClassValidationError, match="`mlp_layer_types` has 2 entries"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "existing").mkdir()
    with pytest.raises(StrictDataclassClassValidationError, match="num_hidden_layers"):
        model.save_pretrained(tmp_path / "existing")
    assert list((tmp_path / "existing").iterdir()) == []


def test_a_folder_without_any_weights_is_not_blamed_on_pickles(tmp_path):
    """A folder with a config and no weights at all gets transformers' "no file named model.safetensors" alone, as
    stock models do, not the advice to load pickled weights with `use_safetensors=False` (there are none)."""
    tiny_decoder_config().save_pretrained(tmp_path)
    with pytest.raises(OSError, match="no file named model.safetensors") as error:
        DecoderForCausalLM.from_pretrained(tmp_path)
    assert "use_safetensors=False" not in str(error.value)


@pytest.mark.parametrize("first, second", [("1GB", "20KB"), ("20KB", "1GB")])
def test_saving_over_the_other_layout_loads_the_new_weights(tmp_path, first, second):
    """A sharded save over a single `model.safetensors` left that file, which `from_pretrained` prefers: the earlier
    weights loaded silently (stock Llama too). Single over shards left a stale index. Neither stays now."""
    torch.manual_seed(0)
    old, new = DecoderForCausalLM(tiny_decoder_config()), DecoderForCausalLM(tiny_decoder_config())
    old.save_pretrained(tmp_path, max_shard_size=first)
    new.save_pretrained(tmp_path, max_shard_size=second)
    loaded = DecoderForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.lm_head.weight, new.lm_head.weight)
    names = {path.name for path in tmp_path.iterdir()}
    sharded = second == "20KB"
    assert ("model.safetensors" in names) is not sharded and ("model.safetensors.index.json" in names) is sharded
