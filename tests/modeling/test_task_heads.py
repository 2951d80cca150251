"""DecoderForTokenClassification and DecoderForQuestionAnswering: parity with Llama's and Mixtral's classes (strict
load, logits, losses with padding and out-of-range answer positions), labels of the wrong shape or class named
before the forward (where Llama's fail after it or read them in the wrong order), the loss under the Trainer's
`num_items_in_batch`, the MoE router losses of every classification head, and a causal LM's folder opened as each."""

import pytest
import torch
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForTokenClassification,
    LlamaConfig,
    LlamaForQuestionAnswering,
    LlamaForTokenClassification,
    MixtralConfig,
    MixtralForQuestionAnswering,
    MixtralForTokenClassification,
    pipeline,
)

from archlab import (
    DecoderForCausalLM,
    DecoderForQuestionAnswering,
    DecoderForTokenClassification,
)
from archlab.modeling.moe import load_balancing_loss, router_z_loss

from helpers import TINY, character_tokenizer, forbid, tiny_decoder_config

MIXTRAL = dict(
    num_local_experts=4,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
REFERENCES = {
    "llama": (LlamaConfig, {}, LlamaForTokenClassification, LlamaForQuestionAnswering),
    "mixtral": (MixtralConfig, MIXTRAL, MixtralForTokenClassification, MixtralForQuestionAnswering),
}


def _batch():
    ids = torch.randint(3, TINY["vocab_size"], (3, 11))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    return ids.masked_fill(mask == 0, TINY["pad_token_id"]), mask


def _pair(family: str, head: str, **overrides):
    config_class, fields, token_class, qa_class = REFERENCES[family]
    kw = {**TINY, **fields, **overrides}
    reference = (token_class if head == "tokens" else qa_class)(config_class(**kw)).eval()
    model = (DecoderForTokenClassification if head == "tokens" else DecoderForQuestionAnswering)(
        tiny_decoder_config(**fields, **overrides)
    ).eval()
    # Llama's QA class keeps its body under `transformer.` (Mixtral's under `model.`, as every archlab head)
    prefix = reference.base_model_prefix + "."
    renamed = {k: "model." + k.removeprefix(prefix) if k.startswith(prefix) else k for k in reference.state_dict()}
    state_dict = {renamed[k]: v for k, v in reference.state_dict().items()}
    model.load_state_dict(state_dict, strict=True)
    return model, reference


@pytest.mark.parametrize("family", list(REFERENCES))
def test_token_classifier_matches_the_stock_one(family):
    """Logits within 1e-4 on a padded batch and the same loss with -100 on the padding, as Llama's / Mixtral's
    token classifier (same weights, strict load: `score` with its bias); the dropout is theirs (0.1 by default)."""
    model, reference = _pair(family, "tokens", num_labels=5)
    assert model.dropout.p == reference.dropout.p == 0.1
    ids, mask = _batch()
    labels = torch.randint(0, 5, ids.shape).masked_fill(mask == 0, -100)
    with torch.no_grad():
        ours = model(ids, attention_mask=mask, labels=labels)
        theirs = reference(ids, attention_mask=mask, labels=labels)
    assert (ours.logits - theirs.logits)[mask.bool()].abs().max() <= 1e-4
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", list(REFERENCES))
def test_qa_model_matches_the_stock_one_with_positions_out_of_range(family):
    """Start and end logits within 1e-4 and the same loss as Llama's / Mixtral's QA class, with answer positions past
    the sequence (left out of the loss) and inside it."""
    model, reference = _pair(family, "qa")
    ids, mask = _batch()
    starts, ends = torch.tensor([2, 5, 40]), torch.tensor([3, 60, 7])
    with torch.no_grad():
        ours = model(ids, attention_mask=mask, start_positions=starts, end_positions=ends)
        theirs = reference(ids, attention_mask=mask, start_positions=starts, end_positions=ends)
    for side in ("start_logits", "end_logits"):
        assert (getattr(ours, side) - getattr(theirs, side))[mask.bool()].abs().max() <= 1e-4, side
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=0)


BAD_TOKEN_LABELS = {  # labels of the (3, 11) batch -> the error
    "a label per row": (
        lambda: torch.randint(0, 5, (3,)),
        r"`labels` has shape \(3,\); it must be the input's \(3, 11\)",
    ),
    "a token too many": (lambda: torch.randint(0, 5, (3, 12)), r"`labels` has shape \(3, 12\); it must be"),
    "tokens x rows": (lambda: torch.randint(0, 5, (11, 3)), r"`labels` has shape \(11, 3\); it must be"),
    "a class past the head": (lambda: torch.full((3, 11), 5), r"`labels` holds 5, .* `num_labels` is 5"),
    "negative, not -100": (lambda: torch.full((3, 11), -1), r"`labels` holds -1, .* or -100 where a token has none"),
    "floats": (lambda: torch.zeros(3, 11), r"`labels` holds torch.float32 values; they must be class ids"),
}


@pytest.mark.parametrize("case", list(BAD_TOKEN_LABELS))
def test_token_labels_that_do_not_fit_are_named_before_the_forward(case, monkeypatch):
    """Llama's head ran the whole forward and then failed with "Expected input batch_size (33) to match target
    batch_size (3)", "Target 5 is out of bounds" (a device-side assert on a GPU) or a dtype error, naming no argument,
    and read (tokens, rows) labels as (rows, tokens) without a word; the decoder's names `labels`, its shape and the
    expected one, or the class and `num_labels`, before its body runs."""
    labels, message = BAD_TOKEN_LABELS[case]
    model = DecoderForTokenClassification(tiny_decoder_config(num_labels=5)).eval()
    forbid(monkeypatch, model.model, "forward", "the labels are checked before the body runs")
    ids, mask = _batch()
    with pytest.raises(ValueError, match=message):
        model(ids, attention_mask=mask, labels=labels())
    with pytest.raises(ValueError, match=message):  # (the input as embeddings)
        model(inputs_embeds=torch.zeros(3, 11, 32), labels=labels())


@pytest.mark.parametrize("layout", ["flat", "trailing 1"])
def test_token_labels_in_a_layout_the_stock_head_reads_give_its_loss(layout):
    """The same labels flattened, or with a trailing 1, are read by Llama's head (its loss flattens both sides) and
    are accepted, with its loss."""
    model, reference = _pair("llama", "tokens", num_labels=5)
    ids, mask = _batch()
    labels = torch.randint(0, 5, ids.shape).masked_fill(mask == 0, -100)
    given = labels.flatten() if layout == "flat" else labels[..., None]
    with torch.no_grad():
        theirs = reference(ids, attention_mask=mask, labels=labels).loss
        torch.testing.assert_close(reference(ids, attention_mask=mask, labels=given).loss, theirs)
        torch.testing.assert_close(model(ids, attention_mask=mask, labels=given).loss, theirs, rtol=1e-5, atol=0)


BAD_POSITIONS = {  # (start, end positions) of the 3-row batch -> the error
    "two per row": (
        (torch.ones(3, 2, dtype=torch.long),) * 2,
        r"`start_positions` has shape \(3, 2\); it must be \(3,\)",
    ),
    "a row too many": (
        (torch.ones(3, dtype=torch.long), torch.ones(4, dtype=torch.long)),
        r"`end_positions` has shape \(4,\)",
    ),
    "one for the batch": ((torch.tensor(1), torch.tensor(2)), r"`start_positions` has shape \(\); it must be \(3,\)"),
    "floats": ((torch.ones(3), torch.ones(3)), r"`start_positions` holds torch.float32 values; they must be"),
    "a start alone": ((torch.ones(3, dtype=torch.long), None), r"`start_positions` is given without `end_positions`"),
}


@pytest.mark.parametrize("case", list(BAD_POSITIONS))
def test_answer_positions_that_do_not_fit_are_named_before_the_forward(case, monkeypatch):
    """Llama's QA class failed after the forward ("0D or 1D target tensor expected, multi-target not supported",
    "Expected input batch_size (3) to match target batch_size (4)"), or returned no loss given a start without an
    end; the decoder's names the argument, its shape and the expected one before its body runs."""
    (starts, ends), message = BAD_POSITIONS[case]
    model = DecoderForQuestionAnswering(tiny_decoder_config()).eval()
    forbid(monkeypatch, model.model, "forward", "the positions are checked before the body runs")
    ids, mask = _batch()
    with pytest.raises(ValueError, match=message):
        model(ids, attention_mask=mask, start_positions=starts, end_positions=ends)


def test_answer_positions_past_the_sequence_or_negative_are_read_as_the_stock_head_reads_them():
    """Accepted as Llama's QA class accepts them, with its loss: positions past the sequence left out, negative ones
    (-1, -100) clamped to 0, the "no answer" index; positions of shape (batch, 1) squeezed."""
    model, reference = _pair("llama", "qa")
    ids, mask = _batch()
    for starts, ends in (([40, -1, 2], [60, 5, -100]), ([11, 0, -7], [3, 11, 4])):
        starts, ends = torch.tensor(starts), torch.tensor(ends)
        for shape in ((3,), (3, 1)):
            given = dict(start_positions=starts.reshape(shape), end_positions=ends.reshape(shape))
            with torch.no_grad():
                ours, theirs = (
                    model(ids, attention_mask=mask, **given).loss,
                    reference(ids, attention_mask=mask, **given).loss,
                )
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
    with torch.no_grad():  # (-1 is 0: the same loss)
        zero = dict(start_positions=torch.tensor([0, 0, 0]), end_positions=torch.tensor([0, 0, 0]))
        minus = dict(start_positions=torch.tensor([-1, -100, 0]), end_positions=torch.tensor([0, -3, -1]))
        torch.testing.assert_close(
            model(ids, attention_mask=mask, **minus).loss, model(ids, attention_mask=mask, **zero).loss
        )


def test_token_loss_under_num_items_in_batch_is_the_whole_batch_mean():
    """Two micro-batches given the Trainer's `num_items_in_batch` (the labels of both) add up to the one big batch's
    loss; each keeping its own mean (Llama's head, which the Trainer then does not divide by the accumulation steps)
    gave 2x it here."""
    model = DecoderForTokenClassification(tiny_decoder_config(num_labels=5, classifier_dropout=0.0)).eval()
    ids, mask = _batch()
    labels = torch.randint(0, 5, ids.shape).masked_fill(mask == 0, -100)
    whole = model(ids, attention_mask=mask, labels=labels).loss
    count = labels.ne(-100).sum()
    rows = (slice(0, 1), slice(1, 3))
    parts = [model(ids[s], attention_mask=mask[s], labels=labels[s], num_items_in_batch=count).loss for s in rows]
    torch.testing.assert_close(sum(parts), whole)


MOE = dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5)
HEAD_CLASSES = {
    "tokens": DecoderForTokenClassification,
    "qa": DecoderForQuestionAnswering,
}


def _targets(head: str, ids: torch.Tensor) -> dict:
    if head == "tokens":
        return dict(labels=torch.randint(0, 3, ids.shape))
    return dict(start_positions=torch.tensor([1, 2, 3]), end_positions=torch.tensor([4, 5, 6]))


@pytest.mark.parametrize("head", list(HEAD_CLASSES))
def test_moe_router_losses_are_added_as_the_causal_lm_adds_them(head):
    """Stock Mixtral heads add no router loss, even under `output_router_logits` (the test below); archlab's add the
    load-balancing loss only under it, as Mixtral's causal LM, and the z-loss whenever `router_z_loss_coef` > 0.
    Without either the loss is the plain task loss (Mixtral's). The sequence classifier's: its own test file."""
    cls = HEAD_CLASSES[head]
    plain = cls(tiny_decoder_config(**MOE, num_labels=3, classifier_dropout=0.0)).eval()
    ids, mask = _batch()
    targets = _targets(head, ids)
    balanced = cls(tiny_decoder_config(**MOE, num_labels=3, classifier_dropout=0.0, output_router_logits=True)).eval()
    z = cls(tiny_decoder_config(**MOE, num_labels=3, classifier_dropout=0.0, router_z_loss_coef=0.1)).eval()
    balanced.load_state_dict(plain.state_dict()), z.load_state_dict(plain.state_dict())
    with torch.no_grad():
        task = plain(ids, attention_mask=mask, **targets).loss
        router_logits = plain.model(ids, attention_mask=mask, output_router_logits=True).router_logits
        aux = load_balancing_loss(router_logits, 4, 2, mask)
        torch.testing.assert_close(balanced(ids, attention_mask=mask, **targets).loss, task + 0.5 * aux)
        z_loss = router_z_loss(router_logits, mask)
        torch.testing.assert_close(z(ids, attention_mask=mask, **targets).loss, task + 0.1 * z_loss)
        # per call, as the causal LM's argument
        asked = plain(ids, attention_mask=mask, output_router_logits=True, **targets).loss
    torch.testing.assert_close(asked, task + 0.5 * aux)


@pytest.mark.parametrize("auto_class", [AutoModelForTokenClassification, AutoModelForQuestionAnswering])
def test_a_causal_lm_folder_opens_as_the_head_with_its_body(auto_class, tmp_path):
    """Only the new head is missing (Llama's QA class, its body under `transformer.`, loads a Llama causal LM's
    folder with the whole body at random)."""
    causal = DecoderForCausalLM(tiny_decoder_config()).eval()
    causal.save_pretrained(tmp_path)
    model, info = auto_class.from_pretrained(tmp_path, output_loading_info=True)
    head = "score" if auto_class is AutoModelForTokenClassification else "qa_outputs"
    assert info["missing_keys"] == {f"{head}.weight", f"{head}.bias"}
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        assert torch.equal(model.eval().model(ids).last_hidden_state, causal.model(ids).last_hidden_state)


def test_token_classification_pipeline_runs(tmp_path):
    """transformers 5 has no question-answering pipeline; the token-classification one takes the folder."""
    model = DecoderForTokenClassification(tiny_decoder_config(vocab_size=40, num_labels=2))
    model.config.id2label, model.config.label2id = {0: "O", 1: "X"}, {"O": 0, "X": 1}
    model.save_pretrained(tmp_path), character_tokenizer().save_pretrained(tmp_path)
    tags = pipeline("token-classification", model=str(tmp_path), ignore_labels=[])("ab 12")
    assert [tag["index"] for tag in tags] == [0, 1, 2, 3, 4] and {tag["entity"] for tag in tags} <= {"O", "X"}


def test_stock_mixtral_classifiers_add_no_router_loss():
    """The evidence for the rule above: under `output_router_logits=True` Mixtral's token classifier's loss is the
    plain cross-entropy (its load-balancing loss is computed by its causal LM alone)."""
    reference = MixtralForTokenClassification(
        MixtralConfig(**TINY, **MIXTRAL, num_labels=3, output_router_logits=True, router_aux_loss_coef=0.5)
    ).eval()
    ids, mask = _batch()
    labels = torch.randint(0, 3, ids.shape)
    with torch.no_grad():
        output = reference(ids, attention_mask=mask, labels=labels)
    plain = torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), labels.flatten())
    torch.testing.assert_close(output.loss, plain)
