"""The tools docs/ecosystem.md documents, on tiny archlab models, where they are installed (none is a dependency):
lm-evaluation-harness scores what the model itself computes (decoder and encoder-decoder, through the Python API
with archlab imported and through the `lm_eval` command with `trust_remote_code=True`), and `torch.onnx.export`
gives an ONNX graph that ONNX Runtime runs to the same logits with other batch and sequence sizes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import archlab

from helpers import assert_close_to_scale, tiny_decoder_config, tiny_seq2seq_config

SEQ2SEQ = dict(vocab_size=97, decoder_start_token_id=0)  # the tokenizer below has 94 tokens


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(90)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _folder(kind: str, root: Path) -> Path:
    torch.manual_seed(0)
    model = (
        archlab.DecoderForCausalLM(tiny_decoder_config())
        if kind == "decoder"
        else archlab.Seq2SeqForConditionalGeneration(tiny_seq2seq_config(**SEQ2SEQ))
    )
    model.save_pretrained(root / kind)
    _tokenizer().save_pretrained(root / kind)
    return root / kind


def _own_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) computed by the archlab model itself."""
    model.eval()
    ctx = tokenizer(context, return_tensors="pt").input_ids
    cont = tokenizer(continuation, return_tensors="pt").input_ids
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            logits = model(input_ids=ctx, labels=cont).logits[0]
        else:
            logits = model(torch.cat([ctx, cont], 1)).logits[0, ctx.shape[1] - 1 : -1]
    return logits.float().log_softmax(-1).gather(-1, cont[0, :, None]).sum().item()


@pytest.mark.parametrize("kind, backend", [("decoder", "causal"), ("seq2seq", "seq2seq")])
def test_lm_eval_loglikelihood_is_the_models_own(kind, backend, tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    folder = _folder(kind, tmp_path)
    lm = HFLM(pretrained=str(folder), backend=backend, device="cpu", batch_size=2)  # archlab imported: no remote code
    pairs = [("w1 w2 w3", " w4 w5"), ("w10 w11", " w40"), ("w7", " w8 w9 w10")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    scores = [logprob for logprob, _greedy in lm.loglikelihood(requests)]
    model = archlab.Seq2SeqForConditionalGeneration if kind == "seq2seq" else archlab.DecoderForCausalLM
    model = model.from_pretrained(folder)
    expected = [_own_logprob(model, _tokenizer(), *pair) for pair in pairs]
    assert scores == pytest.approx(expected, abs=1e-4)


TASK = """task: archlab_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind, extra", [("decoder", ""), ("seq2seq", ",backend=seq2seq")])
def test_lm_eval_command_with_trust_remote_code_on_a_local_task(kind, extra, tmp_path):
    """The docs' command: no archlab import in that process, the folder's own code runs; the data is local."""
    if shutil.which("lm_eval") is None:
        pytest.skip("lm-evaluation-harness is not installed")
    folder = _folder(kind, tmp_path)
    (tmp_path / "tasks").mkdir()
    rows = [{"question": f"w{i} w{i + 1}", "choices": [f"w{i + 2}", f"w{i + 30}"], "answer": 0} for i in range(4)]
    (tmp_path / "tasks" / "tiny.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "tasks" / "tiny.yaml").write_text(TASK.format(data=tmp_path / "tasks" / "tiny.jsonl"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "m")}
    done = subprocess.run(
        [
            "lm_eval",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={folder},trust_remote_code=True{extra}",
            "--tasks",
            "archlab_tiny",
            "--include_path",
            str(tmp_path / "tasks"),
            "--device",
            "cpu",
            "--batch_size",
            "4",
            "--output_path",
            str(tmp_path / "results"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())
    assert 0.0 <= results["results"]["archlab_tiny"]["acc,none"] <= 1.0


class _Logits(torch.nn.Module):
    """Tensors in, logits out: the graph ONNX gets (no cache, no output dataclass)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        extra = {} if decoder_input_ids is None else {"decoder_input_ids": decoder_input_ids}
        if not isinstance(self.model, archlab.EncoderForMaskedLM):
            extra["use_cache"] = False
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits


T5_BIAS = dict(
    position_embedding_type="relative_bias", relative_attention_num_buckets=8, relative_attention_max_distance=16
)
ONNX_MODELS = {
    "decoder": lambda: archlab.DecoderForCausalLM(tiny_decoder_config()),
    "seq2seq": lambda: archlab.Seq2SeqForConditionalGeneration(tiny_seq2seq_config(**SEQ2SEQ)),
    # beyond the dense recipe: the experts (no sort or grouped GEMM in ONNX: moe.py runs every expert), the T5 bias
    # (a trainable SDPA mask, detached under ONNX export), ALiBi with interleaved sliding and full layers
    "decoder_moe_shared_expert": lambda: archlab.DecoderForCausalLM(
        tiny_decoder_config(num_local_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32)
    ),
    "decoder_t5_bias": lambda: archlab.DecoderForCausalLM(tiny_decoder_config(**T5_BIAS)),
    "decoder_alibi_local_global": lambda: archlab.DecoderForCausalLM(
        tiny_decoder_config(
            position_embedding_type="alibi", sliding_window=4, layer_types=["sliding_attention", "full_attention"]
        )
    ),
    "seq2seq_t5_bias": lambda: archlab.Seq2SeqForConditionalGeneration(tiny_seq2seq_config(**SEQ2SEQ, **T5_BIAS)),
    "masked_lm_t5_bias": lambda: archlab.EncoderForMaskedLM(tiny_seq2seq_config(**SEQ2SEQ, **T5_BIAS)),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(ONNX_MODELS))
def test_onnx_export_runs_in_onnxruntime_with_the_same_logits(kind, tmp_path):
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = ONNX_MODELS[kind]().eval()
    seq2seq = kind.startswith("seq2seq")
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    names = ["input_ids", "attention_mask"] + (["decoder_input_ids"] if seq2seq else [])
    shapes = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
    if seq2seq:
        shapes["decoder_input_ids"] = {0: batch, 1: torch.export.Dim("target")}

    def inputs(rows: int, cols: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(3, 97, (rows, cols))
        mask = torch.ones_like(ids)
        mask[-1, : cols // 3] = 0  # a left-padded row
        return (ids, mask) + ((torch.randint(3, 97, (rows, cols - 2)),) if seq2seq else ())

    torch.onnx.export(  # with gradients enabled, as the documented call
        _Logits(model),
        inputs(2, 9),
        tmp_path / "model.onnx",
        dynamo=True,
        dynamic_shapes=shapes,
        input_names=names,
        output_names=["logits"],
    )
    session = ort.InferenceSession(str(tmp_path / "model.onnx"))
    for rows, cols in ((2, 9), (3, 13)):
        feed = inputs(rows, cols)
        with torch.no_grad():
            expected = _Logits(model)(*feed)
        got = torch.from_numpy(session.run(None, {n: t.numpy() for n, t in zip(names, feed)})[0])
        keep = slice(None) if seq2seq else feed[1].bool()  # padded positions' logits are meaningless
        assert_close_to_scale(got[keep], expected[keep])
