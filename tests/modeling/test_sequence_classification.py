"""DecoderForSequenceClassification: last-non-pad pooling (left and right padding) and the auxiliary LM loss (also
with the embedding offloaded by a `device_map`)."""

import torch
from transformers import AutoModelForSequenceClassification

from archlab import DecoderForSequenceClassification

from helpers import tiny_decoder_config


def _model(**kw):
    return DecoderForSequenceClassification(tiny_decoder_config(num_labels=3, **kw)).eval()


def test_pools_last_real_token_with_left_and_right_padding():
    model = _model()
    seq = torch.randint(3, 97, (5,))
    alone = model(seq[None]).logits
    right = torch.cat([seq, torch.zeros(3, dtype=torch.long)])[None]
    right_mask = torch.tensor([[1] * 5 + [0] * 3])
    left = torch.cat([torch.zeros(3, dtype=torch.long), seq])[None]
    left_mask = torch.tensor([[0] * 3 + [1] * 5])
    torch.testing.assert_close(model(right, attention_mask=right_mask).logits, alone, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(model(left, attention_mask=left_mask).logits, alone, atol=1e-5, rtol=1e-4)
    # without a mask, pad_token_id finds the end of right-padded rows
    torch.testing.assert_close(model(right).logits, alone, atol=1e-5, rtol=1e-4)


def test_loss_and_auxiliary_lm_loss():
    ids = torch.randint(3, 97, (4, 6))
    labels = torch.tensor([0, 1, 2, 1])
    plain = _model()
    with_aux = _model(classifier_lm_loss_weight=0.5)
    with_aux.load_state_dict(plain.state_dict())
    l_ft = plain(ids, labels=labels).loss
    total = with_aux(ids, labels=labels).loss
    assert total > l_ft
    lm_logits = with_aux.model(ids).last_hidden_state @ with_aux.model.embed_tokens.weight.t()
    l_pt = torch.nn.functional.cross_entropy(lm_logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(total, l_ft + 0.5 * l_pt)


def test_the_auxiliary_lm_loss_reads_an_offloaded_embedding_through_its_hook(tmp_path):
    """`device_map` with the embedding offloaded leaves its weight on the meta device outside its forward: the
    auxiliary loss read it directly and came out ~1e25 where the model in memory gave 3.8."""
    model = _model(classifier_lm_loss_weight=0.5)
    model.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "disk", "model.layers": "cpu", "model.norm": "cpu", "score": "cpu"}
    offloaded = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload"
    ).eval()
    assert offloaded.model.embed_tokens.weight.is_meta
    ids, labels = torch.randint(3, 97, (4, 6)), torch.tensor([0, 1, 2, 1])
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids, labels=labels).loss, model(ids, labels=labels).loss)


def test_auto_class_and_save_load(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 97, (2, 6))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
