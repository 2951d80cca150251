"""scripts/ablate.py: a few steps of two variants produce the table, the JSON and the plot; bad flags are refused."""

import json

import pytest

from archlab import DecoderConfig
from archlab.scripts import ablate
from archlab.training.ablation_variants import VARIANTS, base_config


def test_tiny_ablation_writes_table_json_and_plot(tmp_path):
    results = ablate.main(
        [
            "--output_dir",
            str(tmp_path),
            "--variants",
            "baseline,mqa,learned_positions",
            "--steps",
            "3",
            "--warmup_steps",
            "1",
            "--batch_size",
            "2",
            "--seq_len",
            "16",
            "--hidden_size",
            "32",
            "--layers",
            "2",
            "--decode_tokens",
            "4",
            "--corpus_bytes",
            "200000",
        ]
    )
    assert [r["name"] for r in results] == ["baseline", "mqa", "learned_positions"]
    table = (tmp_path / "ablations.md").read_text()
    assert "| baseline |" in table and "| mqa |" in table and "loss on 16..32" in table
    assert (tmp_path / "loss_curves.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["results"]) == 3 and len(saved["results"][0]["loss_curve"]) == 3
    baseline, mqa = results[0], results[1]
    assert mqa["kv_bytes_per_token"] * 4 == baseline["kv_bytes_per_token"]  # 1 KV head instead of 4
    assert baseline["kv_bytes_per_token"] == 2 * 2 * 4 * 8 * 4  # K and V x layers x heads x head_dim x fp32


def test_olmo2_rows_run_with_their_norms(tmp_path):
    """The output-norm and projection-wide QK-norm rows train: output norms replace the input norms one for one, the
    projection's gains add heads x head_dim = hidden for q and for k in every layer."""
    tiny = ["--steps", "2", "--warmup_steps", "1", "--batch_size", "2", "--seq_len", "16", "--hidden_size", "32"]
    tiny += ["--layers", "2", "--decode_tokens", "4", "--corpus_bytes", "200000", "--output_dir", str(tmp_path)]
    results = ablate.main(["--variants", "baseline,output_norm,qk_norm_over_projection", *tiny])
    baseline, output_norm, qk_norm = results
    assert output_norm["parameters"] == baseline["parameters"]
    assert output_norm["loss_curve"][0] != baseline["loss_curve"][0]  # same weights, the norms elsewhere
    assert qk_norm["parameters"] == baseline["parameters"] + 2 * 2 * 32
    assert "| output_norm |" in (tmp_path / "ablations.md").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variants", "baseline,nope"], "unknown"),
        (["--steps", "0"], "--steps"),
        (["--warmup_steps", "400"], "--warmup_steps"),
        (["--hidden_size", "30"], "--hidden_size"),
        (["--hidden_size", "12"], "--hidden_size must be a multiple of 8"),  # RoPE needs an even head size
        (["--corpus_bytes", "10"], "--corpus_bytes must be at least"),  # an empty validation split
        (["--lr", "-0.1"], "--lr must be > 0"),
        (["--lr", "inf"], "--lr must be > 0 and finite, got inf"),  # trained NaN models
        (["--output_dir", ""], "--output_dir is an empty string"),  # wrote the results into the current folder
        (["--dataset_name", ""], "--dataset_name is an empty string"),
        (["--corpus_bytes", "0"], "--corpus_bytes must be a positive integer"),
        # past the position table (4 x --seq_len): learned positions failed after training, at the timed decode
        (["--seq_len", "16"], "--decode_tokens 64 after a 17-byte prompt runs past the models' 64 positions"),
        (["--seq_len", "128", "--decode_tokens", "481"], "use --decode_tokens <= 480"),
    ],
)
def test_bad_flags_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        ablate.parse_args(argv)
    assert message in capsys.readouterr().err


def test_an_output_dir_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "results").write_text("")
    with pytest.raises(SystemExit):
        ablate.parse_args(["--output_dir", str(tmp_path / "results")])
    assert "is a file, not a folder" in capsys.readouterr().err


def test_a_run_whose_data_cannot_load_leaves_no_folder(tmp_path):
    # (datasets' FileNotFoundError, a traceback under the command line)
    with pytest.raises(ValueError, match="--dataset_name '.*nowhere' could not be loaded \\(FileNotFoundError"):
        ablate.main(["--output_dir", str(tmp_path / "out"), "--dataset_name", str(tmp_path / "nowhere")])
    assert not (tmp_path / "out").exists()


def test_a_missing_text_column_is_named(tmp_path):
    """A KeyError from the first row, before."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"content": "a b c"}\n')
    argv = ["--output_dir", str(tmp_path / "out"), "--dataset_name", str(tmp_path / "data"), "--text_column", "text"]
    message = "--text_column 'text' is not a column of --dataset_name .*; its columns: content"
    with pytest.raises(ValueError, match=message):
        ablate.main(argv)
    assert not (tmp_path / "out").exists()


def test_every_variant_is_a_valid_config():
    args = ablate.parse_args([])
    for name, variant in VARIANTS.items():
        config = DecoderConfig(**{**base_config(args), **variant.config})
        assert config.vocab_size == 256, name
    gated, plain = (DecoderConfig(**{**base_config(args), **VARIANTS[n].config}) for n in ("baseline", "gelu_mlp"))
    assert 3 * gated.intermediate_size == pytest.approx(2 * plain.intermediate_size, rel=0.03)  # equal parameters


def test_the_kv_cache_is_read_without_transformers_deprecation_notice(monkeypatch):
    """The KV-bytes column read `output.past_key_values`, which transformers 5.24 answers with a "`past_key_values`
    ... deprecated" line in every ablation's output; the cache is read under the installed release's name."""
    import torch
    from transformers.utils import generic

    from archlab import DecoderForCausalLM
    from archlab.training.ablation import kv_cache_bytes_per_token

    from helpers import tiny_decoder_config

    logged = []
    monkeypatch.setattr(generic.logger, "warning_once", logged.append)
    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    config = model.config
    per_token = kv_cache_bytes_per_token(model, torch.randint(3, config.vocab_size, (1, 6)))
    assert per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert logged == []
