"""DecoderModel / DecoderForCausalLM behaviour: shapes, cache, backends, padding, outputs, checkpointing, save/load."""

import json
import logging
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from archlab import DecoderForCausalLM, DecoderModel

from helpers import TINY, tiny_decoder_config


def _model(**overrides):
    return DecoderForCausalLM(tiny_decoder_config(**overrides)).eval()


def test_shapes():
    model = _model()
    ids = torch.randint(3, 97, (2, 9))
    out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (2, 9, TINY["vocab_size"])
    assert len(out.hidden_states) == TINY["num_hidden_layers"] + 1
    base = DecoderModel(tiny_decoder_config()).eval()
    assert base(ids).last_hidden_state.shape == (2, 9, TINY["hidden_size"])


def test_exactly_one_of_input_ids_or_embeds():
    model = _model()
    with pytest.raises(ValueError, match="exactly one"):
        model(None)


def test_inputs_embeds_equals_input_ids():
    model = _model()
    ids = torch.randint(3, 97, (2, 7))
    embeds = model.get_input_embeddings()(ids)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, model(ids).logits)


def test_logits_to_keep():
    model = _model()
    ids = torch.randint(3, 97, (2, 7))
    full = model(ids).logits
    torch.testing.assert_close(model(ids, logits_to_keep=1).logits, full[:, -1:])
    torch.testing.assert_close(model(ids, logits_to_keep=torch.tensor([0, 3])).logits, full[:, [0, 3]])


def test_output_attentions_eager():
    model = _model(attn_implementation="eager")
    out = model(torch.randint(3, 97, (2, 6)), output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 4, 6, 6)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(2, 4, 6))
    assert torch.all(out.attentions[0].triu(1) == 0)  # causal


@pytest.mark.parametrize("cache_cls", [DynamicCache, StaticCache])
def test_incremental_decoding_equals_full_forward(cache_cls):
    model = _model()
    ids = torch.randint(3, 97, (2, 12))
    full = model(ids).logits
    cache = (
        DynamicCache(config=model.config) if cache_cls is DynamicCache else StaticCache(model.config, max_cache_len=16)
    )
    steps = [model(ids[:, :5], past_key_values=cache, use_cache=True).logits]
    for t in range(5, 12):
        positions = torch.tensor([[t]])
        steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, position_ids=positions).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


def test_eager_equals_sdpa_with_padding():
    eager = _model(attn_implementation="eager")
    sdpa = _model(attn_implementation="sdpa")
    sdpa.load_state_dict(eager.state_dict())
    ids = torch.randint(3, 97, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    a = eager(ids, attention_mask=mask).logits
    b = sdpa(ids, attention_mask=mask).logits
    assert (a - b)[mask.bool()].abs().max() <= 1e-5


def test_left_padded_batch_equals_each_sequence_alone():
    model = _model()
    seqs = [torch.randint(3, 97, (n,)) for n in (4, 9, 6)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = s
        mask[i, width - len(s) :] = 1
    batch = model(ids, attention_mask=mask).logits
    for i, s in enumerate(seqs):
        alone = model(s[None]).logits[0]
        torch.testing.assert_close(batch[i, width - len(s) :], alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        # a bias with a learned table, shared by the layers of a type: reentrant checkpointing back-propagates only
        # a layer's positional inputs itself, so the bias must be one (as a keyword, the first layer freed its graph)
        dict(position_embedding_type="relative_bias", norm_position="sandwich"),
        dict(position_embedding_type="alibi", norm_position="parallel"),
    ],
    ids=["rope", "relative_bias", "alibi"],
)
def test_gradient_checkpointing_gives_same_gradients(overrides, reentrant):
    torch.manual_seed(0)
    model = _model(**overrides).train()
    ids = torch.randint(3, 97, (2, 8))

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    checkpointed = grads()
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b)


def test_training_loss_without_chunking_equals_chunked():
    model = _model().train()
    ids = torch.randint(3, 97, (2, 8))
    chunked = model(ids, labels=ids)
    assert chunked.logits is None  # the fused head never materialises training logits
    model.config.lm_loss_chunk_size = 0
    plain = model(ids, labels=ids)
    torch.testing.assert_close(chunked.loss, plain.loss)


def test_skip_logits_returns_the_loss_alone_or_the_logits_too():
    """Trainer's evaluation under `use_liger_kernel` passes `skip_logits=True`; False asks for logits in training."""
    model = _model()
    ids = torch.randint(3, 97, (2, 8))
    full = model(ids, labels=ids)
    skipped = model(ids, labels=ids, skip_logits=True)
    assert skipped.logits is None and full.logits is not None
    torch.testing.assert_close(skipped.loss, full.loss)
    assert model.train()(ids, labels=ids, skip_logits=False).logits is not None


def test_save_load_round_trip_and_bf16(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "archlab_decoder"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is DecoderForCausalLM
    ids = torch.randint(3, 97, (2, 7))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    half = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16
    assert half(ids).logits.dtype == torch.bfloat16


def test_resize_below_a_special_token_id_warns_at_the_resize(tmp_path, caplog):
    """A smaller vocabulary without `pad_token_id` makes a config that `save_pretrained` refuses: said at the resize
    (before, the first word came from the first save, a Trainer's first checkpoint). Setting the id afterwards
    saves; a resize that keeps the ids says nothing."""
    model = DecoderForCausalLM(tiny_decoder_config(pad_token_id=95)).eval()
    with caplog.at_level(logging.WARNING, logger="archlab.modeling.pretrained"):
        model.resize_token_embeddings(100, mean_resizing=False)
        assert not caplog.records
        model.resize_token_embeddings(80)
    (warning,) = [record.getMessage() for record in caplog.records]
    assert "resize_token_embeddings to 80" in warning and "`pad_token_id` (95)" in warning
    model.config.pad_token_id = 0
    model.save_pretrained(tmp_path)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.vocab_size == 80


def test_save_load_in_a_fresh_process(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 97, (1, 7))
    torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "expected.pt")
    # the same thread count as here: float sums are split by thread, so another count rounds differently
    code = f"""
import torch, archlab
from transformers import AutoModelForCausalLM
torch.set_num_threads({torch.get_num_threads()})
expected = torch.load({str(tmp_path / "expected.pt")!r})
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}).eval()
assert torch.equal(model(expected["ids"]).logits, expected["logits"]), "logits differ"
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
