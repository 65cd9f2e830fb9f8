"""Shared test setup. Without a CUDA GPU the Triton kernels run in Triton's interpreter, which
must be selected before triton (or the kernels) is first imported, hence at module top."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
