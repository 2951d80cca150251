"""Fixtures and pytest hooks: deterministic seeds, no network. What tests share otherwise is in helpers.py."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # marks that transformers' common model tests (test_transformers_common.py) put on some of their tests
    for mark in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test"):
        config.addinivalue_line("markers", f"{mark}: set by transformers' common model tests")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
