"""The program tests/integration/test_distributed*.py launch on 2 CPU processes (gloo) under `torchrun` or
`accelerate launch`.

Sub-commands (rank 0 writes a JSON result to `--out`):

- `trainer MODEL_DIR`: a minimal `Trainer` run on a fixed toy data set with `--global_batch` rows per optimizer step
  split over the processes; records the loss of every step. Run as a plain process it is the 1-process reference.
  Under `accelerate launch --config_file` the launcher's config applies. `--archlab_trainer` uses the scripts'
  Trainer instead of the stock one, `--evaluate_first` calls `evaluate()` before `train()`.
- `script NAME --weights_dir DIR -- ARGS...`: runs `archlab.scripts.NAME.main(ARGS)` (pretrain or finetune).
Every training command saves each rank's final weights to `--weights_dir` (`rank-R.safetensors`) when given, so a
test can check that the processes trained one model and that it equals the 1-process model.
- `sharded MODEL_DIR ... [--tp_only MODEL_DIR ...]`: loads each model twice in every rank, plain and sharded with
  transformers' native parallelism (`tp_plan="auto"` for tensor parallelism, `DistributedConfig(ep_size=2)` for an
  expert-parallel plan, `DistributedConfig(fsdp_size=2)` for FSDP2 training; those after `--tp_only` with tensor
  parallelism only), and records the largest difference to the plain model.
- `deepspeed MODEL_DIR --deepspeed CONFIG.json`: DeepSpeed ZeRO training steps vs. the same steps in one process.
- `accelerate_fsdp2 MODEL_DIR ...`: each model sharded by accelerate's own FSDP2 preparation (what
  `Accelerator.prepare` runs on GPUs with `configs/accelerate/fsdp2.yaml`) vs. the same steps in one process, and
  which modules became FSDP2 groups.
- `batch JOBS.json`: several of the above in one launch (each launch costs ~20 s of imports on 2 cores), in the
  order of the file's `{name: [sub-command, args...]}`; the result is `{name: that job's result}`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.distributed import DistributedConfig

import archlab  # noqa: F401  (registers the Auto classes)

SEQ_LEN = 16
LR = 1e-2


def toy_rows(n: int, vocab: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """Counting sequences of ragged length, right-padded: ranks see different token counts per step, so the loss
    is only right if the token count is summed across processes (`num_items_in_batch`)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, SEQ_LEN + 1, (1,), generator=g))
        start = int(torch.randint(3, vocab - SEQ_LEN, (1,), generator=g))
        ids = list(range(start, start + length)) + [0] * (SEQ_LEN - length)
        rows.append(
            {
                "input_ids": ids,
                "labels": ids[:length] + [-100] * (SEQ_LEN - length),
                "attention_mask": [1] * length + [0] * (SEQ_LEN - length),
            }
        )
    return rows


class _RecordLoss(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


class _SaveWeightsAtEnd(TrainerCallback):
    """Each rank writes the weights it ends training with to `DIR/rank-R.safetensors` (and its tokenizer to
    `DIR/rank-R.tokenizer.json`)."""

    def __init__(self, weights_dir: str | None) -> None:
        self.weights_dir = weights_dir

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.weights_dir is None:
            return
        from safetensors.torch import save_file

        os.makedirs(self.weights_dir, exist_ok=True)
        rank = os.environ.get("RANK", "0")
        weights = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
        save_file(weights, os.path.join(self.weights_dir, f"rank-{rank}.safetensors"))
        if hasattr(processing_class, "backend_tokenizer"):  # the tokenizer this rank trained on
            processing_class.backend_tokenizer.save(os.path.join(self.weights_dir, f"rank-{rank}.tokenizer.json"))


def run_script(name: str, weights_dir: str, argv: list[str]) -> dict:
    import importlib

    script = importlib.import_module(f"archlab.scripts.{name}")
    metrics = script.main(argv, callbacks=[_SaveWeightsAtEnd(weights_dir)])
    return {"metrics": metrics, "world_size": int(os.environ.get("WORLD_SIZE", "1"))}


def run_trainer(args: argparse.Namespace) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.global_batch % world:
        raise ValueError(f"--global_batch {args.global_batch} is not divisible by WORLD_SIZE {world}.")
    model = AutoModelForCausalLM.from_pretrained(args.models[0])
    data = Dataset.from_list(toy_rows(args.global_batch * args.steps, model.config.vocab_size))
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.global_batch // world,
        max_steps=args.steps,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        train_sampling_strategy="sequential",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    recorder = _RecordLoss()
    trainer_class = Trainer
    if args.archlab_trainer:
        from archlab.training.trainer import AtomicCheckpointTrainer as trainer_class
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=data,
        eval_dataset=data,
        callbacks=[recorder, _SaveWeightsAtEnd(args.weights_dir)],
    )
    if args.evaluate_first:
        trainer.evaluate()
    trainer.train()
    return {
        "losses": recorder.losses,
        "world_size": world,
        "distributed_type": str(trainer.accelerator.distributed_type),
    }


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if hasattr(a, "full_tensor"):
        a = a.full_tensor()
    return (a.float() - b.float()).abs().max().item()


def _masked_lm(config) -> bool:
    return "EncoderForMaskedLM" in (config.architectures or [])


def _auto_class(config):
    """The Auto class of the saved head (a masked LM's config is an encoder-decoder config too)."""
    if _masked_lm(config):
        return AutoModelForMaskedLM
    return AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM


def _inputs(config, rows: int = 2, length: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded row
    inputs = {"input_ids": ids, "attention_mask": mask}
    if config.is_encoder_decoder and not _masked_lm(config):
        inputs["decoder_input_ids"] = torch.randint(3, config.decoder_vocab_size, (rows, 7), generator=g)
    return inputs


def run_sharded(args: argparse.Namespace) -> dict:
    results = {}
    for path in [*args.models, *args.tp_only]:
        config = AutoConfig.from_pretrained(path)
        auto = _auto_class(config)
        plain = auto.from_pretrained(path).eval()
        inputs = _inputs(config)
        with torch.no_grad():
            reference = plain(**inputs).logits
        entry = {}
        # Tensor parallelism: every plan entry shards a weight across the 2 ranks.
        tp = auto.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2)).eval()
        entry["tp_sharded"] = any(hasattr(p, "placements") and "Shard" in str(p.placements) for p in tp.parameters())
        # a tied head must still be the parameter of the embedding it is tied to (the decoder's, in a seq2seq model)
        source = tp.get_decoder().embed_tokens if auto is AutoModelForSeq2SeqLM else tp.get_input_embeddings()
        entry["tp_tied_head"] = tp.get_output_embeddings().weight is source.weight
        with torch.no_grad():
            entry["tp_logits"] = _max_diff(tp(**inputs).logits, reference)
        if plain.can_generate():
            gen_kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=config.pad_token_id)
            generate_inputs = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
            expected = plain.generate(**generate_inputs, **gen_kwargs)
            entry["tp_generate_equal"] = bool(torch.equal(tp.generate(**generate_inputs, **gen_kwargs), expected))
        del tp
        if path in args.tp_only:
            results[os.path.basename(os.path.normpath(path))] = entry
            continue
        if getattr(config, "base_model_ep_plan", None) and getattr(config, "num_local_experts", 0) > 1:
            ep = auto.from_pretrained(path, distributed_config=DistributedConfig(ep_size=2, fsdp_size=2)).eval()
            experts = ep.model.layers[0].mlp.experts.gate_up_proj
            entry["ep_local_experts"] = experts.to_local().shape[0] if hasattr(experts, "to_local") else None
            with torch.no_grad():
                entry["ep_logits"] = _max_diff(ep(**inputs).logits, reference)
            del ep
        entry["fsdp_losses"], entry["reference_losses"] = _fsdp_vs_plain(auto, path, inputs)
        results[os.path.basename(os.path.normpath(path))] = entry
    return results


def _labels(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if "decoder_input_ids" in inputs:
        return inputs["decoder_input_ids"]
    return inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)


def _train_curve(
    model, optimizer, inputs: dict[str, torch.Tensor], sharded: bool, steps: int = 3, backward=None, step=None
) -> list[float]:
    """AdamW steps on the same global batch: one row per rank when `sharded`, both rows in one process otherwise.
    The rows have different token counts, so each rank's loss is summed and divided by the global count (as the
    Trainer does with `num_items_in_batch`) and multiplied by the world size, since the engines average gradients."""
    world = dist.get_world_size() if sharded else 1
    rows = slice(dist.get_rank(), dist.get_rank() + 1) if sharded else slice(None)
    labels = _labels(inputs)
    items = (labels != -100).sum()
    losses = []
    for _ in range(steps):
        loss = model(**{k: v[rows] for k, v in inputs.items()}, labels=labels[rows], num_items_in_batch=items).loss
        (backward or torch.Tensor.backward)(loss * world)
        if step is None:
            optimizer.step()
            optimizer.zero_grad()
        else:
            step()
        value = loss.detach().clone()
        if sharded:
            dist.all_reduce(value)
        losses.append(value.item())
    return losses


def _fsdp_vs_plain(auto, path: str, inputs: dict[str, torch.Tensor]) -> tuple[list, list]:
    curves = []
    for sharded in (True, False):
        kwargs = {"distributed_config": DistributedConfig(fsdp_size=2)} if sharded else {}
        model = auto.from_pretrained(path, **kwargs).train()
        curves.append(_train_curve(model, torch.optim.AdamW(model.parameters(), lr=LR), inputs, sharded))
    return curves[0], curves[1]


def run_deepspeed(args: argparse.Namespace) -> dict:
    """ZeRO with DeepSpeed's own engine on CPU (`DS_ACCELERATOR=cpu`, gloo), its "auto" fields filled by
    transformers' `HfTrainerDeepSpeedConfig` exactly as the Trainer fills them on GPUs."""
    import deepspeed
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    path = args.models[0]
    config = AutoConfig.from_pretrained(path)
    inputs = _inputs(config)
    world = int(os.environ["WORLD_SIZE"])
    hf_args = SimpleNamespace(
        world_size=world,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        max_grad_norm=0.0,
        learning_rate=LR,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.01,
        save_on_each_node=False,
        fp16=False,
        fp16_full_eval=False,
        bf16=False,
        bf16_full_eval=False,
        get_warmup_steps=lambda steps: 0,
    )
    # the reference first: once an HfDeepSpeedConfig with ZeRO-3 exists, `from_pretrained` loads partitioned
    plain = AutoModelForCausalLM.from_pretrained(path).train()
    reference = _train_curve(plain, torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.01), inputs, False)
    model = AutoModelForCausalLM.from_pretrained(path).train()
    ds_config = HfTrainerDeepSpeedConfig(args.deepspeed)
    ds_config.trainer_config_process(hf_args)
    ds_config.trainer_config_finalize(hf_args, model, num_training_steps=3)
    ds_config.config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config.config)
    partitioned = [n for n, p in engine.module.named_parameters() if p.numel() == 0 and getattr(p, "ds_numel", 0)]
    sharded = _train_curve(engine, None, inputs, True, backward=engine.backward, step=engine.step)
    unset_hf_deepspeed_config()  # later jobs of a batch load their models whole again
    return {
        "stage": ds_config.config["zero_optimization"]["stage"],
        "partitioned": partitioned,
        "losses": sharded,
        "reference_losses": reference,
    }


def run_accelerate_fsdp2(args: argparse.Namespace) -> dict:
    """accelerate 1.15 enables its FSDP plugin only on accelerator devices, so `Accelerator.prepare` cannot be used on
    CPU; its FSDP2 preparation itself (`fsdp2_prepare_model`: wrap policy from `_no_split_modules`, the input
    embedding, a [final norm, LM head] tail group, the root) runs on gloo and is called here as `prepare` calls it."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import FSDPModule

    if not dist.is_initialized():  # (an earlier job of the batch may have started it)
        dist.init_process_group("gloo")
    results = {}
    for path in args.models:
        config = AutoConfig.from_pretrained(path)
        inputs = _inputs(config)
        plain = AutoModelForCausalLM.from_pretrained(path).train()
        reference = _train_curve(plain, torch.optim.AdamW(plain.parameters(), lr=LR), inputs, False)
        # the settings of configs/accelerate/fsdp2.yaml (full precision here: bf16 needs an accelerator)
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True
        )
        accelerator = SimpleNamespace(
            state=SimpleNamespace(fsdp_plugin=plugin),
            mixed_precision="no",
            is_main_process=dist.get_rank() == 0,
            torch_device_mesh=None,
            device=torch.device("cpu"),  # accelerate 1.16 moves the modules FSDP2 leaves unsharded there
        )
        model = fsdp2_prepare_model(accelerator, AutoModelForCausalLM.from_pretrained(path).train())
        groups = {name: m._get_fsdp_state() for name, m in model.named_modules() if isinstance(m, FSDPModule)}
        results[os.path.basename(os.path.normpath(path))] = {
            "wrapped_classes": sorted(plugin.transformer_cls_names_to_wrap),
            "groups": list(groups),
            # the modules that share the LM head's FSDP2 state (gathered together, kept whole through the loss)
            "head_group": [name for name, state in groups.items() if state is groups["lm_head"]],
            "losses": _train_curve(model, torch.optim.AdamW(model.parameters(), lr=LR), inputs, True),
            "reference_losses": reference,
        }
    return results


def run_job(argv: list[str]) -> dict:
    """One sub-command (`argv` as on the command line, without `--out`) run in this process; its result."""
    torch.manual_seed(0)
    if argv[:1] == ["script"]:
        parser = argparse.ArgumentParser(description=__doc__)
        parser.add_argument("name", choices=["pretrain", "finetune"])
        parser.add_argument("--weights_dir", required=True)
        split = argv.index("--")
        args = parser.parse_args(argv[1:split])
        return run_script(args.name, args.weights_dir, argv[split + 1 :])
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("command", choices=list(COMMANDS))
    parser.add_argument("models", nargs="+")
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--global_batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--weights_dir", default=None)
    parser.add_argument("--archlab_trainer", action="store_true")
    parser.add_argument("--evaluate_first", action="store_true")
    parser.add_argument("--tp_only", nargs="*", default=[], help="sharded: more models, for tensor parallelism only")
    args = parser.parse_args(argv)
    return COMMANDS[args.command](args)


def main() -> None:
    argv = sys.argv[1:]
    options = argv.index("--") if "--" in argv else len(argv)  # a script's own flags follow "--"
    at = argv.index("--out", 0, options)
    out = argv[at + 1]
    del argv[at : at + 2]
    if argv[0] == "batch":
        with open(argv[1], encoding="utf-8") as f:
            jobs = json.load(f)
        _write(out, {name: run_job(job) for name, job in jobs.items()})
    else:
        _write(out, run_job(argv))


def _write(out: str, result: dict) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


COMMANDS = {
    "trainer": run_trainer,
    "sharded": run_sharded,
    "deepspeed": run_deepspeed,
    "accelerate_fsdp2": run_accelerate_fsdp2,
}

if __name__ == "__main__":
    main()
