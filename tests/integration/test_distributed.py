"""Multi-process runs with 2 CPU processes on gloo: data parallel (Trainer under torchrun), FSDP2 and tensor / expert
parallelism through transformers' native `DistributedConfig` / `tp_plan="auto"`, and DeepSpeed ZeRO-3.

The tests share one launch of `tests/distributed_worker.py` (a batch of its sub-commands; each launch costs ~20 s of
imports on 2 cores) and compare what the 2 processes computed with one process doing the same work (same weights,
same global batch); hence `slow`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import pytest
import torch

from archlab import DecoderForCausalLM, EncoderForMaskedLM, Seq2SeqForConditionalGeneration

from distributed_launch import launch_batch, torchrun
from distributed_worker import run_trainer
from helpers import REPO, randomised, tiny_decoder_config, tiny_seq2seq_config

# one test worker (pytest-xdist) runs the module: its tests share the one launch (`launched`) and the models it loads
pytestmark = pytest.mark.xdist_group("distributed")

# untied by default; `seq2seq_tied` below covers the tied head
SEQ2SEQ = dict(decoder_start_token_id=0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def seq2seq_dirs(tmp_path_factory) -> list[str]:
    dirs = []
    variants = (
        ("seq2seq_plain", {}),
        ("seq2seq_gated", {"mlp_type": "gated", "activation_function": "silu"}),
        # tied head: the weights are tied before FSDP2 shards them (Seq2SeqPreTrainedModel.maybe_distribute_model)
        ("seq2seq_tied", {"tie_word_embeddings": True}),
    )
    for name, extra in variants:
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(name)
        Seq2SeqForConditionalGeneration(tiny_seq2seq_config(**{**SEQ2SEQ, **extra})).save_pretrained(path)
        dirs.append(str(path))
    return dirs


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("moe")
    DecoderForCausalLM(tiny_decoder_config(num_local_experts=4, num_experts_per_tok=2)).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("decoder")
    DecoderForCausalLM(tiny_decoder_config()).save_pretrained(path)
    return str(path)


def test_shipped_launcher_configs_parse():
    from accelerate.commands.config.config_args import load_config_from_file
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    # multi_cpu.yaml uses accelerate's torchrun launcher (type MULTI_GPU); the processes then run on CPU (gloo)
    expected = {"multi_cpu": "MULTI_GPU", "multi_gpu": "MULTI_GPU", "fsdp2": "FSDP", "deepspeed_zero3": "DEEPSPEED"}
    for name, kind in expected.items():
        config = load_config_from_file(str(REPO / "configs" / "accelerate" / f"{name}.yaml"))
        assert str(config.distributed_type).endswith(kind)
    assert load_config_from_file(str(REPO / "configs" / "accelerate" / "fsdp2.yaml")).fsdp_config["fsdp_version"] == 2
    deepspeed_file = load_config_from_file(str(REPO / "configs" / "accelerate" / "deepspeed_zero3.yaml"))
    assert (REPO / deepspeed_file.deepspeed_config["deepspeed_config_file"]).is_file()
    for stage in (2, 3):
        config = HfTrainerDeepSpeedConfig(str(REPO / "configs" / "deepspeed" / f"zero{stage}.json"))
        assert config.get_value("zero_optimization.stage") == stage


@pytest.mark.parametrize("norm_position", ["pre", "post", "sandwich", "parallel", "deepnorm", "output"])
def test_fsdp_plans_and_accelerate_wrap_policy(norm_position):
    """What FSDP2 engines read from the model: transformers' plan keeps the LM head whole (Llama's rule), and
    accelerate's TRANSFORMER_BASED_WRAP finds every class in `_no_split_modules` (it raises on an absent one)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers.distributed.fsdp import _resolve_tied_embed_lm_head_plan

    model = DecoderForCausalLM(tiny_decoder_config(norm_position=norm_position))
    assert model._fsdp_plan["lm_head"] == "keep_full_weight"
    assert model._fsdp_plan["model.layers.*"] == "free_full_weight"
    seq2seq = tiny_seq2seq_config(**SEQ2SEQ)
    for module in (model, EncoderForMaskedLM(seq2seq), Seq2SeqForConditionalGeneration(seq2seq)):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
        plugin.set_auto_wrap_policy(module)
        present = {type(m).__name__ for m in module.modules()}
        assert plugin.transformer_cls_names_to_wrap and set(plugin.transformer_cls_names_to_wrap) <= present
    assert model._no_split_modules == {type(model.model.layers[0]).__name__}
    tied = DecoderForCausalLM(tiny_decoder_config(norm_position=norm_position, tie_word_embeddings=True))
    plan = _resolve_tied_embed_lm_head_plan(tied._fsdp_plan, tied)  # the shared weight is wrapped once, kept whole
    assert plan["model.embed_tokens"] == "keep_full_weight" and "lm_head" not in plan


def test_qk_norm_over_the_projection_gathers_q_k_v_under_tensor_parallelism():
    """Llama's plan splits q/k/v by heads; a QK-norm over the whole projection needs every head of a token, so its
    plan is OLMo 2's: q/k/v gathered after the split product, the output projection's input split again."""
    from transformers import LlamaConfig, Olmo2Config

    assert tiny_decoder_config().base_model_tp_plan == LlamaConfig.base_model_tp_plan
    assert tiny_decoder_config(use_qk_norm=True).base_model_tp_plan == LlamaConfig.base_model_tp_plan
    projection = tiny_decoder_config(use_qk_norm=True, qk_norm_scope="projection")
    assert projection.base_model_tp_plan == Olmo2Config.base_model_tp_plan
    per_head = tiny_decoder_config(use_qk_norm=True, qk_norm_scope="per_head")  # (heads, head_dim) gains held whole
    assert per_head.base_model_tp_plan == Olmo2Config.base_model_tp_plan
    assert "base_model_tp_plan" not in projection.to_dict()
    sub_ln = tiny_decoder_config(sub_layer_norm=True).base_model_tp_plan  # Sub-LN: q/k/v and gate/up gathered too
    olmo2_attention = {k: v for k, v in Olmo2Config.base_model_tp_plan.items() if ".self_attn." in k}
    assert {k: v for k, v in sub_ln.items() if ".self_attn." in k} == olmo2_attention
    assert sub_ln["layers.*.mlp.up_proj"] == "colwise_gather_output"
    assert sub_ln["layers.*.mlp.down_proj"] == "rowwise_split_input"


def test_accelerate_groups_the_final_norm_with_the_head():
    """accelerate's FSDP2 preparation puts "the final norm" (the base model's last `*Norm` child) in one unit with
    the LM head; BLOOM's embedding LayerNorm must not be taken for it."""
    from accelerate.utils.fsdp_utils import _find_final_norm

    model = DecoderForCausalLM(tiny_decoder_config(embedding_layernorm=True, norm_type="layer_norm"))
    assert _find_final_norm(model) is model.model.norm


@pytest.mark.slow
def test_accelerate_fsdp2_preparation_matches_one_process(launched):
    """accelerate's own FSDP2 preparation (GPU-only through `Accelerator.prepare`, run directly on gloo here): one
    group per block, the LM head kept whole with the final norm (or alone in post-norm models, whose head then runs
    unchunked so FSDP2 gathers it), and training steps equal to one process."""
    pre, post = launched["accelerate_fsdp2"]["pre"], launched["accelerate_fsdp2"]["post"]
    assert pre["wrapped_classes"] == ["PreNormBlock"] and post["wrapped_classes"] == ["PostNormBlock"]
    assert {"model.layers.0", "model.layers.1", "lm_head"} <= set(pre["groups"])
    assert pre["head_group"] == ["model.norm", "lm_head"] and post["head_group"] == ["lm_head"]
    for entry in (pre, post):
        assert entry["reference_losses"][-1] < entry["reference_losses"][0]
        torch.testing.assert_close(entry["losses"], entry["reference_losses"], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_trainer_data_parallel_matches_one_process(tmp_path, decoder_dir, launched):
    """torchrun, 2 processes × 2 rows vs. 1 process × 4 rows: the same loss at every step (ragged rows, so the token
    count must be summed across processes)."""
    two = launched["trainer"]
    assert two["world_size"] == 2 and two["distributed_type"] == "DistributedType.MULTI_CPU"
    one = run_trainer(
        argparse.Namespace(
            models=[decoder_dir],
            output_dir=str(tmp_path / "one"),
            global_batch=4,
            steps=4,
            weights_dir=None,
            archlab_trainer=False,
            evaluate_first=False,
        )
    )
    assert len(one["losses"]) == len(two["losses"]) == 4
    assert one["losses"][-1] < one["losses"][0]  # it trained
    torch.testing.assert_close(two["losses"], one["losses"], rtol=1e-4, atol=1e-5)


TP_ONLY_OLMO2 = "tp_only_olmo2"  # a folder checked with tensor parallelism only
TP_ONLY_PER_HEAD = "tp_only_per_head_qk_norm"  # and another: QK-norm gains per head (Command R+)
TP_ONLY_SUB_LN = "tp_only_sub_layer_norm"  # and Sub-LN (BitNet): norms over all heads and the MLP's whole width
TP_ONLY = (TP_ONLY_OLMO2, TP_ONLY_PER_HEAD, TP_ONLY_SUB_LN)
# Heads tied to their input embeddings, checked with tensor parallelism only (see the test below).
TIED_HEADS = {
    "decoder": lambda: DecoderForCausalLM(tiny_decoder_config(tie_word_embeddings=True)),
    "seq2seq_shared": lambda: Seq2SeqForConditionalGeneration(
        tiny_seq2seq_config(**{**SEQ2SEQ, "tie_word_embeddings": True})
    ),
    "seq2seq_separate": lambda: Seq2SeqForConditionalGeneration(
        tiny_seq2seq_config(
            **{**SEQ2SEQ, "tie_word_embeddings": True},
            share_encoder_decoder_embeddings=False,
            decoder_vocab_size=53,
        )
    ),
    "masked_lm": lambda: EncoderForMaskedLM(tiny_seq2seq_config(**{**SEQ2SEQ, "tie_word_embeddings": True})),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, decoder_dir, seq2seq_dirs, moe_dir) -> dict:
    """ONE torchrun launch (each costs ~20 s of imports on 2 cores) for every multi-process test of this file:
    `sharded` (the models of the TP / EP / FSDP2 test, then the tied-head models with TP only), `trainer`,
    `accelerate_fsdp2` (a pre-norm and a post-norm decoder) and, last (its ZeRO-3 config is global), `deepspeed`."""
    folder = tmp_path_factory.mktemp("launched")
    for name, build in TIED_HEADS.items():
        torch.manual_seed(0)
        build().save_pretrained(folder / f"tied_{name}")
    tied = [str(folder / f"tied_{name}") for name in TIED_HEADS]
    torch.manual_seed(0)  # OLMo 2's blocks: QK-norm over the projections, under OLMo 2's tensor-parallel plan
    olmo2 = tiny_decoder_config(norm_position="output", use_qk_norm=True, qk_norm_scope="projection")
    randomised(DecoderForCausalLM(olmo2)).save_pretrained(folder / TP_ONLY_OLMO2)
    torch.manual_seed(0)
    per_head = tiny_decoder_config(norm_position="parallel_shared_norm", use_qk_norm=True, qk_norm_scope="per_head")
    randomised(DecoderForCausalLM(per_head)).save_pretrained(folder / TP_ONLY_PER_HEAD)
    torch.manual_seed(0)
    sub_ln = tiny_decoder_config(sub_layer_norm=True, hidden_act="relu2")
    randomised(DecoderForCausalLM(sub_ln)).save_pretrained(folder / TP_ONLY_SUB_LN)
    norm_positions = []
    for position in ("pre", "post"):
        torch.manual_seed(0)
        DecoderForCausalLM(tiny_decoder_config(norm_position=position)).save_pretrained(folder / position)
        norm_positions.append(str(folder / position))
    jobs = {
        "sharded": [
            "sharded",
            decoder_dir,
            *seq2seq_dirs,
            moe_dir,
            "--tp_only",
            *tied,
            *(str(folder / name) for name in TP_ONLY),
        ],
        "trainer": ["trainer", decoder_dir, "--output_dir", str(folder / "trainer")],
        "accelerate_fsdp2": ["accelerate_fsdp2", *norm_positions],
    }
    if importlib.util.find_spec("deepspeed") is not None:
        zero3 = REPO / "configs" / "deepspeed" / "zero3.json"
        jobs["deepspeed"] = ["deepspeed", decoder_dir, "--deepspeed", str(zero3)]
    return launch_batch(folder, torchrun(), jobs, env={"DS_ACCELERATOR": "cpu"})[0]


@pytest.mark.slow
def test_tensor_parallel_and_fsdp2_match_one_process(launched, moe_dir):
    """Decoder, encoder-decoder (shared vocabulary; gated (packed) fc1; tied head), MoE decoder: TP logits and FSDP2
    training steps; for the MoE decoder also expert parallelism (each rank owns 2 of the 4 experts)."""
    result = {
        name: entry
        for name, entry in launched["sharded"].items()
        if not name.startswith("tied_") and name not in TP_ONLY
    }
    assert len(result) == 5
    moe = result[os.path.basename(moe_dir)]
    assert moe["ep_local_experts"] == 2
    assert moe["ep_logits"] <= 1e-4
    for name, entry in result.items():
        assert entry["tp_sharded"], f"{name}: tp_plan='auto' sharded no weight"
        assert entry["tp_logits"] <= 1e-4, name
        assert entry.get("tp_generate_equal", True), name
        assert entry["reference_losses"][-1] < entry["reference_losses"][0], name
        torch.testing.assert_close(entry["fsdp_losses"], entry["reference_losses"], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_tensor_parallel_with_tied_heads_matches_one_process(launched):
    """`tp_plan="auto"` on heads tied to their input embeddings: the decoder, the encoder-decoder with a shared and
    with a separate target vocabulary, and the masked LM. A tied head is the embedding's parameter, split by
    vocabulary rows for both modules (the head's own `colwise_gather_output` entry); without that entry the head's
    `F.linear` meets a sharded weight and the forward fails. Logits and greedy generation equal one process."""
    result = {
        name.removeprefix("tied_"): entry for name, entry in launched["sharded"].items() if name.startswith("tied_")
    }
    assert set(result) == set(TIED_HEADS)
    for name, entry in result.items():
        assert "fsdp_losses" not in entry, name  # tensor parallelism only
        assert entry["tp_sharded"] and entry["tp_tied_head"], name
        assert entry["tp_logits"] <= 1e-4, name
        assert entry.get("tp_generate_equal", name == "masked_lm"), name


@pytest.mark.slow
def test_tensor_parallel_with_qk_norm_over_the_projection_matches_one_process(launched):
    """OLMo 2's blocks under `tp_plan="auto"` (its plan: q/k/v gathered for the QK-norm over all heads, the output
    projection's input split): logits and greedy generation equal one process. So with QK-norm gains per head
    (Command R+), which need every head of a token alike, and Sub-LN (norms over all heads and the MLP's width)."""
    for name in TP_ONLY:
        entry = launched["sharded"][name]
        assert entry["tp_sharded"], name
        assert entry["tp_logits"] <= 1e-4, name
        assert entry["tp_generate_equal"], name


@pytest.mark.slow
def test_deepspeed_zero3_matches_one_process(launched):
    pytest.importorskip("deepspeed")
    result = launched["deepspeed"]
    assert result["stage"] == 3
    assert "lm_head.weight" in result["partitioned"]  # ZeRO-3 really partitioned the weights
    torch.testing.assert_close(result["losses"], result["reference_losses"], rtol=1e-4, atol=1e-5)
