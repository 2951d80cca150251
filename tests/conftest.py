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


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the marks added here count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test parametrized with a CUDA `device` is a `gpu` test too; `gpu` tests skip where torch sees no CUDA device
    (CI, the development machines)."""
    for item in items:
        device = getattr(item, "callspec", None) and item.callspec.params.get("device")
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
            item.add_marker(pytest.mark.gpu)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
