"""DecoderForSequenceClassification: last-non-pad pooling (left and right padding), the auxiliary LM loss (also
with the embedding offloaded by a `device_map`), a mixture of experts' router losses and the KV cache only when
asked for."""

import torch
from transformers import AutoModelForSequenceClassification

from archlab import DecoderForSequenceClassification
from archlab.modeling.cache_names import output_cache, with_cache
from archlab.modeling.moe import load_balancing_loss, router_z_loss

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


def test_returns_a_cache_only_when_asked_for():
    """A plain call returned a `DynamicCache` (config.use_cache, as `LlamaForSequenceClassification` does), so
    `torch.export` of the classifier failed (`Found <class 'DynamicCache'> in output`) unless given
    `use_cache=False`. Now a cache is built only under `use_cache=True` or when one is passed in, and continuing it
    gives the logits of the whole sequence."""
    model = _model()
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        assert output_cache(model(ids)) is None
        assert output_cache(model(ids, use_cache=False)) is None
        cache = output_cache(model(ids[:, :5], use_cache=True))
        assert cache.get_seq_length() == 5
        continued = model(ids[:, 5:], **with_cache(cache))
        assert output_cache(continued).get_seq_length() == 7
        torch.testing.assert_close(continued.logits, model(ids).logits, atol=1e-5, rtol=1e-4)


def test_a_mask_over_the_cached_positions_too_pools_this_calls_last_real_token():
    """A mask that also covers the positions before the call (a cache given; PEFT's prefix tuning, whose virtual
    tokens it prepends) failed in the pooling (`The size of tensor a (2) must match the size of tensor b (7)`) and in
    the auxiliary LM targets, where Llama's head, which reads the ids, pools. Now the mask's last columns are the
    call's, as for the router losses."""
    model = _model(classifier_lm_loss_weight=0.5)
    ids, labels = torch.randint(3, 97, (2, 7)), torch.tensor([0, 2])
    mask = torch.ones_like(ids)
    mask[1, 6] = 0  # right padding inside the continued part
    with torch.no_grad():
        cache = output_cache(model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True))
        continued = model(ids[:, 5:], attention_mask=mask, labels=labels, **with_cache(cache))
        torch.testing.assert_close(continued.logits, model(ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-4)
    assert torch.isfinite(continued.loss)


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


def test_a_moe_classifier_adds_the_router_losses_as_the_causal_lm():
    """Its loss had no router term whatever the config, so fine-tuning an MoE classifier left the routers free to
    collapse onto a few experts (Mixtral's classifier adds none either, even under `output_router_logits`). Now the
    load-balancing loss is added under `output_router_logits` (config or argument) and the z-loss whenever
    `router_z_loss_coef` > 0, as `DecoderForCausalLM` adds them; by default the loss is the cross-entropy alone."""
    moe = dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5)
    plain = _model(**moe)
    balanced, z = _model(**moe, output_router_logits=True), _model(**moe, router_z_loss_coef=0.1)
    balanced.load_state_dict(plain.state_dict()), z.load_state_dict(plain.state_dict())
    ids, labels = torch.randint(3, 97, (3, 6)), torch.tensor([0, 1, 2])
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        task = plain(ids, attention_mask=mask, labels=labels).loss
        logits = plain(ids, attention_mask=mask).logits
        torch.testing.assert_close(task, torch.nn.functional.cross_entropy(logits, labels))
        router_logits = plain.model(ids, attention_mask=mask, output_router_logits=True).router_logits
        aux, z_loss = load_balancing_loss(router_logits, 4, 2, mask), router_z_loss(router_logits, mask)
        torch.testing.assert_close(balanced(ids, attention_mask=mask, labels=labels).loss, task + 0.5 * aux)
        torch.testing.assert_close(z(ids, attention_mask=mask, labels=labels).loss, task + 0.1 * z_loss)
        asked = plain(ids, attention_mask=mask, labels=labels, output_router_logits=True).loss
    torch.testing.assert_close(asked, task + 0.5 * aux)
