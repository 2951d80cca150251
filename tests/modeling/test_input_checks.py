"""What `forward` does with malformed input (modeling/input_checks.py) and with sequences past
`max_position_embeddings` (modeling/rotary.py): one clear error or warning line, raised before any work."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from archlab import DecoderForCausalLM, EncoderForMaskedLM, Seq2SeqForConditionalGeneration
from archlab.modeling.input_checks import cached_length, check_attention_mask, check_token_ids

from helpers import tiny_decoder_config, tiny_seq2seq_config


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# ---- token ids past the embedding -------------------------------------------------------------------------------


def test_segment_ids_past_the_segment_types_are_named():
    """A model with one segment type (a masked LM exported to BERT and back) given a pair's segment ids 1 failed in
    the embedding lookup with "index out of range in self"."""
    model = EncoderForMaskedLM(tiny_seq2seq_config(type_vocab_size=1)).eval()
    ids, segments = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0, 0, 1, 1]])
    with pytest.raises(ValueError) as error:
        model(input_ids=ids, token_type_ids=segments)
    assert "`type_vocab_size`=1" in one_line(error) and "segment id 1" in one_line(error)
    model(input_ids=ids, token_type_ids=torch.zeros_like(segments))


@pytest.mark.parametrize("bad", [97, 500, -1])
def test_decoder_refuses_token_ids_outside_the_vocabulary(bad):
    model = DecoderForCausalLM(tiny_decoder_config()).eval()  # vocab_size 97
    ids = torch.tensor([[5, 6, bad, 7]])
    with pytest.raises(ValueError, match="input_ids") as error:
        model(ids)
    assert f"token id {bad}" in one_line(error) and "`vocab_size` is 97" in one_line(error)
    model(torch.tensor([[0, 96]]))  # both ends of the vocabulary are fine


def test_seq2seq_names_the_vocabulary_each_side_reads():
    shared = Seq2SeqForConditionalGeneration(tiny_seq2seq_config()).eval()
    ok = torch.tensor([[5, 6, 2]])
    with pytest.raises(ValueError, match=r"`input_ids` holds token id 61.*`vocab_size` is 61"):
        shared(input_ids=torch.tensor([[5, 61, 2]]), decoder_input_ids=ok)
    with pytest.raises(ValueError, match=r"`decoder_input_ids` holds token id 70.*`vocab_size` is 61"):
        shared(input_ids=ok, decoder_input_ids=torch.tensor([[1, 70]]))
    separate = Seq2SeqForConditionalGeneration(
        tiny_seq2seq_config(share_encoder_decoder_embeddings=False, decoder_vocab_size=40)
    ).eval()
    separate(input_ids=torch.tensor([[60, 2]]), decoder_input_ids=torch.tensor([[1, 39]]))
    with pytest.raises(ValueError, match=r"`decoder_input_ids` holds token id 45.*`decoder_vocab_size` is 40"):
        separate(input_ids=ok, decoder_input_ids=torch.tensor([[1, 45]]))
    with pytest.raises(ValueError, match=r"`input_ids` holds token id 61.*`vocab_size` is 61"):
        EncoderForMaskedLM(tiny_seq2seq_config()).eval()(torch.tensor([[3, 61]]))


def test_a_tokenizer_larger_than_the_model_fails_in_pipeline_with_the_field_named():
    """The user-level case: a tokenizer with more tokens than the model, through `pipeline`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    words = {f"w{i}": i for i in range(3, 120)}  # ids up to 119, the model has 97
    tokenizer = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, **words}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>")
    generator = pipeline("text-generation", model=DecoderForCausalLM(tiny_decoder_config()), tokenizer=tokenizer)
    generator("w5 w6", max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match=r"token id 110.*`vocab_size` is 97.*resize_token_embeddings"):
        generator("w5 w110", max_new_tokens=2, do_sample=False)


# ---- attention masks of the wrong shape ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 4), (2, 9), (3, 6), (1, 6)])
def test_decoder_refuses_a_padding_mask_of_the_wrong_shape(shape):
    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    ids = torch.randint(3, 97, (2, 6))
    with pytest.raises(ValueError, match=r"`attention_mask` has shape .* must be \(batch, cached \+ new tokens\)"):
        model(ids, attention_mask=torch.ones(shape, dtype=torch.long))


def test_decoder_mask_counts_the_cached_tokens():
    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        cache = model(ids, attention_mask=torch.ones(2, 6, dtype=torch.long), use_cache=True).past_key_values
        step = torch.randint(3, 97, (2, 1))
        with pytest.raises(ValueError, match=r"\(2, 7\)"):  # 6 cached + 1 new
            model(step, attention_mask=torch.ones(2, 1, dtype=torch.long), past_key_values=cache)
        model(step, attention_mask=torch.ones(2, 7, dtype=torch.long), past_key_values=cache)
    # generate grows the mask with the cache: left padding, several steps
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    assert model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False).shape == (2, 10)


def test_seq2seq_and_masked_lm_refuse_masks_of_the_wrong_shape():
    model = Seq2SeqForConditionalGeneration(tiny_seq2seq_config()).eval()
    source, target = torch.randint(3, 61, (2, 6)), torch.randint(3, 61, (2, 4))
    with pytest.raises(ValueError, match=r"`attention_mask` has shape \(2, 5\).*\(batch, source tokens\) = \(2, 6\)"):
        model(input_ids=source, attention_mask=torch.ones(2, 5), decoder_input_ids=target)
    with pytest.raises(ValueError, match=r"`decoder_attention_mask` has shape \(3, 4\).* = \(2, 4\)"):
        model(input_ids=source, decoder_input_ids=target, decoder_attention_mask=torch.ones(3, 4))
    encoder_out = model.get_encoder()(input_ids=source)
    with pytest.raises(ValueError, match=r"`attention_mask` has shape \(2, 7\)"):  # checked against encoder_outputs
        model(encoder_outputs=encoder_out, attention_mask=torch.ones(2, 7), decoder_input_ids=target)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    assert model.generate(input_ids=source, attention_mask=mask, num_beams=2, max_new_tokens=3).shape[0] == 2
    with pytest.raises(ValueError, match=r"`attention_mask` has shape \(1, 6\)"):
        EncoderForMaskedLM(tiny_seq2seq_config()).eval()(source, attention_mask=torch.ones(1, 6))


def test_seq2seq_and_masked_lm_refuse_labels_that_do_not_fit_the_source():
    """Both ended in a bare error deep in forward: the decoder's cross-attention (a matrix-size error) or the masked
    LM's pick of labelled positions (an IndexError in training, a message naming `shift_labels` in evaluation)."""
    source = torch.randint(3, 61, (2, 6))
    model = Seq2SeqForConditionalGeneration(tiny_seq2seq_config()).train()
    with pytest.raises(ValueError, match=r"`labels` has 1 rows but `input_ids` has 2: one target sequence per source"):
        model(input_ids=source, labels=source[:1])
    encoder_out = model.get_encoder()(input_ids=source)
    with pytest.raises(ValueError, match=r"`labels` has 3 rows but `encoder_outputs` has 2"):
        model(encoder_outputs=encoder_out, labels=torch.randint(3, 61, (3, 4)))
    assert torch.isfinite(model(input_ids=source, labels=source[:, :3]).loss)  # targets of another length: fine
    masked_lm = EncoderForMaskedLM(tiny_seq2seq_config())
    for mode in (masked_lm.train, masked_lm.eval):
        mode()
        with pytest.raises(ValueError, match=r"`labels` has shape \(2, 4\); it must be the input's \(2, 6\)"):
            masked_lm(input_ids=source, labels=source[:, :4])


def test_checks_never_read_values_off_the_cpu():
    """Values are read from CPU tensors only: on an accelerator that would wait for the device in every forward.
    A meta tensor stands in for a device tensor here (reading its values raises)."""
    ids = torch.empty(2, 5, dtype=torch.long, device="meta")
    check_token_ids(ids, 10)  # no value read, no error
    check_attention_mask(torch.empty(2, 5, device="meta"), 2, 5)  # shapes are free
    with pytest.raises(ValueError):
        check_attention_mask(torch.empty(3, 5, device="meta"), 2, 5)

    class StaticLikeCache:  # a static cache keeps its length in a device tensor
        def get_seq_length(self):
            return torch.empty((), dtype=torch.long, device="meta")

    assert cached_length(StaticLikeCache()) is None
    assert cached_length(None) == 0


def test_checks_do_not_break_a_fullgraph_compile():
    """While torch.compile traces, ids are not read (a data-dependent read would break the graph)."""
    compiled = torch.compile(lambda ids: (check_token_ids(ids, 10), ids * 2)[1], fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(torch.tensor([[1, 2, 30]])), torch.tensor([[2, 4, 60]]))


# ---- RoPE past max_position_embeddings ---------------------------------------------------------------------------


class RecordingStreamer(BaseStreamer):
    """Records, in order, each streamed token into the same list the log handler writes to."""

    def __init__(self, events: list) -> None:
        self.events = events
        self.calls = 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:  # the first call is the prompt
            self.events.append("token")

    def end(self) -> None:
        pass


def test_rope_past_max_positions_warns_once_before_the_first_token():
    """A prompt longer than `max_position_embeddings` runs (RoPE has no table) and says so once, in one line, before
    any token is streamed; transformers' own "friendly reminder" (after the first token) does not also appear."""
    model = DecoderForCausalLM(tiny_decoder_config(max_position_embeddings=8)).eval()
    events: list = []

    class Handler(logging.Handler):
        def emit(self, record):
            events.append(record.getMessage())

    handler = Handler(level=logging.WARNING)
    loggers = [logging.getLogger("archlab.modeling.rotary"), logging.getLogger("transformers")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        ids = torch.randint(3, 97, (1, 10))
        model.generate(ids, max_new_tokens=3, do_sample=False, streamer=RecordingStreamer(events))
        model.generate(ids, max_new_tokens=2, do_sample=False)  # once per model, not per call
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    warnings = [event for event in events if event != "token"]
    assert len(warnings) == 1, warnings
    assert events[0] == warnings[0]  # before the first streamed token
    assert "`max_position_embeddings` (8)" in warnings[0] and "\n" not in warnings[0]
    assert not any("friendly reminder" in event for event in events)


def test_rope_within_max_positions_and_dynamic_rope_do_not_warn(caplog):
    ids = torch.randint(3, 97, (1, 6))
    with caplog.at_level(logging.WARNING, logger="archlab.modeling.rotary"):
        DecoderForCausalLM(tiny_decoder_config(max_position_embeddings=8)).eval()(ids)
        dynamic = {"rope_type": "dynamic", "factor": 2.0}
        dynamic = tiny_decoder_config(max_position_embeddings=4, rope_parameters=dynamic)
        DecoderForCausalLM(dynamic).eval()(ids)  # rescales itself past the length: its purpose
    assert not [record for record in caplog.records if record.name.startswith("archlab")]


def test_rope_scaled_by_a_factor_warns_only_past_the_length_it_scales_to(caplog):
    """yarn with `max_position_embeddings` left at the pretraining length (Qwen2.5's recipe): `factor` 4 runs 4x as
    far without a word, and past that the warning names the scaled length instead of suggesting yarn."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    model = DecoderForCausalLM(tiny_decoder_config(max_position_embeddings=8, rope_parameters=yarn)).eval()
    with caplog.at_level(logging.WARNING, logger="archlab.modeling.rotary"):
        model(torch.randint(3, 97, (1, 32)))
        assert not [record for record in caplog.records if record.name.startswith("archlab")]
        model(torch.randint(3, 97, (1, 33)))
    (warning,) = [record.getMessage() for record in caplog.records if record.name.startswith("archlab")]
    assert "Position 32 is past the 32 positions of rope_type 'yarn'" in warning and "'dynamic'" not in warning


def test_learned_positions_past_the_table_still_fail_with_the_field_named():
    model = DecoderForCausalLM(tiny_decoder_config(position_embedding_type="learned", max_position_embeddings=8))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.eval()(torch.randint(3, 97, (1, 10)))


# ---- a cache of other heads ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, overrides, field",
    [
        ("decoder", dict(num_key_value_heads=2), "num_key_value_heads"),
        ("decoder", dict(head_dim=4), "head_dim"),
        ("seq2seq", dict(decoder_key_value_heads=2), "decoder_key_value_heads"),
        ("seq2seq", dict(d_kv=12), "d_kv"),
    ],
)
def test_a_cache_of_other_heads_is_refused_by_name(family, overrides, field):
    """Keys sized for `num_attention_heads` x width / heads (a PEFT prefix) met a GQA or `d_kv` attention in the
    cache's concatenation, as a size mismatch; now a ValueError names the field and the sizes a prefix needs."""
    from transformers import DynamicCache, EncoderDecoderCache

    if family == "decoder":
        config = tiny_decoder_config(**overrides)
        model, ids = DecoderForCausalLM(config).eval(), {"input_ids": torch.randint(3, 97, (1, 3))}
        heads, width = config.num_attention_heads, config.hidden_size
    else:
        config = tiny_seq2seq_config(**overrides)
        model = Seq2SeqForConditionalGeneration(config).eval()
        ids = {"input_ids": torch.randint(3, 50, (1, 5)), "decoder_input_ids": torch.tensor([[0, 5, 6]])}
        heads, width = config.decoder_attention_heads, config.d_model
    cache = DynamicCache(config=config)
    for layer in range(2):
        cache.update(torch.randn(1, heads, 2, width // heads), torch.randn(1, heads, 2, width // heads), layer)
    if family == "seq2seq":
        cache = EncoderDecoderCache(cache, DynamicCache(config=config))
    with pytest.raises(ValueError, match=f"`{field}`") as error:
        model(**ids, past_key_values=cache, attention_mask=None)
    assert "PrefixTuningConfig(num_attention_heads=" in one_line(error)


def test_a_cache_holding_a_tensor_parallel_share_of_the_heads_passes():
    """A tensor-parallel rank caches its share of the key/value heads (1 of 2 on 2 ranks)."""
    from transformers import DynamicCache

    from archlab.modeling.input_checks import check_cache_heads

    cache = DynamicCache()
    cache.update(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8), 0)
    check_cache_heads(cache, 2, 8, "num_key_value_heads", "head_dim")
    with pytest.raises(ValueError, match="`head_dim`"):
        check_cache_heads(cache, 2, 4, "num_key_value_heads", "head_dim")


# ---- special token ids past the output vocabulary ------------------------------------------------------------------


@pytest.mark.parametrize("field", ["forced_eos_token_id", "forced_bos_token_id"])
@pytest.mark.parametrize("bad", [97, -1])
def test_generate_refuses_forced_tokens_outside_the_vocabulary_before_decoding(field, bad):
    """transformers' forced-token processors index the scores with the id: an IndexError at the step that forces it
    (the last one for `forced_eos_token_id`, after the whole generation), or -1 reported as `eos_token_id`."""
    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    with pytest.raises(ValueError, match=rf"`{field}` \({bad}\) must be in \[0, 97\)") as error:
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, **{field: bad})
    one_line(error)


@pytest.mark.parametrize("field", ["decoder_start_token_id", "forced_eos_token_id"])
def test_seq2seq_generate_names_the_start_or_forced_token_outside_the_vocabulary(field):
    model = Seq2SeqForConditionalGeneration(tiny_seq2seq_config()).eval()  # vocab_size 61
    with pytest.raises(ValueError, match=rf"`{field}` \(61\) must be in \[0, 61\)"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, **{field: 61})


def test_generate_refuses_a_pad_outside_the_vocabulary_that_finished_rows_would_be_fed():
    """A row that ends before the others is fed the pad: refused before the prompt's forward (it was a
    `input_ids` error mid-generation on CPU, a device-side assert on a GPU). One row, or nothing that ends, passes."""
    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with pytest.raises(ValueError, match=r"`pad_token_id` \(97\) must be in \[0, 97\).*end before the others"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, pad_token_id=97, eos_token_id=2)
    unpadded = DecoderForCausalLM(tiny_decoder_config(pad_token_id=None)).eval()
    with pytest.raises(ValueError, match=r"`pad_token_id` \(unset, so the first `eos_token_id`\) \(-1\)"):
        unpadded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, eos_token_id=[-1, 2])
    assert model.generate(ids[:1], max_new_tokens=3, pad_token_id=-1, eos_token_id=2).shape[0] == 1
    assert model.generate(ids, max_new_tokens=3, pad_token_id=-1, eos_token_id=None).shape == (2, 6)


def test_generate_warns_once_about_end_of_sequence_ids_it_can_never_generate(caplog):
    """An `eos_token_id` outside the vocabulary is never generated, so generation silently ran to `max_length`; a
    warning names it (legacy configs carry such ids, so it is not an error)."""
    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    with caplog.at_level(logging.WARNING, logger="archlab.modeling.input_checks"):
        out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, eos_token_id=[2, 500])
    assert out.shape == (1, 6)
    warned = [r.getMessage() for r in caplog.records if "eos_token_id" in r.getMessage()]
    assert len(warned) == 1 and "[500]" in warned[0] and "[0, 97)" in warned[0]
