"""NVFP4 KV-cache kernels (Triton) and their plain-torch references. Imports no vLLM.

Installed as ``vllm_nvfp4kv.kernels``. The page format is defined in ``format``; every kernel
module has its oracle in ``reference``.
"""
from .cache_write import write_cache
from .decode import choose_num_splits, decode_attention
from .format import PageLayout, kv_cache_shape, page_bytes, row_bytes
from .gather import gather_cache, put_rows

__all__ = ["write_cache", "gather_cache", "put_rows", "decode_attention", "choose_num_splits",
           "PageLayout", "kv_cache_shape", "page_bytes", "row_bytes"]
