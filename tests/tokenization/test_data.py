"""The data pipeline (tokenization/data.py): loading, splitting, tokenizing, packing with document boundaries."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset

import archlab
from archlab.tokenization.data import (
    IGNORE_INDEX,
    check_columns,
    check_not_empty,
    check_text_columns,
    load_raw_datasets,
    pack_causal_lm,
    pack_documents,
    tokenize_documents,
)
from archlab.tokenization.training import train_tokenizer

from helpers import tiny_decoder_config, tiny_seq2seq_config

PAD = 0


def random_documents(n: int, seed: int = 0, low: int = 1, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 97) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def segments(position_ids: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of positions 0, 1, 2, ..."""
    starts = [i for i, p in enumerate(position_ids) if p == 0] + [len(position_ids)]
    return list(zip(starts, starts[1:]))


@pytest.mark.parametrize("block_size", [7, 16, 64])
def test_packing_loses_and_duplicates_nothing(block_size: int) -> None:
    documents = random_documents(50)
    blocks = pack_documents(documents, block_size, PAD)
    assert all(len(row) == block_size for key in blocks for row in blocks[key])
    flat_ids = [t for row in blocks["input_ids"] for t in row]
    flat_pos = [p for row in blocks["position_ids"] for p in row]
    real = sum(len(d) for d in documents)
    # Everything after the documents is the one padding segment of the last block.
    assert flat_ids[:real] == [t for d in documents for t in d]
    assert flat_ids[real:] == [PAD] * (len(flat_ids) - real) and len(flat_ids) - real < block_size
    assert flat_pos[real:] == list(range(len(flat_ids) - real))


def test_packing_respects_document_boundaries() -> None:
    documents = random_documents(30, seed=1)
    block_size = 16
    blocks = pack_documents(documents, block_size, PAD)
    # Walk the documents through the blocks: every document (piece) starts at position 0 and counts up by one.
    expected_positions, expected_labels = [], []
    room = block_size
    for document in documents:
        offset = 0
        while offset < len(document):
            piece = document[offset : offset + room]
            expected_positions += list(range(len(piece)))
            expected_labels += [IGNORE_INDEX] + piece[1:]
            offset += len(piece)
            room -= len(piece)
            room = room or block_size
    n = len(expected_positions)
    assert [p for row in blocks["position_ids"] for p in row][:n] == expected_positions
    assert [t for row in blocks["labels"] for t in row][:n] == expected_labels
    assert all(t == IGNORE_INDEX for t in [t for row in blocks["labels"] for t in row][n:])
    assert max(p for row in blocks["position_ids"] for p in row) < block_size


def test_packing_without_boundaries_has_attention_mask_not_positions() -> None:
    documents = random_documents(10)
    blocks = pack_documents(documents, 32, PAD, restart_positions=False)
    assert set(blocks) == {"input_ids", "attention_mask"}
    flat_mask = [m for row in blocks["attention_mask"] for m in row]
    assert sum(flat_mask) == sum(len(d) for d in documents)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("training", [True, False])
def test_packed_logits_equal_separate_documents(attn_implementation: str, training: bool) -> None:
    """The point of restarting position ids: archlab's decoder, through transformers' masking_utils, attends
    within each document only -- packed logits equal the logits of each document run alone."""
    config = tiny_decoder_config(attention_dropout=0.0)
    config._attn_implementation = attn_implementation
    model = archlab.DecoderForCausalLM(config).train(training)
    documents = [[1] + d + [2] for d in random_documents(9, seed=2, low=2, high=20)]
    blocks = pack_documents(documents, 24, PAD)
    input_ids = torch.tensor(blocks["input_ids"])
    position_ids = torch.tensor(blocks["position_ids"])
    # As the Trainer calls it: no attention mask, cache off (the Trainer sets `use_cache=False`).
    packed = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    for row in range(input_ids.shape[0]):
        for start, end in segments(blocks["position_ids"][row]):
            alone = model(input_ids=input_ids[row : row + 1, start:end], use_cache=False).logits
            torch.testing.assert_close(packed[row, start:end], alone[0], atol=1e-5, rtol=1e-5)
    # And the check can fail: one sequence without the restarts does attend across documents.
    plain = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    reference = model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    crossed = (plain - reference).abs().max().item()
    assert crossed > 1e-3


def tiny_masked_lm(**overrides) -> archlab.EncoderForMaskedLM:
    return archlab.EncoderForMaskedLM(tiny_seq2seq_config(**{"vocab_size": 97, **overrides}))


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "relative_bias"])
def test_masked_lm_packed_logits_equal_separate_documents(attn_implementation: str, positions: str) -> None:
    """Masked-LM packing keeps documents apart too: positions restart per document and the encoder builds a
    block-diagonal bidirectional mask from them, so packed logits equal each document run alone."""
    model = tiny_masked_lm(position_embedding_type=positions, attn_implementation=attn_implementation).train()
    documents = [[1] + d + [2] for d in random_documents(9, seed=2, low=2, high=20)]
    blocks = pack_documents(documents, 24, PAD, causal_labels=False)
    assert set(blocks) == {"input_ids", "position_ids"}  # DataCollatorForLanguageModeling makes the labels
    input_ids, position_ids = torch.tensor(blocks["input_ids"]), torch.tensor(blocks["position_ids"])
    packed = model(input_ids=input_ids, position_ids=position_ids).logits
    for row in range(input_ids.shape[0]):
        for start, end in segments(blocks["position_ids"][row]):
            alone = model(input_ids=input_ids[row : row + 1, start:end]).logits
            torch.testing.assert_close(packed[row, start:end], alone[0], atol=1e-5, rtol=1e-5)
    # And the check can fail: the same blocks without the restarts attend across documents.
    crossed = (model(input_ids=input_ids).logits - packed).abs().max().item()
    assert crossed > 1e-3


def test_masked_lm_packed_blocks_through_the_collator_and_trainer_columns() -> None:
    """`position_ids` survive DataCollatorForLanguageModeling and the Trainer's unused-column filter (which keeps
    only the model's forward arguments), and the loss of a collated packed batch is the per-document one."""
    import inspect

    from transformers import DataCollatorForLanguageModeling

    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(30)]
    tokenizer = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    tokenizer.mask_token = tokenizer.unk_token  # any special token works as the mask for this check
    model = tiny_masked_lm(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id).eval()
    assert "position_ids" in inspect.signature(model.forward).parameters
    documents = [tokenizer(t)["input_ids"] for t in texts[:8]]
    blocks = pack_documents(documents, 32, tokenizer.pad_token_id, causal_labels=False)
    rows = [dict(zip(blocks, values)) for values in zip(*blocks.values())]
    batch = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3, seed=0)(rows)
    assert torch.equal(batch["position_ids"], torch.tensor(blocks["position_ids"]))
    assert (batch["labels"] != IGNORE_INDEX).any()
    with torch.no_grad():
        packed = model(**batch).logits
        for row in range(batch["input_ids"].shape[0]):
            for start, end in segments(blocks["position_ids"][row]):
                alone = model(input_ids=batch["input_ids"][row : row + 1, start:end]).logits[0]
                torch.testing.assert_close(packed[row, start:end], alone, atol=1e-5, rtol=1e-5)


def test_packed_loss_ignores_document_starts() -> None:
    model = archlab.DecoderForCausalLM(tiny_decoder_config()).eval()
    documents = [[1] + d + [2] for d in random_documents(6, seed=3, low=2, high=12)]
    blocks = pack_documents(documents, 20, PAD)
    batch = {k: torch.tensor(v) for k, v in blocks.items()}
    loss = model(**batch, use_cache=False).loss
    # Reference: sum of per-document next-token losses over the same targets, averaged over all targets.
    total, count = 0.0, 0
    for row in range(batch["input_ids"].shape[0]):
        for start, end in segments(blocks["position_ids"][row]):
            labels = batch["labels"][row, start:end]
            if (labels[1:] == IGNORE_INDEX).all():
                continue
            logits = model(input_ids=batch["input_ids"][row : row + 1, start:end], use_cache=False).logits[0]
            targets = labels[1:]
            keep = targets != IGNORE_INDEX
            total += torch.nn.functional.cross_entropy(logits[:-1][keep], targets[keep], reduction="sum").item()
            count += int(keep.sum())
    assert loss.item() == pytest.approx(total / count, rel=1e-5)


def test_tokenize_and_pack_with_datasets_map(tmp_path: Path) -> None:
    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(40)]
    tokenizer = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    data_file = tmp_path / "train.jsonl"
    data_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    raw = load_raw_datasets(train_file=str(data_file), cache_dir=str(tmp_path / "cache"))
    tokenized = tokenize_documents(raw["train"], tokenizer, num_proc=2)
    assert all(ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id for ids in tokenized["input_ids"])
    packed = pack_causal_lm(tokenized, 32, tokenizer.pad_token_id, num_proc=2)
    assert packed.cache_files, "map results are cached on disk"
    again = pack_causal_lm(tokenize_documents(raw["train"], tokenizer, num_proc=2), 32, tokenizer.pad_token_id)
    assert again.cache_files == packed.cache_files  # second run loads the cache
    real = sum(len(ids) for ids in tokenized["input_ids"])
    labels = [t for row in packed["labels"] for t in row]
    # Every token appears once; the labels keep all but each document's first token.
    assert sum(1 for row in packed["input_ids"] for t in row) >= real
    assert sum(t != IGNORE_INDEX for t in labels) <= real - len(tokenized)


@pytest.mark.parametrize("streaming", [False, True])
def test_blank_lines_are_not_documents(tmp_path: Path, streaming: bool) -> None:
    """A text file read by line has a row per blank line; with `<s>` and `</s>` added, each was a document `<s> </s>`
    that taught the model to end a text as soon as it starts. Empty and whitespace-only texts are dropped."""
    lines = ["def f(x):", "", "    return x", "   ", "", "print(f(2))"]
    tokenizer = train_tokenizer(lines, vocab_size=300, min_frequency=1)
    data_file = tmp_path / "train.txt"
    data_file.write_text("\n".join(lines) + "\n")
    raw = load_raw_datasets(
        train_file=str(data_file), validation_file=str(data_file), sample_by="line", streaming=streaming
    )
    documents = [row["input_ids"] for row in tokenize_documents(raw["train"], tokenizer)]
    expected = [tokenizer(line).input_ids + [tokenizer.eos_token_id] for line in lines if line.strip()]
    assert documents == expected
    assert [tokenizer.bos_token_id, tokenizer.eos_token_id] not in documents


def test_streamed_text_files_with_a_validation_file_pack(tmp_path: Path) -> None:
    """A streamed text file has no known columns (`column_names` is None) when a validation file is given: `map` kept
    the `text` column beside the blocks, and packing failed inside `datasets` ("Column lengths mismatch") at the first
    training step."""
    texts = [f"value_{i} = {i} ** 2\n" * (1 + i % 5) for i in range(12)]
    tokenizer = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    data_file = tmp_path / "train.txt"
    data_file.write_text("\n\n".join(texts))
    raw = load_raw_datasets(
        train_file=str(data_file), validation_file=str(data_file), sample_by="paragraph", streaming=True
    )
    eager = load_raw_datasets(train_file=str(data_file), validation_file=str(data_file), sample_by="paragraph")
    for split in ("train", "validation"):
        assert raw[split].column_names is None  # (what made the difference)
        streamed = list(pack_causal_lm(tokenize_documents(raw[split], tokenizer), 16, PAD))
        blocks = pack_causal_lm(tokenize_documents(eager[split], tokenizer), 16, PAD)
        assert streamed == list(blocks)


def test_streaming_packs_like_map_style(tmp_path: Path) -> None:
    texts = [f"value_{i} = {i} ** 2\n" * (1 + i % 5) for i in range(30)]
    tokenizer = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    data_file = tmp_path / "train.txt"
    data_file.write_text("\n\n".join(texts))
    common = dict(train_file=str(data_file), sample_by="paragraph", cache_dir=str(tmp_path / "cache"))
    eager = load_raw_datasets(**common)
    lazy = load_raw_datasets(streaming=True, **common)
    assert isinstance(lazy["train"], IterableDataset)
    blocks = pack_causal_lm(tokenize_documents(eager["train"], tokenizer), 16, 0)
    streamed = pack_causal_lm(tokenize_documents(lazy["train"], tokenizer), 16, 0, batch_size=1000)
    first = next(iter(streamed))
    assert set(first) == {"input_ids", "position_ids", "labels"} and len(first["input_ids"]) == 16
    # Same documents in both (validation held out differently), same packing function.
    assert sum(1 for _ in streamed) > 0 and len(blocks) > 0


@pytest.mark.parametrize("extension", ["csv", "json", "parquet", "txt"])
def test_local_formats_and_validation_split(tmp_path: Path, extension: str) -> None:
    rows = [{"text": f"line {i}", "label": i % 2} for i in range(40)]
    path = tmp_path / f"data.{extension}"
    dataset = Dataset.from_list(rows)
    if extension == "csv":
        dataset.to_csv(path)
    elif extension == "json":
        dataset.to_json(path)
    elif extension == "parquet":
        dataset.to_parquet(path)
    else:
        path.write_text("\n".join(r["text"] for r in rows))
    raw = load_raw_datasets(
        train_file=str(path), validation_split_percentage=10, sample_by="line", cache_dir=str(tmp_path / "cache")
    )
    assert len(raw["train"]) == 36 and len(raw["validation"]) == 4
    assert set(raw["train"]["text"]).isdisjoint(raw["validation"]["text"])


def test_embedded_corpus_is_the_default(tmp_path: Path) -> None:
    raw = load_raw_datasets(cache_dir=str(tmp_path))
    assert len(raw["train"]) > 100 and len(raw["validation"]) > 5
    assert "def " in raw["train"][0]["text"]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_folder_saved_by_save_to_disk_is_a_dataset_name(tmp_path: Path, streaming: bool) -> None:
    """`--dataset_name` of a `save_to_disk` folder (what a preprocessing step leaves) failed as "Could not load
    dataset ... from the Hub": `load_dataset` refuses such folders. A saved DatasetDict keeps its splits; a saved
    Dataset is the train split, and the validation split is taken from it as for any dataset without one."""
    texts = [f"document {i}" for i in range(40)]
    DatasetDict(
        {"train": Dataset.from_dict({"text": texts}), "validation": Dataset.from_dict({"text": ["v"]})}
    ).save_to_disk(tmp_path / "splits")
    raw = load_raw_datasets(dataset_name=str(tmp_path / "splits"), streaming=streaming)
    assert [row["text"] for row in raw["train"]] == texts and [row["text"] for row in raw["validation"]] == ["v"]
    Dataset.from_dict({"text": texts}).save_to_disk(tmp_path / "one")
    raw = load_raw_datasets(dataset_name=str(tmp_path / "one"), streaming=streaming, validation_split_percentage=10)
    assert sorted(row["text"] for split in ("train", "validation") for row in raw[split]) == sorted(texts)
    with pytest.raises(ValueError, match="--dataset_config_name 'en': .* is a folder saved by `save_to_disk`"):
        load_raw_datasets(dataset_name=str(tmp_path / "one"), dataset_config_name="en")
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="Could not load dataset .*other' from the local folder"):
        load_raw_datasets(dataset_name=str(tmp_path / "other"))


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_raw_datasets(train_file=str(tmp_path / "missing.json"))
    (tmp_path / "data.xml").write_text("<a/>")
    with pytest.raises(ValueError, match="extension 'xml' is not supported"):
        load_raw_datasets(train_file=str(tmp_path / "data.xml"))
    with pytest.raises(ValueError, match="not both"):
        load_raw_datasets(dataset_name="wikitext", train_file="x.txt")
    with pytest.raises(ValueError, match="Could not load dataset"):  # offline in tests
        load_raw_datasets(dataset_name="no-such-user/no-such-dataset", cache_dir=str(tmp_path))
    dataset = Dataset.from_dict({"content": ["a", "b"]})
    with pytest.raises(ValueError, match=r"Column 'text' not found in the train split; its columns are \['content'\]"):
        check_columns(dataset, "text")
    with pytest.raises(ValueError, match="validation split is empty"):
        check_not_empty(dataset.select([]), "validation")
    with pytest.raises(ValueError, match="block_size"):
        pack_causal_lm(dataset, 1, 0)


@pytest.mark.parametrize("empty", ["train", "validation"])
def test_a_file_with_a_header_and_no_rows_is_named_with_its_split(tmp_path: Path, empty: str) -> None:
    """A validation CSV with its header and no rows was reported as an empty train split."""
    files = {split: tmp_path / f"{split}.csv" for split in ("train", "validation")}
    for split, path in files.items():
        path.write_text("text,label\n" + ("" if split == empty else "a b,1\nc d,0\n"))
    with pytest.raises(ValueError, match=f"The {empty} split is empty: '{files[empty]}' holds no rows"):
        load_raw_datasets(
            train_file=str(files["train"]), validation_file=str(files["validation"]), cache_dir=str(tmp_path)
        )


def test_a_validation_file_whose_values_do_not_fit_the_train_files_columns_is_named(tmp_path: Path) -> None:
    """`datasets` reads the validation file with the train file's column types: a float column holding "high" in the
    validation file failed as a bare DatasetGenerationError."""
    (tmp_path / "train.csv").write_text("text,score\na b,0.5\nc d,1.5\n")
    (tmp_path / "validation.csv").write_text("text,score\na b,high\n")
    with pytest.raises(ValueError, match=r"validation file '.*validation.csv' does not fit the columns of the train "):
        load_raw_datasets(
            train_file=str(tmp_path / "train.csv"),
            validation_file=str(tmp_path / "validation.csv"),
            cache_dir=str(tmp_path),
        )


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"text": "a"}, {"text": None}], "has 1 empty cell"),
        ([{"text": 1}, {"text": 2}], "holds Value\\('int64'\\), not text"),
        ([{"text": ["a"]}, {"text": ["b"]}], "not text"),
    ],
)
def test_a_text_column_without_text_is_named(rows, message) -> None:
    """Empty cells (a CSV's empty field, a JSON null), numbers and lists failed inside tokenizer training or
    `datasets.map`."""
    with pytest.raises(ValueError, match=message):
        check_text_columns(Dataset.from_list(rows), "text", split="train")
    check_text_columns(Dataset.from_list([{"text": "a"}]), "text")


def test_text_column_nulls_are_counted_in_the_split_alone() -> None:
    """A split or a limit is an index over the whole table: nulls outside it are not the split's."""
    rows = Dataset.from_list([{"text": "a"}, {"text": None}, {"text": "b"}])
    check_text_columns(rows.select([0, 2]), "text")
    with pytest.raises(ValueError, match="validation split has 1 empty cell"):
        check_text_columns(rows.select([1, 2]), "text", split="validation")
