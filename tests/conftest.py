"""Shared test setup. Without a CUDA GPU the Triton kernels run in Triton's interpreter, which
must be selected before triton (or the kernels) is first imported, hence at module top."""
import os
import sys
from pathlib import Path

# kernels/ at the repository root is installed as vllm_nvfp4kv.kernels. `python -m pytest` puts
# the current directory first on sys.path, where it would shadow Hugging Face's `kernels`
# package, which transformers >= 5 imports (ImportError: cannot import name 'CUDAProperties').
# The tests use the installed package only; subprocesses they start get the same (-P).
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
os.environ.setdefault("PYTHONSAFEPATH", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _keep_default_dtype():
    """torch's default dtype as each test found it: vLLM sets it to the model's while an
    engine starts and leaves it there when the start fails (test_reliability's refused
    engines), and later tests make their expectations in the default dtype."""
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
