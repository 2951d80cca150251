"""Model cards for saved archlab folders, rendered from `model_card.md` with huggingface_hub's `ModelCard`.

`write_model_card(folder, ...)` works on any folder written by `save_pretrained` (a checkpoint, a Trainer output,
a dry-run of `scripts/push_to_hub.py`): everything it states is read from the folder -- `config.json`, the
safetensors headers, `trainer_state.json`, tokenizer files -- or passed in by the caller.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .facts import (
    SEQ2SEQ_PIPELINE_TAGS,
    architecture_rows,
    auto_class_for,
    check_pipeline_tag,
    format_count,
    parameter_counts,
    pipeline_tag_for,
    read_config,
    training_summary,
)

TEMPLATE = Path(__file__).with_name("model_card.md")
LOSS_CURVE = "loss_curve.png"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model")

DEFAULT_LIMITATIONS = (
    "This is a research model trained with archlab. It has not been evaluated for safety, bias or factual "
    "accuracy and should not be used to make decisions about people. Its knowledge is limited to its training "
    "data; small models trained on little data produce fluent-looking but unreliable text."
)

QA_EXAMPLE_QUESTION = "What is the name of the function?"  # asked of the default example, "def fibonacci(n):"


def _usage(
    auto_class: str,
    pipeline_tag: str | None,
    model_id: str,
    has_tokenizer: bool,
    example: str,
    encoder_decoder: bool,
    regression: bool = False,
    multi_label: bool = False,
    example_pair: str | None = None,
    segments: bool = False,
    prefix_key: str | None = None,
) -> str:
    """A snippet that runs as is against the saved folder (tested by executing it); a regression head's prints its
    value (its one output), not the placeholder label name `LABEL_0` that an argmax over one output always gives; a
    multi-label head's the classes whose sigmoid is above 0.5 (its argmax would be one class of the set). With
    `example_pair` a classifier of sentence pairs is given the pair (`example`, `example_pair`), with its
    `token_type_ids` where the model has segment embeddings (`segments`); a question-answering model is given a
    question about `example` (`example_pair`, else `QA_EXAMPLE_QUESTION`) as the tokenizer's pair, and its answer
    ends at or after its start (the two argmaxes taken apart gave an empty span whenever the end came first); with
    `prefix_key` an encoder-decoder's
    source starts with the task prefix it was trained with, `config.task_specific_params[prefix_key]["prefix"]`."""
    lines = [
        "import torch",
        f"from transformers import {auto_class}" + (", AutoTokenizer" if has_tokenizer else ""),
        "",
        f'model_id = "{model_id}"',
        f"model = {auto_class}.from_pretrained(model_id, trust_remote_code=True)",
    ]
    if has_tokenizer:
        lines += [
            # without archlab installed, AutoTokenizer reads the config's remote-code `auto_map` too: say yes up front
            "tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=True)",
            f'inputs = tokenizer({example!r}, return_tensors="pt", return_token_type_ids=False)',
        ]
        if pipeline_tag == "question-answering":  # a question about a context, encoded as the tokenizer's pair
            segment_ids = "return_token_type_ids=True" if segments else "return_token_type_ids=False"
            question = example_pair if example_pair is not None else QA_EXAMPLE_QUESTION
            lines[-1] = f"question, context = {question!r}, {example!r}"
            lines.append(f'inputs = tokenizer(question, context, return_tensors="pt", {segment_ids})')
        if example_pair is not None and pipeline_tag == "text-classification":
            segment_ids = "return_token_type_ids=True" if segments else "return_token_type_ids=False"
            lines[-1] = "# a sentence pair: the two texts in the order of the columns it was trained on"
            lines.append(f'inputs = tokenizer({example!r}, {example_pair!r}, return_tensors="pt", {segment_ids})')
        if prefix_key is not None and pipeline_tag in SEQ2SEQ_PIPELINE_TAGS:
            lines[-1] = (
                f'prefix = model.config.task_specific_params[{prefix_key!r}]["prefix"]  # the task prefix it was '
                "trained with"
            )
            lines.append(f'inputs = tokenizer(prefix + {example!r}, return_tensors="pt", return_token_type_ids=False)')
    else:
        lines += [
            "# no tokenizer was saved with this model: feed token ids directly",
            'inputs = {"input_ids": torch.tensor([[1, 5, 6, 7, 8]])}',
        ]
    decode = "tokenizer.decode(output[0], skip_special_tokens=True)" if has_tokenizer else "output[0].tolist()"
    if pipeline_tag == "text-generation":
        lines += [
            "output = model.generate(**inputs, max_new_tokens=20, do_sample=False)",
            f"print({decode})",
        ]
    elif pipeline_tag in SEQ2SEQ_PIPELINE_TAGS:  # transformers 5 has no pipeline for these
        decode = "tokenizer.batch_decode(output, skip_special_tokens=True)" if has_tokenizer else "output.tolist()"
        lines += [
            "output = model.generate(**inputs, num_beams=4, max_new_tokens=40)",
            f"print({decode})",
        ]
    elif pipeline_tag == "text-classification":
        lines += [
            "with torch.no_grad():",
            "    logits = model(**inputs).logits",
        ]
        if regression:
            lines.append("print(logits[0, 0].item())")
        elif multi_label:
            lines.append("print([model.config.id2label[i] for i, p in enumerate(logits[0].sigmoid()) if p > 0.5])")
        else:
            lines.append("print(model.config.id2label[int(logits.argmax(-1)[0])])")
    elif pipeline_tag == "token-classification":
        lines += [
            "with torch.no_grad():",
            "    logits = model(**inputs).logits",
            "print([model.config.id2label[int(i)] for i in logits.argmax(-1)[0]])  # a label per token",
        ]
    elif pipeline_tag == "question-answering":  # transformers 5 has no pipeline for it
        answer = 'inputs["input_ids"][0, start : end + 1]'
        lines += [
            "with torch.no_grad():",
            "    output = model(**inputs)",
            "start = int(output.start_logits.argmax(-1)[0])",
            "end = start + int(output.end_logits[0, start:].argmax())  # the best end at or after the start",
            f"print({f'tokenizer.decode({answer})' if has_tokenizer else f'{answer}.tolist()'})  # the answer span",
        ]
    elif pipeline_tag == "fill-mask" and has_tokenizer:
        lines[-1] = (
            f"inputs = tokenizer({example!r} + ' ' + tokenizer.mask_token, return_tensors=\"pt\", "
            "return_token_type_ids=False)"
        )
        lines += [
            "with torch.no_grad():",
            "    logits = model(**inputs).logits",
            'masked = inputs["input_ids"][0] == tokenizer.mask_token_id',
            "print(tokenizer.decode(logits[0, masked].argmax(-1)))",
        ]
    elif pipeline_tag == "fill-mask":
        lines += [
            "with torch.no_grad():",
            "    logits = model(**inputs).logits",
            "print(logits.argmax(-1)[0].tolist())",
        ]
    else:
        if encoder_decoder:  # the base encoder-decoder needs decoder inputs: start the decoder with its start token
            lines.append('inputs["decoder_input_ids"] = torch.tensor([[model.config.decoder_start_token_id]])')
        lines += [
            "with torch.no_grad():",
            "    hidden = model(**inputs).last_hidden_state",
            "print(hidden.shape)",
        ]
    return "\n".join(lines)


PAIR_LINE = re.compile(
    r"^inputs = tokenizer\(('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"), "
    r"('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"), return_tensors",
    re.M,
)


def snippet_pair(card_text: str) -> tuple[str, str] | None:
    """The (example text, example pair) of a card whose snippet tokenizes a sentence pair, else None: a card
    written again (`push_to_hub` re-renders it from the folder) keeps its pair, which the config does not record."""
    import ast

    found = PAIR_LINE.search(card_text)
    return (ast.literal_eval(found.group(1)), ast.literal_eval(found.group(2))) if found else None


def task_prefix_key(config: dict[str, Any], pipeline_tag: str | None) -> str | None:
    """The key of `config["task_specific_params"]` whose `prefix` a `pipeline_tag` model's inputs start with (T5's
    convention: "summarization", "translation_en_to_de"; a "translation" task reads the first "translation*" key, as
    transformers 4's translation pipeline does), else None."""
    params = config.get("task_specific_params") or {}
    if pipeline_tag is None:
        return None
    keys = [key for key, value in params.items() if isinstance(value, dict) and value.get("prefix")]
    return next((key for key in keys if key == pipeline_tag), None) or next(
        (key for key in keys if key.startswith(pipeline_tag)), None
    )


def _eval_results(
    metrics: dict[str, Any] | list[EvalResult] | None, pipeline_tag: str | None, dataset: str
) -> list[EvalResult] | None:
    if not metrics:
        return None
    if isinstance(metrics, list):
        return metrics
    metrics = dict(metrics)
    if pipeline_tag == "text-generation" and "loss" in metrics and "perplexity" not in metrics:
        metrics["perplexity"] = math.exp(min(metrics["loss"], 50.0))
    return [
        EvalResult(
            task_type=pipeline_tag or "other",
            dataset_type=dataset,
            dataset_name=dataset,
            metric_type=name,
            metric_value=round(float(value), 4),
        )
        for name, value in metrics.items()
        # a number the Hub's model-index takes: not a flag, not NaN or infinity (YAML's `.nan`, which it rejects)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ]


def _loss_curve(folder: Path, loss_curve: str | Path | None, losses: list[tuple[int, float]]) -> str | None:
    """The image's name inside `folder`: a given image is copied in; otherwise it is drawn from the Trainer log."""
    target = folder / LOSS_CURVE
    if loss_curve is not None:
        source = Path(loss_curve)
        if not source.is_file():
            raise FileNotFoundError(f"`loss_curve` {source} does not exist.")
        if source.resolve().parent != folder.resolve():
            shutil.copyfile(source, target)
            return LOSS_CURVE
        return source.name
    if target.is_file():
        return LOSS_CURVE
    if len(losses) < 2:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # matplotlib is optional: the card simply has no image
        return None
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot([step for step, _ in losses], [loss for _, loss in losses])
    axis.set_xlabel("step")
    axis.set_ylabel("training loss")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(target, dpi=100, metadata={"Software": None})
    plt.close(figure)
    return LOSS_CURVE


def write_model_card(
    folder: str | Path,
    *,
    model_id: str | None = None,
    base_model: str | None = None,
    datasets: str | list[str] | None = None,
    eval_results: dict[str, float] | list[EvalResult] | None = None,
    eval_dataset: str | None = None,
    trainer_state: Any = None,
    training_args: Any = None,
    license: str = "apache-2.0",
    language: str | list[str] | None = None,
    tags: list[str] | None = None,
    pipeline_tag: str | None = None,
    description: str | None = None,
    limitations: str | None = None,
    loss_curve: str | Path | None = None,
    example_text: str = "def fibonacci(n):",
    example_pair: str | None = None,
) -> ModelCard:
    """Write `README.md` (the model card) into a folder written by `save_pretrained`; returns its path.

    All arguments but `folder` are optional:
        model_id: the Hub id the card's usage snippet loads (defaults to the folder's name).
        base_model: the Hub id this model was fine-tuned from (goes into the metadata and the text).
        datasets: training data set name(s).
        eval_results: `{metric: value}` (or `huggingface_hub.EvalResult`s) for the model-index; defaults to the
            last evaluation in the Trainer state; a causal LM's `loss` also yields `perplexity`.
        eval_dataset: the data set the evaluation ran on (defaults to the first of `datasets`).
        trainer_state: a `TrainerState`, dict or path to `trainer_state.json` (defaults to the folder's own).
        training_args: `TrainingArguments`, a dict or a JSON path (defaults to the folder's `training_args.json`;
            the pickled `training_args.bin` is never read).
        license, language, tags, pipeline_tag, description, limitations: card metadata and text.
        loss_curve: an image of the loss curve, copied in as `loss_curve.png` (defaults to the folder's own
            `loss_curve.png`, else one is drawn from the Trainer log when matplotlib is installed).
        example_text: the prompt in the usage snippet.
        example_pair: a sequence classifier of sentence pairs: the second text of the snippet's pair; a
            question-answering model: the question asked about `example_text`.

    An encoder-decoder whose config holds a task prefix for its task (`task_specific_params[task]["prefix"]`, T5's
    convention, which the fine-tuning script's --source_prefix writes) has its snippet put it before the source.
    """
    folder = Path(folder)
    config = read_config(folder)
    architecture = (config.get("architectures") or ["DecoderModel"])[0]
    check_pipeline_tag(architecture, pipeline_tag)
    pipeline_tag = pipeline_tag or pipeline_tag_for(architecture)
    # a hidden folder is a staging folder inside the real output folder (as the training scripts write)
    model_id = (
        model_id
        or next(part for part in (folder.resolve(), *folder.resolve().parents) if not part.name.startswith(".")).name
    )
    datasets = [datasets] if isinstance(datasets, str) else list(datasets or [])
    summary = training_summary(folder, trainer_state, training_args)
    counts = parameter_counts(folder, config)
    has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES)

    results = _eval_results(
        eval_results if eval_results is not None else summary["eval_metrics"],
        pipeline_tag,
        eval_dataset or (datasets[0] if datasets else "custom"),
    )
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        license=license,
        language=language,
        datasets=datasets or None,
        base_model=base_model,
        tags=["archlab", str(config.get("model_type", "custom")), "custom_code", "safetensors", *(tags or [])],
        model_name=model_id if results else None,  # the model-index's name; no stray key without one
        eval_results=results,
    )
    default_description = (
        f"A `{architecture}` trained with archlab, a Hugging Face transformers plugin for the architecture "
        "catalogue of the last eight years (norms, positions, attention variants, gated FFNs, mixture of experts)."
    )
    card = ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE),
        model_name=model_id,
        description=description or default_description,
        base_model=base_model,
        datasets=datasets,
        architecture=architecture_rows(config),
        parameters=(
            {"total": format_count(counts[0]), "active": format_count(counts[1])} if counts is not None else None
        ),
        usage=_usage(
            auto_class_for(architecture),
            pipeline_tag,
            model_id,
            has_tokenizer,
            example_text,
            # (archlab's encoder-only classes share the encoder-decoder's config)
            encoder_decoder=bool(config.get("is_encoder_decoder")) and not architecture.startswith("Encoder"),
            regression=config.get("problem_type") == "regression",
            multi_label=config.get("problem_type") == "multi_label_classification",
            example_pair=example_pair,
            segments=(config.get("type_vocab_size") or 0) > 1,  # (one type: segment 0 everywhere, as without ids)
            prefix_key=task_prefix_key(config, pipeline_tag),
        ),
        # float32 weights (with or without autocast) are the default and go unsaid; others were trained as they are
        weights_dtype=summary["weights_dtype"] if summary["weights_dtype"] != "float32" else None,
        hyperparameters=summary["hyperparameters"],
        results=summary["results"],
        loss_curve=_loss_curve(folder, loss_curve, summary["losses"]),
        limitations=limitations or DEFAULT_LIMITATIONS,
    )
    # the template's `{% if %}` lines leave runs of blank lines; Markdown ignores them, readers should not see them
    card = ModelCard(re.sub(r"\n{3,}", "\n\n", str(card)))
    path = folder / "README.md"
    card.save(str(path))
    return path
