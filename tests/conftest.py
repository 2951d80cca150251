"""Shared fixtures: tiny configs, deterministic seeds, no network."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

import archlab

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def pytest_configure(config: pytest.Config) -> None:
    # marks that transformers' common model tests (test_transformers_common.py) put on some of their tests
    for mark in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test"):
        config.addinivalue_line("markers", f"{mark}: set by transformers' common model tests")


def tiny_decoder_config(**overrides) -> archlab.DecoderConfig:
    return archlab.DecoderConfig(**{**TINY, **overrides})


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tiny_config() -> archlab.DecoderConfig:
    return tiny_decoder_config()


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4, msg: str = "") -> None:
    """Every element of `actual` within `rtol` x max|expected| of `expected`.

    The rounding error of a float32 sum follows the size of its largest terms, not of its result, and its exact value
    follows the CPU's summation order (AVX2 and AVX-512 kernels differ): a fixed absolute or an element-wise relative
    tolerance fails the small entries of a tensor with large ones (a gradient of 1e-3 next to one of 3) on some hosts.
    The default is the fp32 logit-parity standard (1e-4 on logits of order 1) taken relative to the scale."""
    expected = expected.detach()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.detach(), expected, rtol=0.0, atol=rtol * scale,
        msg=lambda text: f"{msg + ': ' if msg else ''}{text} (allowed: {rtol:g} x max|expected| {scale:.3g})",
    )


def seq2seq_incremental_logits(model, source, mask, target, prefix: int = 1) -> torch.Tensor:
    """Decoder logits for `target` computed with the cache: the first `prefix` tokens in one call (which also runs
    the encoder), then one token per call reusing the encoder output; to compare with one full forward."""
    with torch.no_grad():
        step = model(input_ids=source, attention_mask=mask, decoder_input_ids=target[:, :prefix], use_cache=True)
        logits, cache = [step.logits], step.past_key_values
        for t in range(prefix, target.shape[1]):
            step = model(
                encoder_outputs=(step.encoder_last_hidden_state,), attention_mask=mask,
                decoder_input_ids=target[:, t : t + 1], past_key_values=cache, use_cache=True,
            )
            logits.append(step.logits)
            cache = step.past_key_values
    return torch.cat(logits, 1)
