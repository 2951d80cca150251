"""training/dtypes.py: the dtype a saved model loads in (`--dtype`), what `auto` reads from a folder, and which dtypes
the training scripts refuse to train."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import archlab
from archlab.training.configs import build_model
from archlab.training.dtypes import check_dtype, check_training_dtype, saved_dtype, trained_dtype

from helpers import tiny_decoder_config


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny decoder saved in float32, bfloat16 and float16."""
    root = tmp_path_factory.mktemp("dtypes")
    torch.manual_seed(0)
    model = archlab.DecoderForCausalLM(tiny_decoder_config())
    for dtype in ("float32", "bfloat16", "float16"):
        model.to(getattr(torch, dtype)).save_pretrained(root / dtype)
    return {dtype: root / dtype for dtype in ("float32", "bfloat16", "float16")}


def test_a_dtype_outside_the_allowed_values_is_named_with_them() -> None:
    for value in (None, "auto", "bfloat16", "float16", "float32"):
        check_dtype(value)
    with pytest.raises(ValueError, match=r"--dtype 'bf16' is not supported; allowed values: auto, bfloat16, float16"):
        check_dtype("bf16")


def test_auto_reads_the_saved_dtype_from_the_config_or_else_the_weights(folders: dict[str, Path], tmp_path) -> None:
    assert saved_dtype(folders["bfloat16"]) == torch.bfloat16
    assert saved_dtype(folders["float16"]) == torch.float16
    folder = shutil.copytree(folders["float16"], tmp_path / "float16")
    config = json.loads((folder / "config.json").read_text())
    del config["dtype"]
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))  # transformers 4's key
    assert saved_dtype(folder) == torch.bfloat16
    (folder / "config.json").write_text(json.dumps(config))  # neither: the weights say
    assert saved_dtype(folder) == torch.float16


def test_the_trained_dtype_a_resume_must_keep_is_the_one_the_weights_load_in(folders: dict[str, Path]) -> None:
    """The run fact of the weights' dtype (`run_facts`): what `build_model` loads, by name; `auto` resolved from the
    folder, so a run started with --dtype bfloat16 resumes under auto on the same bfloat16 folder; unknown (None,
    not recorded) for `auto` on a Hub name, known only once downloaded."""
    bf16 = str(folders["bfloat16"])
    for value, expected in ((None, "float32"), ("float32", "float32"), ("bfloat16", "bfloat16"), ("auto", "bfloat16")):
        assert trained_dtype(value, bf16) == expected
    assert trained_dtype("auto", str(folders["float32"])) == "float32"
    assert trained_dtype(None, None) == "float32"  # a new model is built in float32
    assert trained_dtype("auto", "org/hub-model") is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, torch.float32), ("float32", torch.float32), ("auto", torch.bfloat16), ("bfloat16", torch.bfloat16)],
)
def test_a_training_script_loads_the_weights_in_the_dtype_asked_float32_by_default(
    folders: dict[str, Path], value, expected
) -> None:
    """A folder saved in bfloat16 (as most Hub checkpoints are): transformers 5 loads the saved dtype unless told,
    and the scripts trained its bfloat16 weights as they were, without a word; unset, they are float32 now."""
    config = AutoConfig.from_pretrained(folders["bfloat16"])
    model = build_model(AutoModelForCausalLM, config, str(folders["bfloat16"]), dtype=value)
    assert {p.dtype for p in model.parameters()} == {expected}
    assert model.config.dtype == expected
    fresh = build_model(AutoModelForCausalLM, tiny_decoder_config(), None, dtype=None)
    assert {p.dtype for p in fresh.parameters()} == {torch.float32}


def test_float16_weights_and_bfloat16_weights_under_fp16_are_refused_for_training(
    folders: dict[str, Path], capsys
) -> None:
    with pytest.raises(ValueError, match="--dtype float16 would train float16 weights: --fp16's loss scaling"):
        check_training_dtype("float16", str(folders["float32"]), fp16=False)
    with pytest.raises(ValueError, match=r"--dtype auto \(.*float16'? was saved in float16\) would train float16"):
        check_training_dtype("auto", str(folders["float16"]), fp16=False)
    with pytest.raises(ValueError, match="Conflicting flags: --fp16 and --dtype bfloat16: --fp16 is mixed precision"):
        check_training_dtype("bfloat16", str(folders["float32"]), fp16=True)
    with pytest.raises(ValueError, match="--dtype bfloat16: it sets the dtype a saved --model_name_or_path loads in"):
        check_training_dtype("bfloat16", None, fp16=False)
    for value, folder in ((None, "float16"), ("float32", "float16"), ("auto", "float32")):
        check_training_dtype(value, str(folders[folder]), fp16=True)
    assert "Warning" not in capsys.readouterr().out
    check_training_dtype("auto", str(folders["bfloat16"]), fp16=False)
    out = capsys.readouterr().out
    assert "Warning: --dtype auto" in out and "(pure bfloat16)" in out


def test_auto_on_a_hub_name_is_checked_once_the_weights_are_loaded(folders: dict[str, Path], tmp_path) -> None:
    """`--dtype auto` with a Hub name: nothing is known before the download (`check_training_dtype` lets it pass), so
    the loaded model is checked before training, with the same refusals as a local folder's, and its dtype becomes
    the run fact a resume must keep."""
    from types import SimpleNamespace

    from archlab.model_cards.facts import RUN_FACTS
    from archlab.training.dtypes import check_loaded_dtype, confirm_loaded_dtype

    hub = "org/hub-model"
    check_training_dtype("auto", hub, fp16=False)  # (not downloaded yet: no error)
    half = archlab.DecoderForCausalLM.from_pretrained(folders["float16"], dtype="auto")
    bf16 = archlab.DecoderForCausalLM.from_pretrained(folders["bfloat16"], dtype="auto")
    with pytest.raises(ValueError, match=r"--dtype auto \('org/hub-model' loaded in float16\) would train float16"):
        check_loaded_dtype(half, "auto", hub, fp16=False)
    with pytest.raises(ValueError, match=r"Conflicting flags: --fp16 and --dtype auto \('org/hub-model' loaded in"):
        check_loaded_dtype(bf16, "auto", hub, fp16=True)
    assert check_loaded_dtype(bf16, "auto", hub, fp16=False) == "bfloat16"
    # a local folder was checked before loading, and another --dtype needs no download to be known
    assert check_loaded_dtype(half, "auto", str(folders["float16"]), fp16=False) is None
    assert check_loaded_dtype(bf16, "bfloat16", hub, fp16=False) is None

    args = SimpleNamespace(dtype="auto", model_name_or_path=hub), SimpleNamespace(fp16=False)
    facts: dict = {}
    confirm_loaded_dtype(bf16, *args, facts, resume=None)
    assert facts == {"weights_dtype": "bfloat16"}
    resume = tmp_path / "checkpoint-5"
    resume.mkdir()
    (resume / RUN_FACTS).write_text(json.dumps({"weights_dtype": "float32"}))
    refused = r"was trained with --dtype \(the weights' dtype\) = 'float32', but these flags give 'bfloat16'"
    with pytest.raises(ValueError, match=refused):
        confirm_loaded_dtype(bf16, *args, {}, resume=str(resume))
