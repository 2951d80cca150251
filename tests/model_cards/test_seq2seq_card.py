"""The encoder-decoder's model card: a Hub pipeline tag that exists for encoder-decoders, and a usage snippet that runs.

transformers 5 removed the text2text pipelines and the Hub files `text2text-generation` under `text-generation`, whose
snippets would call a pipeline that cannot load an encoder-decoder; the card says `translation` (or the caller's
`summarization`) and shows `generate` with beam search.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch
from huggingface_hub import ModelCard

from archlab import Seq2SeqForConditionalGeneration, translate
from archlab.model_cards import write_model_card
from archlab.model_cards.card import task_prefix_key

from helpers import digit_tokenizer, tiny_seq2seq_config


def saved_translator(folder):
    torch.manual_seed(0)
    model = Seq2SeqForConditionalGeneration(tiny_seq2seq_config(vocab_size=16, init_std=1.0)).eval()
    model.save_pretrained(folder)
    digit_tokenizer().save_pretrained(folder)
    return model


@pytest.mark.parametrize("pipeline_tag", [None, "summarization"])
def test_card_tag_and_snippet_that_runs(tmp_path, pipeline_tag):
    model = saved_translator(tmp_path / "m")
    card = write_model_card(tmp_path / "m", model_id="someone/m", example_text="1 2 3", pipeline_tag=pipeline_tag)
    assert ModelCard.load(card).data.pipeline_tag == (pipeline_tag or "translation")
    text = card.read_text()
    assert "text2text" not in text and "pipeline(" not in text
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "AutoModelForSeq2SeqLM.from_pretrained(model_id, trust_remote_code=True)" in snippet
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(snippet.replace('"someone/m"', repr(str(tmp_path / "m"))), {})
    # the snippet prints what archlab's one-call helper returns for the same input and beam settings
    expected = translate(["1 2 3"], model, digit_tokenizer(), num_beams=4, max_new_tokens=40)
    assert printed.getvalue().strip() == repr(expected)


def test_a_tag_that_does_not_fit_is_refused(tmp_path):
    saved_translator(tmp_path / "m")
    with pytest.raises(
        ValueError, match=r"pipeline_tag='text-generation' .* allowed: \['translation', 'summarization'\]"
    ):
        write_model_card(tmp_path / "m", pipeline_tag="text-generation")
    assert not (tmp_path / "m" / "README.md").exists()


def test_push_keeps_or_sets_the_task(tmp_path, capsys):
    """`push_to_hub.py --pipeline_tag summarization` tags a summariser; a later push of its folder keeps the tag;
    a tag that does not fit the model fails before anything is written."""
    from archlab.scripts import push_to_hub

    saved_translator(tmp_path / "m")
    dry = ["someone/m", "--dry-run"]
    assert push_to_hub.main([str(tmp_path / "m"), *dry, str(tmp_path / "a"), "--pipeline_tag", "summarization"]) == 0
    assert ModelCard.load(tmp_path / "a" / "README.md").data.pipeline_tag == "summarization"
    assert push_to_hub.main([str(tmp_path / "a"), *dry, str(tmp_path / "b")]) == 0
    assert ModelCard.load(tmp_path / "b" / "README.md").data.pipeline_tag == "summarization"
    assert push_to_hub.main([str(tmp_path / "m"), *dry, str(tmp_path / "c"), "--pipeline_tag", "fill-mask"]) == 2
    assert "pipeline_tag='fill-mask' does not fit a Seq2SeqForConditionalGeneration" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    with pytest.raises(SystemExit):
        push_to_hub.main([str(tmp_path / "m"), *dry, str(tmp_path / "d"), "--pipeline_tag", "text2text-generation"])


def test_architecture_rows_of_a_t5_style_config():
    from archlab.model_cards.facts import architecture_rows

    config = tiny_seq2seq_config(d_kv=12, encoder_key_value_heads=2, use_qk_norm=True).to_dict()
    rows = dict(architecture_rows(config))
    assert rows["attention"] == "grouped-query (GQA), 4 query heads, 2 key/value heads"
    assert rows["head dim"] == "12" and rows["stability"] == "use_qk_norm=True"


def test_the_snippet_puts_the_task_prefix_before_its_source(tmp_path):
    """A model trained with a T5-style task prefix (`task_specific_params[task]["prefix"]`, which finetune.py's
    --source_prefix writes) gets it before the snippet's source: the snippet read the bare text, an input the model
    never saw in training. A prefix of another task is not used."""
    model = saved_translator(tmp_path / "m")
    model.config.task_specific_params = {"summarization": {"prefix": "9 "}, "translation_en_to_de": {"prefix": "7 "}}
    model.config.save_pretrained(tmp_path / "m")
    card = write_model_card(tmp_path / "m", model_id="someone/m", example_text="1 2 3", pipeline_tag="translation")
    snippet = re.search(r"```python\n(.*?)```", card.read_text(), re.S).group(1)
    assert "model.config.task_specific_params['translation_en_to_de'][\"prefix\"]" in snippet
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(snippet.replace('"someone/m"', repr(str(tmp_path / "m"))), {})
    expected = translate(
        ["1 2 3"], model, digit_tokenizer(), task="translation_en_to_de", num_beams=4, max_new_tokens=40
    )
    assert printed.getvalue().strip() == repr(expected)


def test_the_task_prefix_is_the_pipeline_tags_own():
    """T5's keys: "summarization" for a summarizer, the first "translation*" key for a translator (as transformers 4's
    translation pipeline picks it); none without an entry holding a prefix."""
    params = {"summarization": {"prefix": "summarize: ", "max_length": 200}, "translation_en_to_de": {"prefix": "t: "}}
    assert task_prefix_key({"task_specific_params": params}, "summarization") == "summarization"
    assert task_prefix_key({"task_specific_params": params}, "translation") == "translation_en_to_de"
    assert task_prefix_key({"task_specific_params": {"summarization": {"max_length": 9}}}, "summarization") is None
    assert task_prefix_key({}, "translation") is None
