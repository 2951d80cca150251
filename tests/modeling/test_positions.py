"""ALiBi, learned and sinusoidal absolute positions: formulas, BLOOM's slopes, state dicts, extrapolation."""

import pytest
import torch
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

from archlab import DecoderForCausalLM
from archlab.modeling.positions import ALiBiBias, LearnedPositionEmbedding, alibi_slopes
from archlab.modeling.sinusoidal import SinusoidalPositionalEmbedding, interleaved_table

from helpers import tiny_decoder_config, tiny_seq2seq_config


@pytest.mark.parametrize("num_heads", [1, 2, 4, 6, 8, 12, 16, 20, 112])
def test_alibi_slopes_match_bloom(num_heads):
    # BLOOM's tensor for a row of 2 tokens holds slope * key position; position 1 is the slope itself.
    bloom = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)[:, 0, 1]
    torch.testing.assert_close(alibi_slopes(num_heads), bloom)


def test_alibi_slopes_paper_sequence():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))


def test_alibi_bias_is_minus_slope_times_distance():
    alibi = ALiBiBias(4)
    q, k = torch.arange(3, 6), torch.arange(0, 6)
    bias = alibi(q, k)
    assert bias.shape == (1, 4, 3, 6)
    for h in range(4):
        for i, qi in enumerate(q.tolist()):
            for j, kj in enumerate(k.tolist()):
                assert bias[0, h, i, j].item() == pytest.approx(-alibi_slopes(4)[h].item() * abs(qi - kj))


def _attention_reference(model, input_ids):
    """Slow ALiBi decoder forward written from the weights (pre-RMSNorm, SwiGLU, causal softmax per head)."""
    cfg = model.config
    h = model.model.embed_tokens(input_ids)
    T = input_ids.shape[1]
    slopes = alibi_slopes(cfg.num_attention_heads)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    causal = j <= i
    for layer in model.model.layers:
        x = layer.input_layernorm(h)
        a = layer.self_attn
        q = a.q_proj(x).view(1, T, cfg.num_attention_heads, -1).transpose(1, 2)
        k = a.k_proj(x).view(1, T, cfg.num_key_value_heads, -1).transpose(1, 2)
        v = a.v_proj(x).view(1, T, cfg.num_key_value_heads, -1).transpose(1, 2)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        heads = []
        for head in range(cfg.num_attention_heads):
            scores = q[0, head] @ k[0, head].T / cfg.head_dim**0.5 - slopes[head] * (i - j)
            scores = scores.masked_fill(~causal, float("-inf"))
            heads.append(scores.softmax(-1) @ v[0, head])
        h = h + a.o_proj(torch.cat(heads, dim=-1)[None])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_alibi_model_matches_slow_reference_beyond_max_positions(attn):
    config = tiny_decoder_config(position_embedding_type="alibi", max_position_embeddings=16, attn_implementation=attn)
    model = DecoderForCausalLM(config).eval()
    input_ids = torch.randint(3, 97, (1, 40))  # 2.5x the configured context: ALiBi has no position table
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, _attention_reference(model, input_ids), atol=1e-4, rtol=0)
        # decoding past the training length with the cache gives the same logits
        out = model(input_ids[:, :30], use_cache=True)
        step = model(input_ids[:, 30:31], past_key_values=out.past_key_values).logits
    torch.testing.assert_close(step[:, -1], model(input_ids[:, :31]).logits[:, -1], atol=1e-4, rtol=0)


def test_alibi_has_no_parameters_or_checkpoint_entries():
    model = DecoderForCausalLM(tiny_decoder_config(position_embedding_type="alibi"))
    assert model.model.rotary_emb is None and model.model.embed_positions is None
    assert not [k for k in model.state_dict() if "slopes" in k or "position" in k]


def test_learned_positions_are_a_trained_table():
    model = DecoderForCausalLM(tiny_decoder_config(position_embedding_type="learned", max_position_embeddings=32))
    assert isinstance(model.model.embed_positions, LearnedPositionEmbedding)
    assert model.state_dict()["model.embed_positions.weight"].shape == (32, 32)
    assert model.model.rotary_emb is None
    input_ids = torch.randint(3, 97, (1, 8))
    model(input_ids, labels=input_ids).loss.backward()
    grad = model.model.embed_positions.weight.grad
    assert grad[:8].abs().sum() > 0 and grad[8:].abs().sum() == 0  # rows past the sequence are never trained


def test_sinusoidal_positions_are_the_fixed_paper_table(tmp_path):
    model = DecoderForCausalLM(tiny_decoder_config(position_embedding_type="sinusoidal", max_position_embeddings=40))
    table = model.model.embed_positions
    assert isinstance(table, SinusoidalPositionalEmbedding)
    torch.testing.assert_close(table.weight, interleaved_table(40, 32).float())
    assert not [k for k in model.state_dict() if "embed_positions" in k]  # derived, not stored
    model.save_pretrained(tmp_path)
    loaded = DecoderForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(loaded.model.embed_positions.weight, interleaved_table(40, 32).float())


@pytest.mark.parametrize("kind", ["learned", "sinusoidal"])
def test_positions_counted_from_the_mask_make_a_padded_row_equal_the_row_alone(kind):
    """Padding is numbered -1 there (a left-padded row starts at 0): the sinusoidal lookup raised an index error on
    any padded batch, left or right."""
    config = tiny_decoder_config(position_embedding_type=kind, position_ids_from_attention_mask=True)
    model = DecoderForCausalLM(config).eval()
    ids = torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, 5:] = 0  # right padding
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        left_alone, right_alone = model(ids[:1, 3:]).logits, model(ids[1:, :5]).logits
    torch.testing.assert_close(padded[0, 3:], left_alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded[1, :5], right_alone[0], atol=1e-5, rtol=0)
    labels = ids.masked_fill(mask == 0, -100)
    model.train()(ids, attention_mask=mask, labels=labels).loss.backward()


@pytest.mark.parametrize("kind", ["learned", "sinusoidal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_positions_counted_from_a_float_or_bool_mask(kind, dtype):
    """PEFT's prompt tuning prepends float ones to the mask: the count must stay integer (it was promoted to float,
    and the table lookup refused float indices)."""
    model = DecoderForCausalLM(tiny_decoder_config(position_embedding_type=kind, position_ids_from_attention_mask=True))
    ids = torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        expected = model.eval()(ids, attention_mask=mask).logits
        torch.testing.assert_close(model(ids, attention_mask=mask.to(dtype)).logits, expected, atol=0, rtol=0)


# Absolute position tables end at `max_position_embeddings`: longer sequences are refused by name, not by an index
# error inside the lookup.
@pytest.mark.parametrize("kind", ["learned", "sinusoidal"])
def test_decoder_refuses_sequences_past_the_position_table(kind):
    model = DecoderForCausalLM(tiny_decoder_config(position_embedding_type=kind, max_position_embeddings=16)).eval()
    model(torch.randint(3, 97, (1, 16)))  # exactly the table: fine
    with pytest.raises(ValueError, match=r"a sequence of 17 tokens.*`max_position_embeddings` = 16"):
        model(torch.randint(3, 97, (1, 17)))
    # generation crosses the limit one step at a time (prompt + cached tokens count)
    with pytest.raises(ValueError, match=r"a sequence of 17 tokens.*`max_position_embeddings` = 16"):
        model.generate(torch.randint(3, 97, (1, 10)), max_new_tokens=10, do_sample=False, pad_token_id=0)


def test_packed_rows_longer_than_the_table_pass_when_every_document_fits():
    model = DecoderForCausalLM(tiny_decoder_config(position_embedding_type="learned", max_position_embeddings=16))
    position_ids = torch.cat([torch.arange(12), torch.arange(12)])[None]  # two documents of 12 in a row of 24
    model(torch.randint(3, 97, (1, 24)), position_ids=position_ids)


@pytest.mark.parametrize("kind", ["learned", "sinusoidal"])
def test_given_negative_position_ids_are_refused_while_padding_counted_from_the_mask_reads_its_row(kind):
    """A given position id of -1 was read as row 0 without a word (the lookup clamps the -1 of padding that positions
    counted from the mask hold); a stock table, an `nn.Embedding`, raises an IndexError. Positions counted from the
    mask still number padding -1."""
    from archlab import EncoderForMaskedLM

    config = dict(position_embedding_type=kind, position_ids_from_attention_mask=True)
    ids, mask = torch.randint(3, 50, (1, 4)), torch.tensor([[0, 1, 1, 1]])
    negative = torch.tensor([[-1, 0, 1, 2]])
    for model in (DecoderForCausalLM(tiny_decoder_config(**config)), EncoderForMaskedLM(tiny_seq2seq_config(**config))):
        model.eval()(ids, attention_mask=mask)  # padding numbered -1 by the model itself
        model(ids, position_ids=negative.clamp(min=0))
        with pytest.raises(ValueError, match=rf"`position_ids` hold -1, but positions start at 0: the {kind} position"):
            model(ids, position_ids=negative)


def test_given_table_rows_past_the_table_are_named_as_rows():
    """RoBERTa's `position_ids_are_table_rows`: a row past the table was reported as the position the offset is
    taken off, against the table's length without its offset rows ("Position ids reach 8 ... 8 rows" for row 10 of
    a 10-row table); a negative row was read as row 0."""
    from archlab import EncoderForMaskedLM

    config = tiny_seq2seq_config(
        max_position_embeddings=8,
        position_embedding_type="learned",
        position_embedding_offset=2,
        position_ids_are_table_rows=True,
    )
    model = EncoderForMaskedLM(config).eval()
    ids = torch.randint(3, 50, (1, 3))
    model(ids, position_ids=torch.tensor([[0, 1, 9]]))  # every row of the table, the offset rows included
    message = r"`position_ids` hold row {}, but with `position_ids_are_table_rows` they are rows of the learned "
    message += (
        r"position table, 0 to 9 \(`position_embedding_offset` = 2 leading rows, then `max_position_embeddings` = 8"
    )
    for row in (10, -1):
        with pytest.raises(ValueError, match=message.format(row)):
            model(ids, position_ids=torch.tensor([[2, 3, row]]))


@pytest.mark.parametrize("kind", ["learned", "sinusoidal"])
def test_seq2seq_refuses_sequences_past_the_position_table(kind):
    from archlab import Seq2SeqForConditionalGeneration

    config = tiny_seq2seq_config(max_position_embeddings=8, position_embedding_type=kind)
    model = Seq2SeqForConditionalGeneration(config).eval()
    short, long = torch.randint(3, 50, (1, 8)), torch.randint(3, 50, (1, 9))
    model(input_ids=short, decoder_input_ids=short)
    with pytest.raises(ValueError, match=r"a sequence of 9 tokens.*`max_position_embeddings` = 8"):
        model(input_ids=long, decoder_input_ids=short)  # encoder side
    with pytest.raises(ValueError, match=r"a sequence of 9 tokens.*`max_position_embeddings` = 8"):
        model(input_ids=short, decoder_input_ids=long)  # decoder side


class _OnAccelerator(torch.Tensor):
    """CPU data that reports an accelerator device and records every value it hands out (`max`, `item`, `int`...)."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the `.device` getter
            return torch.device("cuda", 0)
        name = getattr(func, "__name__", str(func))
        if name not in ("numel", "dim", "__get__"):
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_position_check_never_reads_an_accelerator():
    """The bounds check reads a scalar only from CPU tensors: on an accelerator that read would synchronise every
    decoding step (and break CUDA-graph capture), so there the lookup's own device-side check reports the error."""
    from archlab.modeling.sinusoidal import check_position_ids

    _OnAccelerator.reads.clear()
    check_position_ids(torch.full((1, 5), 10**6).as_subclass(_OnAccelerator), 10, "learned")
    assert _OnAccelerator.reads == []
    check_position_ids(torch.full((1, 5), 10**6, device="meta"), 10, "learned")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        check_position_ids(torch.full((1, 5), 10**6), 10, "learned")
