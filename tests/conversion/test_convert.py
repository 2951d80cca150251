"""scripts/convert_checkpoint.py and archlab.conversion: Llama folders to archlab and back."""

import json
import re
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertConfig,
    BertForMaskedLM,
    BertForMultipleChoice,
    GPT2Config,
    GPT2ForQuestionAnswering,
    GPT2ForTokenClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

from archlab.conversion import FAMILIES, ConversionError, convert_checkpoint
from archlab.scripts import convert_checkpoint as convert_script

from helpers import REPO, TINY, tiny_decoder_config

SCRIPT = REPO / "scripts" / "convert_checkpoint.py"
TINY_BERT = dict(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48)
TINY_GPT2 = dict(vocab_size=97, n_embd=32, n_layer=1, n_head=4, n_positions=64)


@pytest.fixture
def llama_folder(tmp_path):
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    model.save_pretrained(tmp_path / "llama")
    (tmp_path / "llama" / "tokenizer.json").write_text("{}")  # side files travel along
    return tmp_path / "llama", model


def test_llama_to_archlab_and_back_via_the_script(llama_folder, tmp_path):
    src, reference = llama_folder
    ids = torch.randint(3, 97, (2, 9))
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(src), str(tmp_path / "arch")], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    arch = AutoModelForCausalLM.from_pretrained(tmp_path / "arch").eval()
    assert type(arch).__name__ == "DecoderForCausalLM"
    assert (tmp_path / "arch" / "tokenizer.json").is_file()
    assert (arch(ids).logits - reference(ids).logits).abs().max() <= 1e-4

    # back through the script's `main` in this process (a fresh one costs ~10 s of imports; the command ran above)
    assert convert_script.main([str(tmp_path / "arch"), str(tmp_path / "back"), "--to", "llama"]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "llama"
    back = LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert torch.equal(back(ids).logits, reference(ids).logits)


def test_non_equivalent_config_is_refused_with_the_fields_named(tmp_path):
    config = tiny_decoder_config(lm_loss_chunk_size=7)  # training-only: still exportable
    from archlab import DecoderForCausalLM

    model = DecoderForCausalLM(config)
    model.save_pretrained(tmp_path / "ok")
    convert_checkpoint(tmp_path / "ok", tmp_path / "ok_llama", to="llama")
    bad = dict(json.loads((tmp_path / "ok" / "config.json").read_text()))
    field, value = _a_non_llama_field(config)
    if field is None:
        pytest.skip("no non-Llama architecture field exists in this DecoderConfig")
    bad[field] = value
    (tmp_path / "ok" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConversionError, match=field):
        convert_checkpoint(tmp_path / "ok", tmp_path / "bad_llama", to="llama")
    assert not (tmp_path / "bad_llama").exists()  # nothing half-written


@pytest.mark.parametrize("to", ["llama", "mistral", "qwen2_moe", "phi3"])
def test_rope_per_layer_type_exports_as_one_rope_where_the_sets_agree_and_is_refused_where_not(to, tmp_path):
    """RoPE given per layer type (Gemma3's form) exported to a family with one RoPE for every layer: the stock config
    took the nested dict as unknown keys beside its default and built RoPE with theta 10,000 instead of the model's,
    without a word. Equal sets export as the one (the stock logits equal archlab's); different ones are refused."""
    from transformers import AutoModelForCausalLM

    from archlab import DecoderForCausalLM

    one = {"rope_type": "default", "rope_theta": 1e6}
    fields = dict(layer_types=["full_attention", "full_attention"], rope_parameters={"full_attention": one})
    if to == "qwen2_moe":
        fields.update(num_local_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32)
    model = DecoderForCausalLM(tiny_decoder_config(**fields)).eval()
    for parameter in model.parameters():  # (RoPE's base shows in the logits of every position past the first)
        torch.nn.init.normal_(parameter, std=0.3)
    model.save_pretrained(tmp_path / "same")
    convert_checkpoint(tmp_path / "same", tmp_path / "stock", to=to)
    assert json.loads((tmp_path / "stock" / "config.json").read_text())["rope_parameters"]["rope_theta"] == 1e6
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        stock = AutoModelForCausalLM.from_pretrained(tmp_path / "stock").eval()(ids).logits
        torch.testing.assert_close(stock, model(ids).logits, atol=1e-4 * stock.abs().max().item(), rtol=0)
    sliding = {"rope_type": "default", "rope_theta": 1e4}
    fields.update(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    fields["rope_parameters"] = {"sliding_attention": sliding, "full_attention": one}
    DecoderForCausalLM(tiny_decoder_config(**fields)).save_pretrained(tmp_path / "differ")
    with pytest.raises(ConversionError, match="rope_parameters` holds a different set per layer type"):
        convert_checkpoint(tmp_path / "differ", tmp_path / "refused", to=to)
    assert not (tmp_path / "refused").exists()


def _a_non_llama_field(config):
    """An archlab-only architecture field and a non-default value for it (the catalogue grows over time)."""
    candidates = {
        "norm_type": "layer_norm",
        "norm_position": "post",
        "position_embedding_type": "alibi",
        "qk_norm": True,
        "final_logit_softcapping": 30.0,
    }
    for field, value in candidates.items():
        if hasattr(config, field):
            return field, value
    return None, None


def test_errors_are_clear(tmp_path, llama_folder, capsys):
    src, _ = llama_folder
    with pytest.raises(ConversionError, match="no config.json"):
        convert_checkpoint(tmp_path / "nowhere", tmp_path / "x")
    with pytest.raises(ConversionError, match="converts to archlab only"):
        convert_checkpoint(src, tmp_path / "x", to="llama")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(ConversionError, match="not empty"):
        convert_checkpoint(src, tmp_path / "full")
    # (NotADirectoryError's traceback, before)
    with pytest.raises(ConversionError, match="Destination .*full/f is a file, not a folder; choose a new folder"):
        convert_checkpoint(src, tmp_path / "full" / "f")
    with pytest.raises(SystemExit) as exit_status:  # the command line (its entry point runs in a fresh process above)
        convert_script.main([str(src), str(tmp_path / "y"), "--to", "gpt9"])
    assert exit_status.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_pickled_weights_are_refused(tmp_path):
    folder = tmp_path / "pickled"
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="pickled"):
        convert_checkpoint(folder, tmp_path / "out")


@pytest.mark.parametrize("family", ["llama", "mistral", "mixtral"])
def test_omitted_config_fields_take_the_stock_defaults(family):
    """A hand-written config.json may leave fields at the stock family's defaults; they mean what transformers reads."""
    from archlab.conversion import FAMILIES

    hf_config = {"model_type": family, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
    stock = FAMILIES[family].config_class(**hf_config)
    config = FAMILIES[family].archlab_config(hf_config)
    for name in ("intermediate_size", "max_position_embeddings", "vocab_size", "rope_parameters"):
        assert getattr(config, name) == getattr(stock, name), name
    assert config.sliding_window == getattr(stock, "sliding_window", None)


def test_a_stock_pad_id_of_minus_one_converts_as_no_pad(tmp_path):
    """Older Llama folders say "no pad" with `pad_token_id=-1`; LlamaConfig only warns, archlab's config refuses it,
    so such a folder did not convert. It converts with `pad_token_id=None`, a warning naming the field, equal logits."""
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "pad_token_id": -1})).eval()
    model.save_pretrained(tmp_path / "llama")
    with pytest.warns(UserWarning, match=r"`pad_token_id` \(-1\) is outside the vocabulary"):
        convert_checkpoint(tmp_path / "llama", tmp_path / "archlab")
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "archlab").eval()
    assert converted.config.pad_token_id is None
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_weights_file_is_named(llama_folder, tmp_path, damage, capsys):
    src, _ = llama_folder
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100] if damage == "truncated" else b"")
    with pytest.raises(ConversionError, match=f"{weights} is damaged or not a safetensors file"):
        convert_checkpoint(src, tmp_path / "out")
    capsys.readouterr()
    assert convert_script.main([str(src), str(tmp_path / "out")]) == 2  # the command line's exit status
    printed = capsys.readouterr().err
    assert printed.startswith(f"error: {weights} is damaged") and len(printed.splitlines()) == 1, printed
    assert not (tmp_path / "out").exists()


def test_a_llama_reward_model_converts_both_ways_via_the_script(tmp_path):
    """A `LlamaForSequenceClassification` folder failed with "missing lm_head, unexpected score.weight"; it is archlab's
    `DecoderForSequenceClassification`, one label and its pad token kept, and exports back to the stock class."""
    reference = LlamaForSequenceClassification(LlamaConfig(**TINY, num_labels=1)).eval()
    reference.save_pretrained(tmp_path / "rm")
    assert convert_script.main([str(tmp_path / "rm"), str(tmp_path / "arch")]) == 0
    arch = AutoModelForSequenceClassification.from_pretrained(tmp_path / "arch").eval()
    assert type(arch).__name__ == "DecoderForSequenceClassification"
    assert (arch.config.num_labels, arch.config.pad_token_id) == (1, 0)
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        assert (arch(ids, attention_mask=mask).logits - reference(ids, attention_mask=mask).logits).abs().max() <= 1e-4
    assert convert_script.main([str(tmp_path / "arch"), str(tmp_path / "back"), "--to", "llama"]) == 0
    back = LlamaForSequenceClassification.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(back(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)


@pytest.mark.parametrize(
    "model_class, named",
    [
        # GPT-2's token classifier and QA class have heads of their own (`classifier`, ...), not transformers' generic
        # ones that archlab's classes are
        (
            GPT2ForTokenClassification,
            "GPT2ForTokenClassification, a head the converter does not convert; for gpt2 "
            "it converts GPT2LMHeadModel and GPT2ForSequenceClassification",
        ),
        (GPT2ForQuestionAnswering, "GPT2ForQuestionAnswering, a head"),
        # BERT converts as a masked LM and its sequence and token classifiers and its QA model
        (
            BertForMultipleChoice,
            "BertForMultipleChoice, a head the converter does not convert; for bert it converts BertForMaskedLM "
            "and BertForSequenceClassification and BertForTokenClassification and BertForQuestionAnswering.",
        ),
    ],
)
def test_a_head_the_converter_does_not_convert_is_refused_by_name(model_class, named, tmp_path, capsys):
    """Refused before any weight is read, naming the class and what converts (it failed late, as missing and
    unexpected weights or tensors the family does not know)."""
    config = GPT2Config(**TINY_GPT2) if model_class.config_class is GPT2Config else BertConfig(**TINY_BERT)
    model_class(config).save_pretrained(tmp_path / "src")
    with pytest.raises(ConversionError) as err:
        convert_checkpoint(tmp_path / "src", tmp_path / "out")
    assert named in str(err.value), str(err.value)
    assert convert_script.main([str(tmp_path / "src"), str(tmp_path / "out")]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_masked_lm_converts_back_to_bert(tmp_path):
    """An archlab folder without RoPE fields (the masked LM's, the encoder-decoder's) exports: the check for RoPE per
    layer type read `rope_parameters`, which Seq2SeqConfig has not."""
    torch.manual_seed(0)
    reference = BertForMaskedLM(BertConfig(**TINY_BERT)).eval()
    reference.save_pretrained(tmp_path / "bert")
    convert_checkpoint(tmp_path / "bert", tmp_path / "arch")
    convert_checkpoint(tmp_path / "arch", tmp_path / "back", to="bert")
    back = BertForMaskedLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, reference(ids).logits)


def test_a_classifier_whose_pad_token_ends_the_text_is_warned_about_both_ways(tmp_path):
    """Where pad is also end-of-sequence, stock Llama's head skips a trailing end-of-sequence token (it reads the ids),
    archlab's scores it (the mask keeps it): converted silently, the scores of such texts differed (0.36 here)."""
    config = LlamaConfig(**{**TINY, "pad_token_id": 2}, num_labels=1)
    reference = LlamaForSequenceClassification(config).eval()
    reference.save_pretrained(tmp_path / "rm")
    with pytest.warns(UserWarning, match="pad_token_id=2 is also an end-of-sequence token"):
        convert_checkpoint(tmp_path / "rm", tmp_path / "arch")
    with pytest.warns(UserWarning, match="LlamaForSequenceClassification scores the token before it"):
        convert_checkpoint(tmp_path / "arch", tmp_path / "back", to="llama")
    arch = AutoModelForSequenceClassification.from_pretrained(tmp_path / "arch").eval()
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0
    ids[:, -2:] = 2  # right padding
    with torch.no_grad():  # texts that do not end with the token: the same scores
        assert (arch(ids, attention_mask=mask).logits - reference(ids, attention_mask=mask).logits).abs().max() <= 1e-4


def test_an_adapter_saved_beside_the_weights_is_neither_read_nor_copied(llama_folder, tmp_path):
    """A PEFT adapter saved into the model's folder: its tensors were read as the model's ("tensors the converter does
    not know"), and a copied `adapter_config.json` would make transformers load the new folder as an adapter. The
    shards an index names are the weights, and one it names that is missing is named."""
    src, reference = llama_folder
    get_peft_model(LlamaForCausalLM(LlamaConfig(**TINY)), LoraConfig(target_modules=["q_proj"])).save_pretrained(src)
    assert (src / "adapter_model.safetensors").is_file() and (src / "adapter_config.json").is_file()
    convert_checkpoint(src, tmp_path / "arch")
    assert not (tmp_path / "arch" / "adapter_config.json").exists()
    ids = torch.randint(3, 97, (2, 9))
    arch = AutoModelForCausalLM.from_pretrained(tmp_path / "arch").eval()
    assert (arch(ids).logits - reference(ids).logits).abs().max() <= 1e-4

    reference.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    convert_checkpoint(tmp_path / "sharded", tmp_path / "from-shards")
    shards[-1].unlink()
    with pytest.raises(ConversionError, match=f"{shards[-1].name} is missing: model.safetensors.index.json names it"):
        convert_checkpoint(tmp_path / "sharded", tmp_path / "incomplete")


def test_the_script_help_names_every_family():
    """The families the script's help lists (its docstring) are the converter's, every one of them."""
    listed = convert_script.__doc__.split("Families:", 1)[1].split("A config the other side", 1)[0]
    named = set(re.findall(r"[a-z][a-z0-9_-]+\d?", re.sub(r"\([^)]*\)", "", listed)))
    assert set(FAMILIES) <= named, sorted(set(FAMILIES) - named)
