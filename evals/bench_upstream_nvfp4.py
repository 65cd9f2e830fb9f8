"""Which NVFP4 KV path should serve Hopper on vLLM >= 0.32: upstream's FlashInfer path or ours.

vLLM 0.33.0 serves ``--kv-cache-dtype nvfp4`` on SM80/SM90/SM120 through FlashInfer 0.7.2.post1's
FA2 template (software dequantization). This script times, in one process on one GPU and for
the same K/V, what vLLM 0.33 runs on an H100/H200 against our kernels:

* decode: ``vllm_nvfp4kv.kernels.decode_attention`` on our pages vs FlashInfer's
  ``BatchDecodeWithPagedKVCacheWrapper`` exactly as vLLM 0.33 builds, plans and runs it for
  nvfp4 (``vllm/v1/attention/backends/flashinfer.py`` of 0.33.0: ``_get_decode_wrapper``
  use_cuda_graph=True, use_tensor_cores=True, backend "auto" -> fa2; ``fast_plan_decode`` ->
  ``plan(kv_data_type=torch.uint8, q/o bf16, fixed_split_size=-1, disable_split_kv=False)``;
  ``run(q, (k_data, v_data), q_scale=1.0, k_scale, v_scale, kv_cache_sf=(k_sf, v_sf))``), with
  FlashInfer FP8 and BF16 decode through the same wrapper (fa2 as well) and vLLM 0.26's
  FlashAttention-3 FP8/BF16 (what vLLM serves FP8 with on Hopper) where it imports.
* chunked prefill: a query chunk over a cached prefix, FlashInfer's paged NVFP4 prefill
  (``BatchPrefillWithPagedKVCacheWrapper`` "auto" -> fa2, causal, over pages that already hold
  the chunk) vs ours (``vllm_nvfp4kv.prefill.run_prefill``: one gather-dequant launch of the
  prefix into a BF16 workspace, the chunk's exact K/V put after it, one varlen attention).
  Ours attends with vLLM's FA3 where vLLM imports, else with FlashInfer's FA3 ragged kernel
  (``attn`` says which), and the cache writers of both paths for the chunk are timed too.

FlashInfer pages are built as vLLM 0.33 lays them out on SM90 (kv-cache layout LBNHC = NHD):
the uint8 page [2*H, N, D/2 + D/16] is split by side, each side [data N x H x D/2 | scales
N x H x D/16] (``_nvfp4_kv_views``, ``nvfp4_split_data_scale``); data bytes hold element 2i in
the low nibble, scales are linear (one E4M3 byte per 16 elements, no swizzle). They are written
by FlashInfer's own writer (``nvfp4_quantize_append_paged_kv_cache_with_slot_mapping``, what
vLLM 0.33 calls on SM90; a plain CUDA kernel) where its module loads, else by ``fi_write``
here (its torch twin, amax / 6 rule). Our pages use the same amax / 6 rule: both caches hold the
same 4-bit values. Every kernel is checked against torch attention over the K/V its cache
holds before anything is timed.

Decode timings are medians of CUDA-graph replays (as bench_decode); prefill timings medians of
eager calls (vLLM runs prefill attention outside CUDA graphs). Writes JSON and a PNG, prints a
table last. Run on the GPU with the prebuilt FlashInfer kit (evals/fi_kit.sh, evals/gpu_fi.sh):

    python -P -m evals.bench_upstream_nvfp4 --out evals/results/upstream_nvfp4_h100.json
    python -P -m evals.bench_upstream_nvfp4 --dims 256 --no-prefill --out ...
    python -P -m evals.bench_upstream_nvfp4 --build-fi-modules DIR   # CPU + nvcc: the kit's .so
    python -P -m evals.bench_upstream_nvfp4 --join A.json B.json --out AB.json.gz  # one figure
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import time

import torch
import triton

from evals import common
from evals.bench_decode import Problem, copy_bandwidth, fa3_fn, run_nvfp4, time_fn
from vllm_nvfp4kv.kernels import format as fmt
from vllm_nvfp4kv.kernels import kv_cache_shape, put_rows, reference, write_cache

FI_VERSION = "0.7.2.post1"  # what vLLM 0.33.0 pins
# vLLM 0.33 refuses NVFP4 at head_size 64 on SM8x/9x/12x ("fa2 prefill misreads an NVFP4 KV
# cache at head_size 64", flashinfer.py supports_combination and the metadata builder)
FI_NVFP4_HEAD_DIMS = (128, 256)
FORMATS = ("nvfp4", "fp8", "bf16")
CHECK_LENS = (1000, 37, 517)    # the decode checks' sequence lengths (partial last pages)
CHECK_PREFILL = (2, 200, 64)    # the prefill check's batch, prefix and chunk


def bytes_per_token_head(name: str, d: int) -> int:
    """KV cache bytes of one token and KV head, K and V, scales included (ours and FlashInfer's
    NVFP4 alike: D/2 data + D/16 E4M3 scales per side; the FP32 global scale is per layer)."""
    return {"nvfp4": 2 * fmt.row_bytes(d), "fp8": 2 * d, "bf16": 4 * d}[name]


# ------------------------------------------------------------------ FlashInfer's NVFP4 pages
def fi_cache(num_blocks: int, page: int, hkv: int, d: int, layout: str = "NHD",
             device="cpu") -> torch.Tensor:
    """An NVFP4 cache as vLLM 0.33 allocates it for FlashInfer: logical [blocks, 2*Hkv, N,
    D/2 + D/16] uint8 (``customize_spec``), memory order [blocks, N, 2*Hkv, F] for NHD (the
    default LBNHC layout on SM90) or [blocks, 2*Hkv, N, F] for HND."""
    f = fmt.row_bytes(d)
    if layout == "HND":
        return torch.empty(num_blocks, 2 * hkv, page, f, dtype=torch.uint8, device=device)
    assert layout == "NHD", layout
    return torch.empty(num_blocks, page, 2 * hkv, f, dtype=torch.uint8,
                       device=device).permute(0, 2, 1, 3)


def fi_views(kv_cache: torch.Tensor, hkv: int):
    """((k_data, v_data), (k_sf, v_sf), layout) of a FlashInfer NVFP4 cache, as vLLM 0.33's
    ``_nvfp4_kv_views`` + ``nvfp4_split_data_scale`` make them: each side (K at byte 0 of the
    page, V at half) is [data | scales]; data [blocks, N, H, D/2] uint8 (NHD; [blocks, H, N, D/2]
    for HND), scales alike with D/16 float8_e4m3fn bytes per row."""
    nb, slots, n, f = kv_cache.shape
    hnd = kv_cache.stride()[1:] == (n * f, f, 1)
    if not hnd and kv_cache.stride()[1:] != (f, slots * f, 1):
        raise ValueError(f"NVFP4 KV pages must be dense, got {kv_cache.stride()}")
    dims = (hkv, n) if hnd else (n, hkv)
    data_dim = f * 8 // 9
    scale_dim = f - data_dim
    side = hkv * n * f
    data, scales = [], []
    for s in range(2):
        base = kv_cache.storage_offset() + s * side
        data.append(torch.as_strided(kv_cache, (nb, *dims, data_dim),
                                     (kv_cache.stride(0), dims[1] * data_dim, data_dim, 1), base))
        scales.append(torch.as_strided(kv_cache, (nb, *dims, scale_dim),
                                       (kv_cache.stride(0), dims[1] * scale_dim, scale_dim, 1),
                                       base + hkv * n * data_dim).view(torch.float8_e4m3fn))
    return tuple(data), tuple(scales), "HND" if hnd else "NHD"


def fi_quantize(x: torch.Tensor, global_scale: float | torch.Tensor = 1.0):
    """x [..., D] -> (data [..., D/2] uint8, scales [..., D/16] uint8) as FlashInfer's writer
    (``nvfp4_append_quantize_block``, include/flashinfer/page.cuh) computes them: scale =
    e4m3(amax / (6 g)), codes of x / (scale g) rounded to nearest even, sign bit wherever the
    product's sign bit is set (-0 included), element 2i in the low nibble of byte i."""
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    xb = x.float().unflatten(-1, (-1, fmt.GROUP_SIZE))
    amax = torch.nan_to_num(xb.abs(), nan=0.0).amax(-1, keepdim=True)
    ok = (amax > 0) & (g > 0)
    s = reference.e4m3_encode(torch.where(ok, amax / (6.0 * g), torch.zeros_like(amax)))
    sr = reference.e4m3_decode(s)
    inv = torch.where(ok & (sr > 0), 1.0 / (sr * g), torch.zeros_like(sr))
    y = xb * inv
    code = (reference.e2m1_encode(y) & 7) | (torch.signbit(y).to(torch.uint8) << 3)
    code = code.flatten(-2)
    return code[..., 0::2] | (code[..., 1::2] << 4), s.squeeze(-1)


def fi_dequantize(data: torch.Tensor, scales: torch.Tensor,
                  global_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """(data [..., D/2], scales [..., D/16] uint8 or float8_e4m3fn) -> fp32 [..., D]: what the
    FA2 kernel multiplies out (e2m1 x e4m3, exact in BF16; the global scale folded into
    sm_scale for K and into the output for V)."""
    code = torch.stack((data & 15, data >> 4), dim=-1).flatten(-2)
    return reference.dequantize_codes(code, scales.view(torch.uint8), global_scale)


def fi_write(kv_cache: torch.Tensor, hkv: int, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale=1.0, v_scale=1.0) -> None:
    """Quantize key/value [T, Hkv, D] into a FlashInfer NVFP4 cache at slot_mapping [T] (slots
    < 0 skipped): the torch twin of nvfp4_quantize_append_paged_kv_cache_with_slot_mapping."""
    (kd, vd), (ks, vs), layout = fi_views(kv_cache, hkv)
    n = kv_cache.shape[2]
    keep = slot_mapping >= 0
    blk, off = slot_mapping[keep] // n, slot_mapping[keep] % n
    for dv, sv, x, g in ((kd, ks, key, k_scale), (vd, vs, value, v_scale)):
        data, scales = fi_quantize(x[:slot_mapping.shape[0]][keep], g)
        sv = sv.view(torch.uint8)
        if layout == "NHD":
            dv[blk, off], sv[blk, off] = data, scales
        else:
            dv[blk, :, off], sv[blk, :, off] = data, scales


def fi_read(kv_cache: torch.Tensor, hkv: int, blk: torch.Tensor, off: torch.Tensor,
            k_scale=1.0, v_scale=1.0):
    """Tokens at (page blk, token-in-page off) [T] -> dequantized fp32 (k, v) [T, Hkv, D]."""
    (kd, vd), (ks, vs), layout = fi_views(kv_cache, hkv)
    if layout == "NHD":
        return (fi_dequantize(kd[blk, off], ks[blk, off], k_scale),
                fi_dequantize(vd[blk, off], vs[blk, off], v_scale))
    return (fi_dequantize(kd[blk, :, off], ks[blk, :, off], k_scale),
            fi_dequantize(vd[blk, :, off], vs[blk, :, off], v_scale))


def paged_reference(q: torch.Tensor, read, block_table: torch.Tensor, cu_q: list[int],
                    seq_lens: list[int], page: int, scale: float,
                    exact_tail: tuple | None = None) -> torch.Tensor:
    """Causal torch attention (fp32) of q [T, Hq, D] over the tokens read(blk, off) -> (k, v)
    returns for each sequence (rows cu_q[b]:cu_q[b+1] are its last tokens). exact_tail: (key,
    value) [T, Hkv, D] that replace the last rows' cached K/V (our prefill attends the chunk's
    exact K/V)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, s_len in enumerate(seq_lens):
        q0, q1 = cu_q[b], cu_q[b + 1]
        pos = torch.arange(s_len, device=q.device)
        k, v = read(block_table[b, pos // page].long(), pos % page)
        if exact_tail is not None:
            k[s_len - (q1 - q0):], v[s_len - (q1 - q0):] = (x[q0:q1].float() for x in exact_tail)
        qpos = torch.arange(s_len - (q1 - q0), s_len, device=q.device)
        out[q0:q1] = reference.attention(q[q0:q1], k, v, scale, qpos)
    return out


# ------------------------------------------------------------------ FlashInfer's JIT modules
def fi_module_specs(dims=FI_NVFP4_HEAD_DIMS, fa3_dims=(128,), page_module: bool = True) -> list:
    """The FlashInfer JIT modules this benchmark loads at these head dims (bf16 queries and
    outputs, int32 indices, no RoPE / window / soft-cap): the FA2 batch-prefill template that
    the decode (use_tensor_cores) and paged-prefill wrappers run, for NVFP4 (uint8), FP8 and
    BF16 KV with equal K/V strides; at fa3_dims (the prefill's head dims) FA3 BF16 (our
    prefill's stand-in for vLLM's FA3, and FlashInfer's own BF16 paged prefill on Hopper);
    and the page module (the NVFP4 writer)."""
    from flashinfer.jit.attention.modules import (_gen_batch_prefill_primary_module,
                                                  gen_batch_prefill_module)
    from flashinfer.jit.page import gen_page_module
    bf16 = torch.bfloat16
    specs = [gen_page_module()] if page_module else []
    for d in dims:
        args = (d, d, 0, False, False, False)
        specs += [_gen_batch_prefill_primary_module("fa2", bf16, kv, bf16, torch.int32, *args)
                  for kv in (torch.uint8, torch.float8_e4m3fn, bf16)]
        if d in fa3_dims:
            specs.append(gen_batch_prefill_module("fa3", bf16, bf16, bf16, torch.int32, *args))
    return specs


def build_fi_modules(out_dir: str, dims) -> None:
    """Compile fi_module_specs with nvcc here (FLASHINFER_CUDA_ARCH_LIST, CUDA_HOME set by
    evals/fi_kit.sh) and copy each .so to out_dir/NAME/NAME.so, where FlashInfer loads a module
    without compiling it (its AOT folder, flashinfer/data/aot)."""
    import shutil
    for spec in fi_module_specs(dims):
        t = time.time()
        spec.build(verbose=False)
        dst = os.path.join(out_dir, spec.name)
        os.makedirs(dst, exist_ok=True)
        shutil.copy2(spec.jit_library_path, os.path.join(dst, spec.name + ".so"))
        print(f"{time.time() - t:7.1f} s  {spec.jit_library_path.stat().st_size / 2**20:5.1f} "
              f"MiB  {spec.name}", flush=True)


def fi_module_status(dims, fa3_dims=(128,)) -> dict:
    """{module name: 'prebuilt' | 'jit'}: whether FlashInfer will load it without nvcc."""
    return {s.name: "prebuilt" if s.is_aot else "jit" for s in fi_module_specs(dims, fa3_dims)}


def fi_writer():
    """FlashInfer's NVFP4 KV writer (vLLM 0.33's on SM90), or None where its module fails."""
    try:
        from flashinfer import nvfp4_quantize_append_paged_kv_cache_with_slot_mapping as w
        from flashinfer.page import get_page_module
        get_page_module()
        return w
    except Exception as e:  # noqa: BLE001 (the torch twin fills the pages instead)
        print("FlashInfer's NVFP4 writer unavailable:", type(e).__name__, e, flush=True)
        return None


def fi_workspace(args, device) -> torch.Tensor:
    """vLLM 0.33's FlashInfer workspace: max(394 MiB, max_num_batched_tokens * Hq * D * 16)."""
    size = max(394 << 20, args.max_num_batched_tokens * args.hq * max(args.dims) * 16)
    return torch.zeros(size, dtype=torch.uint8, device=device)


# ------------------------------------------------------------------ caches for one problem
def kv_chunks(p: Problem, seed: int, chunk: int = 1 << 20):
    """Every slot's K/V in chunks of slots: (first slot, k, v) [n, Hkv, D] bf16. Seeded per
    chunk, so each format's cache is filled with the same values."""
    total = p.num_blocks * p.page
    for s in range(0, total, chunk):
        n = min(chunk, total - s)
        g = torch.Generator(device=p.device).manual_seed(seed + s)
        yield s, *(torch.randn(n, p.hkv, p.d, generator=g, dtype=torch.bfloat16,
                               device=p.device) for _ in range(2))


def our_cache(p: Problem, seed: int) -> torch.Tensor:
    cache = torch.empty(kv_cache_shape(p.num_blocks, p.page, p.hkv, p.d), dtype=torch.uint8,
                        device=p.device)
    for s, k, v in kv_chunks(p, seed):
        write_cache(cache, k, v, torch.arange(s, s + k.shape[0], device=p.device), 1.0, 1.0,
                    block_scales="amax6")
    return cache


def fi_nvfp4_cache(p: Problem, seed: int, writer, layout: str = "NHD") -> torch.Tensor:
    cache = fi_cache(p.num_blocks, p.page, p.hkv, p.d, layout, p.device)
    data, scales, _ = fi_views(cache, p.hkv)
    for s, k, v in kv_chunks(p, seed, 1 << 18):
        slots = torch.arange(s, s + k.shape[0], device=p.device)
        if writer is not None:
            writer(k, v, slots, data, scales, 1.0, 1.0, kv_layout=layout)
        else:
            fi_write(cache, p.hkv, k, v, slots)
    return cache


def dense_cache(p: Problem, seed: int, dtype: torch.dtype):
    """(k, v) [blocks, N, Hkv, D] in dtype (FlashInfer NHD and FA3's paged layout)."""
    k, v = (torch.empty(p.num_blocks, p.page, p.hkv, p.d, dtype=dtype, device=p.device)
            for _ in range(2))
    for s, kc, vc in kv_chunks(p, seed):
        k.view(-1, p.hkv, p.d)[s:s + kc.shape[0]] = kc.to(dtype)
        v.view(-1, p.hkv, p.d)[s:s + vc.shape[0]] = vc.to(dtype)
    return k, v


def page_table(block_table: torch.Tensor, seq_lens: list[int], page: int):
    """FlashInfer's CSR page table of a block table: (indptr, indices, last_page_len), indptr
    and last_page_len on the host (as vLLM plans them), indices on the device."""
    pages = [math.ceil(s / page) for s in seq_lens]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.cat([block_table[b, :n] for b, n in enumerate(pages)]).to(torch.int32)
    last = torch.tensor([s - (n - 1) * page for s, n in zip(seq_lens, pages)], dtype=torch.int32)
    return indptr, indices, last


def fi_decode_fn(p: Problem, kv, kv_dtype: torch.dtype, workspace, sf=None,
                 layout: str = "NHD", seq_lens: list[int] | None = None):
    """FlashInfer paged decode as vLLM 0.33 runs it (flashinfer.py _get_decode_wrapper,
    fast_plan_decode's first-call plan, FlashInferImpl.forward): a CUDA-graph wrapper with
    tensor cores and backend "auto", planned once, run with the views of the cache."""
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper
    seq_lens = seq_lens or [p.ctx] * p.batch
    indptr, indices, last = page_table(p.block_table, seq_lens, p.page)
    b, dev = p.batch, p.device
    w = BatchDecodeWithPagedKVCacheWrapper(
        workspace, layout, use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.empty(b + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buffer=torch.empty(indices.numel(), dtype=torch.int32, device=dev),
        paged_kv_last_page_len_buffer=torch.empty(b, dtype=torch.int32, device=dev),
        use_tensor_cores=True, backend="auto")
    w.plan(indptr=indptr, indices=indices, last_page_len=last, num_qo_heads=p.hq,
           num_kv_heads=p.hkv, head_dim=p.d, page_size=p.page, pos_encoding_mode="NONE",
           sm_scale=p.scale, window_left=-1, logits_soft_cap=None,
           q_data_type=torch.bfloat16, kv_data_type=kv_dtype, o_data_type=torch.bfloat16,
           non_blocking=True, block_tables=None,
           seq_lens=torch.tensor(seq_lens, dtype=torch.int32), fixed_split_size=-1,
           disable_split_kv=False, q_len_per_req=1)
    out = torch.empty_like(p.q)
    return lambda: w.run(p.q, kv, q_scale=1.0, k_scale=1.0, v_scale=1.0, out=out,
                         kv_cache_sf=sf, sinks=None), out, w


def have_vllm_fa3() -> bool:
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: F401
        return True
    except Exception as e:  # noqa: BLE001
        print("no vLLM FA3:", type(e).__name__, e, flush=True)
        return False


# ------------------------------------------------------------------ checks
def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max(1, max |ref|)."""
    return (out.float() - ref).abs().max().item() / max(1.0, ref.abs().max().item())


def check_decode(args, d: int, device, workspace, writer, fa3: bool) -> dict:
    """Every decode kernel against torch attention over the K/V its cache holds, at uneven
    lengths (partial last pages): max error relative to max(1, |ref|)."""
    lens = list(CHECK_LENS)
    p = Problem(len(lens), max(lens), args.hq, args.hkv, d, args.page, device)
    p.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    cu = list(range(p.batch + 1))
    errs = {}
    ours = our_cache(p, seed=1)
    read = lambda blk, off: reference.dequantize_rows(ours, blk, off, d, 1.0, 1.0)  # noqa: E731
    ref = paged_reference(p.q, read, p.block_table, cu, lens, p.page, p.scale)
    out = torch.empty_like(p.q)
    run_nvfp4(p, ours, out)()
    errs["ours"] = rel_err(out, ref)
    for layout in args.fi_layouts:
        fi = fi_nvfp4_cache(p, 1, writer, layout)
        tok = torch.arange(p.num_blocks * p.page, device=device)
        fk, fv = fi_read(fi, p.hkv, tok // p.page, tok % p.page)
        ok, ov = reference.dequantize_rows(ours, tok // p.page, tok % p.page, d, 1.0, 1.0)
        # the same 4-bit values in both caches (FlashInfer's writer may round a tie otherwise)
        diff = torch.cat(((fk - ok).abs(), (fv - ov).abs()))
        errs[f"pages_ours_vs_fi_{layout}_values_differing"] = (diff > 0).float().mean().item()
        fread = lambda blk, off: fi_read(fi, p.hkv, blk, off)  # noqa: E731
        fref = paged_reference(p.q, fread, p.block_table, cu, lens, p.page, p.scale)
        data, sf, _ = fi_views(fi, p.hkv)
        attempt(errs, f"fi_nvfp4_{layout}", lambda: rel_err(
            fi_decode_fn(p, data, torch.uint8, workspace, sf, layout, lens)[0](), fref))
    for name, dt in (("fp8", torch.float8_e4m3fn), ("bf16", torch.bfloat16)):
        k, v = dense_cache(p, 1, dt)
        dread = lambda blk, off: (k[blk, off].float(), v[blk, off].float())  # noqa: E731
        dref = paged_reference(p.q, dread, p.block_table, cu, lens, p.page, p.scale)
        attempt(errs, f"fi_{name}", lambda: rel_err(
            fi_decode_fn(p, (k, v), dt, workspace, None, "NHD", lens)[0](), dref))
        if fa3:  # FA3 FP8 takes q in E4M3 too (bench_decode.fa3_fn): so does its reference
            ref8 = dref if name == "bf16" else paged_reference(
                p.q.to(dt).to(torch.bfloat16), dread, p.block_table, cu, lens, p.page, p.scale)
            attempt(errs, f"fa3_{name}", lambda: rel_err(
                fa3_fn(p, k, v, name == "fp8")(), ref8))
    return errs


def attempt(errs: dict, key: str, fn) -> None:
    """errs[key] = fn(), or the exception's text (a failed check; the run goes on)."""
    try:
        errs[key] = fn()
    except Exception as e:  # noqa: BLE001
        errs[key] = f"{type(e).__name__}: {e}"[:300]
        print(f"check {key} raised:", errs[key], flush=True)


def check_fi_writer(args, device, writer) -> dict:
    """FlashInfer's writer against fi_write (its torch twin) on the same K/V: the fraction of
    page bytes that differ (a fast-math division may round a tie the other way) and the largest
    difference of the values they decode to."""
    p = Problem(2, max(CHECK_LENS), args.hq, args.hkv, 128, args.page, device)
    res = {}
    for layout in args.fi_layouts:
        a, b = fi_nvfp4_cache(p, 3, writer, layout), fi_nvfp4_cache(p, 3, None, layout)
        tok = torch.arange(p.num_blocks * p.page, device=device)
        da = torch.cat(fi_read(a, p.hkv, tok // p.page, tok % p.page))
        db = torch.cat(fi_read(b, p.hkv, tok // p.page, tok % p.page))
        res[f"fi_writer_vs_twin_{layout}_bytes_differing"] = (a != b).float().mean().item()
        res[f"fi_writer_vs_twin_{layout}_max_value_diff"] = (da - db).abs().max().item()
    return res


def failed_checks(checks: dict, tol: float = 2e-2, pages_tol: float = 1e-3) -> list[str]:
    """The checks that failed: a kernel whose error passed tol or that raised (a string), and
    page comparisons where more than pages_tol of the values or bytes differ."""
    bad = []
    for k, v in checks.items():
        if isinstance(v, str):
            bad.append(k)
        elif "differing" in k:
            bad += [k] if v > pages_tol else []
        elif "max_value_diff" not in k and v > tol:
            bad.append(k)
    return bad


# ------------------------------------------------------------------ decode sweep
def decode_rows(args, d: int, device, workspace, writer, fa3: bool, t_end: float,
                on_row=lambda row: None) -> list:
    """One row per (context, batch), handed to on_row as it is done: each kernel's time over its
    own cache of the same K/V (built, timed and freed one at a time)."""
    rows = []
    for ctx in args.ctx:
        for batch in args.batch:
            if time.time() > t_end:
                print(f"budget: skipped D={d} b{batch} ctx {ctx}", flush=True)
                continue
            p = Problem(batch, ctx, args.hq, args.hkv, d, args.page, device)
            row = {"d": d, "batch": batch, "ctx": ctx}
            tokens = batch * ctx * args.hkv
            for name in FORMATS:
                row[f"{name}_kv_bytes"] = tokens * bytes_per_token_head(name, d)
            seed = batch * 7919 + ctx
            if not fits(row["nvfp4_kv_bytes"] * 1.2):
                row["skipped"] = "memory"
                rows.append(row)
                on_row(row)
                continue
            cache = our_cache(p, seed)
            timed(row, "ours", lambda: run_nvfp4(p, cache, torch.empty_like(p.q)), device)
            del cache
            for layout in args.fi_layouts:
                cache = fi_nvfp4_cache(p, seed, writer, layout)
                data, sf, _ = fi_views(cache, p.hkv)
                timed(row, "fi_nvfp4" + ("" if layout == "NHD" else "_hnd"),
                      lambda: fi_decode_fn(p, data, torch.uint8, workspace, sf, layout)[0],
                      device)
                del cache, data, sf
                torch.cuda.empty_cache()
            for name, dt in (("fp8", torch.float8_e4m3fn), ("bf16", torch.bfloat16)):
                if row[f"{name}_kv_bytes"] > args.max_dense_bytes or not fits(
                        row[f"{name}_kv_bytes"] * 1.1):
                    continue
                k, v = dense_cache(p, seed, dt)
                timed(row, f"fi_{name}", lambda: fi_decode_fn(p, (k, v), dt, workspace)[0],
                      device)
                if fa3:
                    timed(row, f"fa3_{name}", lambda: fa3_fn(p, k, v, name == "fp8"), device)
                del k, v
                torch.cuda.empty_cache()
            derive(row)
            rows.append(row)
            on_row(row)
            print(fmt_row(row), flush=True)
    return rows


def timed(row: dict, key: str, make, device) -> None:
    """row[key_us] = the median time of make()'s function (CUDA graphs, bench_decode.time_fn),
    or row[key_error] where building or running it raised (a baseline never stops the sweep)."""
    try:
        row[f"{key}_us"] = 1e3 * time_fn(make(), device)
    except Exception as e:  # noqa: BLE001
        row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"{key} failed at D={row['d']} b{row['batch']} ctx {row['ctx']}:",
              row[f"{key}_error"], flush=True)


def fits(nbytes: float) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes < free


def derive(row: dict) -> None:
    """TB/s of each timing (KV bytes its cache format reads / time) and the speed ratios:
    ours over FlashInfer's NVFP4, each NVFP4 path over the FP8 yardstick (FA3 FP8 where it
    ran, else FlashInfer FP8)."""
    fmt_of = {"ours": "nvfp4", "fi_nvfp4": "nvfp4", "fi_nvfp4_hnd": "nvfp4", "fi_fp8": "fp8",
              "fi_bf16": "bf16", "fa3_fp8": "fp8", "fa3_bf16": "bf16"}
    for k, f in fmt_of.items():
        if f"{k}_us" in row:
            row[f"{k}_TBps"] = row[f"{f}_kv_bytes"] / (row[f"{k}_us"] * 1e-6) / 1e12
    fp8 = row.get("fa3_fp8_us", row.get("fi_fp8_us"))
    row["fp8_yardstick"] = "fa3_fp8" if "fa3_fp8_us" in row else "fi_fp8" if fp8 else None
    if "ours_us" in row and "fi_nvfp4_us" in row:
        row["ours_vs_fi_nvfp4"] = row["fi_nvfp4_us"] / row["ours_us"]
    for k in ("ours", "fi_nvfp4"):
        if fp8 and f"{k}_us" in row:
            row[f"{k}_vs_fp8"] = fp8 / row[f"{k}_us"]


# ------------------------------------------------------------------ chunked prefill
class PrefillProblem:
    """batch sequences, each a cached prefix of `prefix` tokens then a chunk of `chunk` query
    tokens whose K/V the step has already written to the cache (vLLM writes before attending)."""

    def __init__(self, batch, prefix, chunk, hq, hkv, d, page, device, seed=0):
        self.batch, self.prefix, self.chunk = batch, prefix, chunk
        self.hq, self.hkv, self.d, self.page, self.device = hq, hkv, d, page, device
        self.seq = prefix + chunk
        self.blocks_per_seq = math.ceil(self.seq / page)
        self.num_blocks = batch * self.blocks_per_seq
        g = torch.Generator().manual_seed(seed)
        self.block_table = torch.randperm(self.num_blocks, generator=g).view(batch, -1).to(
            torch.int32).to(device)
        self.seq_lens = [self.seq] * batch
        self.cu_q = [b * chunk for b in range(batch + 1)]
        self.scale = d ** -0.5
        t = batch * chunk
        self.q, self.key, self.value = (torch.randn(t, h, d, generator=g).to(torch.bfloat16).to(
            device) for h in (hq, hkv, hkv))
        pos = torch.arange(self.seq)
        self.chunk_slots = torch.cat([self.slots(b, pos[prefix:]) for b in range(batch)])

    def slots(self, b: int, pos: torch.Tensor) -> torch.Tensor:
        return (self.block_table[b, (pos // self.page).to(self.device)].long() * self.page
                + (pos % self.page).to(self.device))

    def fill(self, write) -> None:
        """write(key, value, slots): the prefixes (random, seeded) then the chunks' K/V."""
        g = torch.Generator().manual_seed(1234)
        for b in range(self.batch):
            for s in range(0, self.prefix, 1 << 16):
                n = min(1 << 16, self.prefix - s)
                k, v = (torch.randn(n, self.hkv, self.d, generator=g).to(torch.bfloat16).to(
                    self.device) for _ in range(2))
                write(k, v, self.slots(b, torch.arange(s, s + n)))
        write(self.key, self.value, self.chunk_slots)

    def flops(self) -> float:
        """Causal attention FLOPs (QK^T and PV): 4 Hq D per (query, visible key) pair."""
        pairs = self.chunk * self.prefix + self.chunk * (self.chunk + 1) / 2
        return 4.0 * self.hq * self.d * pairs * self.batch


def fi_prefill_fn(pp: PrefillProblem, kv, kv_dtype, workspace, sf=None, layout="NHD"):
    """FlashInfer's paged prefill as vLLM 0.33 plans and runs it (_get_prefill_wrapper backend
    "auto", causal, q/o bf16; NVFP4 -> fa2, BF16 -> fa3 on Hopper)."""
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper
    indptr, indices, last = page_table(pp.block_table, pp.seq_lens, pp.page)
    w = BatchPrefillWithPagedKVCacheWrapper(workspace, layout, backend="auto")
    w.plan(qo_indptr=torch.tensor(pp.cu_q, dtype=torch.int32), paged_kv_indptr=indptr,
           paged_kv_indices=indices, paged_kv_last_page_len=last,
           seq_lens=torch.tensor(pp.seq_lens, dtype=torch.int32), num_qo_heads=pp.hq,
           num_kv_heads=pp.hkv, head_dim_qk=pp.d, page_size=pp.page, causal=True,
           sm_scale=pp.scale, window_left=-1, logits_soft_cap=None,
           q_data_type=torch.bfloat16, kv_data_type=kv_dtype, o_data_type=torch.bfloat16,
           fixed_split_size=-1, disable_split_kv=False)
    out = torch.empty_like(pp.q)
    return lambda: w.run(pp.q, kv, q_scale=1.0, k_scale=1.0, v_scale=1.0, out=out,
                         kv_cache_sf=sf), out


@contextlib.contextmanager
def fi_fa3_dense_attention(workspace, plan, pp: PrefillProblem):
    """Swap run_prefill's dense_attention for FlashInfer's FA3 ragged prefill (planned here,
    once: the per-layer path only runs it), where vLLM's FA3 does not import."""
    from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

    from vllm_nvfp4kv import prefill
    rnd = plan.rounds[0]
    w = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="auto")
    w.plan(qo_indptr=rnd.cu_q_cpu.to(torch.int32), kv_indptr=rnd.cu_k_cpu.to(torch.int32),
           num_qo_heads=pp.hq, num_kv_heads=pp.hkv, head_dim_qk=pp.d, causal=True,
           sm_scale=pp.scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

    def dense(q, k, v, out, *a, **kw):
        w.run(q, k, v, out=out)

    orig = prefill.dense_attention
    prefill.dense_attention = dense
    try:
        yield w._backend
    finally:
        prefill.dense_attention = orig


def ours_prefill_fn(pp: PrefillProblem, cache, ws, fa_version=3):
    """vllm_nvfp4kv.prefill.run_prefill for the step (planned once, as the metadata builder
    does): gather-dequant of the prefixes into the workspace, the chunks' exact K/V after them,
    one varlen attention (module-level dense_attention)."""
    from vllm_nvfp4kv.ops import AttentionParams
    from vllm_nvfp4kv.prefill import PrefillInputs, plan_prefill, run_prefill
    cu_q = torch.tensor(pp.cu_q)
    plan = plan_prefill(cu_q, torch.tensor(pp.seq_lens), 0, pp.batch, ws[0].shape[0], None,
                        pp.device)
    one = torch.ones(1, dtype=torch.float32, device=pp.device)
    out = torch.empty_like(pp.q)
    inputs = PrefillInputs(pp.q, pp.key, pp.value, out, cache, pp.block_table, ws[0], ws[1],
                           one, one, AttentionParams(pp.scale, fa_version=fa_version))
    return (lambda: run_prefill(plan, inputs)), out, plan


def eager_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def prefill_rows(args, device, workspace, writer, fa3: bool, check_only: bool = False):
    """Prefill rows at each prefix (or, check_only, one small problem: the max errors)."""
    from vllm_nvfp4kv.kernels import gather_cache
    d = args.prefill_d
    problems = ([CHECK_PREFILL] if check_only else
                [(args.prefill_batch, prefix, args.chunk) for prefix in args.prefix])
    rows, errs = [], {}
    for batch, prefix, chunk in problems:
        pp = PrefillProblem(batch, prefix, chunk, args.hq, args.hkv, d, args.page, device)
        row = {"d": d, "batch": batch, "prefix": prefix, "chunk": chunk, "flops": pp.flops()}
        cache = torch.empty(kv_cache_shape(pp.num_blocks, pp.page, pp.hkv, d), dtype=torch.uint8,
                            device=device)
        pp.fill(lambda k, v, s: write_cache(cache, k, v, s, 1.0, 1.0, block_scales="amax6"))
        ws_rows = args.max_num_batched_tokens + 65536  # workspace.workspace_capacity's default
        ws = tuple(torch.empty(max(ws_rows, batch * pp.seq), pp.hkv, d, dtype=torch.bfloat16,
                               device=device) for _ in range(2))
        fn, out, plan = ours_prefill_fn(pp, cache, ws)
        with (contextlib.nullcontext("vllm_fa3") if fa3
              else fi_fa3_dense_attention(workspace, plan, pp)) as attn:
            row["ours_attn"] = attn if fa3 else f"flashinfer_{attn}"
            if check_only:
                read = lambda blk, off: reference.dequantize_rows(  # noqa: E731
                    cache, blk, off, d, 1.0, 1.0)
                ref = paged_reference(pp.q, read, pp.block_table, pp.cu_q, pp.seq_lens,
                                      pp.page, pp.scale, (pp.key, pp.value))
                attempt(errs, "prefill_ours", lambda: (fn(), rel_err(out, ref))[1])
            else:
                attempt(row, "ours_us", lambda: 1e3 * eager_ms(fn))
                rnd = plan.rounds[0]
                gather = lambda: gather_cache(cache, pp.block_table, rnd.cu_ctx,  # noqa: E731
                                              rnd.ctx_starts, ws[0], ws[1], 1.0, 1.0,
                                              rnd.max_ctx, out_starts=rnd.ctx_dst)
                row["ours_gather_us"] = 1e3 * eager_ms(gather)
                put = lambda: (put_rows(pp.key, rnd.chunk_dst, ws[0]),  # noqa: E731
                               put_rows(pp.value, rnd.chunk_dst, ws[1]))
                row["ours_put_us"] = 1e3 * eager_ms(put)
                slots = pp.chunk_slots
                for rule in ("amax6", fmt.DEFAULT_BLOCK_SCALES):
                    row[f"ours_write_{rule}_us"] = 1e3 * eager_ms(
                        lambda r=rule: write_cache(cache, pp.key, pp.value, slots, 1.0, 1.0,
                                                   block_scales=r))
        del cache, ws
        torch.cuda.empty_cache()
        for layout in args.fi_layouts:
            key = "fi_nvfp4" + ("" if layout == "NHD" else "_hnd")
            fi = fi_cache(pp.num_blocks, pp.page, pp.hkv, d, layout, device)
            data, sf, _ = fi_views(fi, pp.hkv)
            def fill(k, v, s):
                if writer is not None:  # vLLM 0.33's writer, else its torch twin
                    writer(k, v, s, data, sf, 1.0, 1.0, kv_layout=layout)
                else:
                    fi_write(fi, pp.hkv, k, v, s)
            pp.fill(fill)
            try:
                fn, out = fi_prefill_fn(pp, data, torch.uint8, workspace, sf, layout)
                if check_only:
                    fn()
                    read = lambda blk, off: fi_read(fi, pp.hkv, blk, off)  # noqa: E731
                    ref = paged_reference(pp.q, read, pp.block_table, pp.cu_q, pp.seq_lens,
                                          pp.page, pp.scale)
                    errs[f"prefill_{key}"] = rel_err(out, ref)
                else:
                    row[f"{key}_us"] = 1e3 * eager_ms(fn)
                    if layout == "NHD":
                        row["fi_write_us"] = 1e3 * eager_ms(lambda: fill(pp.key, pp.value,
                                                                         pp.chunk_slots))
                        row["fi_writer"] = "flashinfer" if writer is not None else "torch twin"
            except Exception as e:  # noqa: BLE001
                (errs if check_only else row)[f"prefill_{key}_error"] = \
                    f"{type(e).__name__}: {e}"[:300]
            del fi, data, sf
            torch.cuda.empty_cache()
        if not check_only:  # the BF16 / FP8 caches' prefill on Hopper, for scale
            k, v = (torch.empty(pp.num_blocks, pp.page, pp.hkv, d, dtype=torch.bfloat16,
                                device=device) for _ in range(2))

            def dense_fill(kc, vc, s):
                k.view(-1, pp.hkv, d)[s] = kc
                v.view(-1, pp.hkv, d)[s] = vc
            pp.fill(dense_fill)
            with contextlib.suppress(Exception):
                fn, _ = fi_prefill_fn(pp, (k, v), torch.bfloat16, workspace)
                row["fi_bf16_us"] = 1e3 * eager_ms(fn)
            if fa3:
                for name in ("bf16", "fp8"):
                    with contextlib.suppress(Exception):
                        row[f"fa3_{name}_us"] = 1e3 * eager_ms(fa3_prefill_fn(pp, k, v,
                                                                              name == "fp8"))
            del k, v
            torch.cuda.empty_cache()
            for key in [x[:-3] for x in row if x.endswith("_us")]:
                if isinstance(row[f"{key}_us"], str):
                    row[f"{key}_error"] = row.pop(f"{key}_us")
                elif "write" not in key and key not in ("ours_gather", "ours_put"):
                    row[f"{key}_TFLOPs"] = pp.flops() / (row[f"{key}_us"] * 1e-6) / 1e12
            if "ours_us" in row and "fi_nvfp4_us" in row:
                row["ours_vs_fi_nvfp4"] = row["fi_nvfp4_us"] / row["ours_us"]
            rows.append(row)
            print(fmt_prefill(row), flush=True)
    return errs if check_only else rows


def fa3_prefill_fn(pp: PrefillProblem, k, v, fp8: bool):
    """vLLM's FlashAttention-3 paged prefill over a BF16 (or FP8: q, K, V in E4M3, unit
    descales) cache: what vLLM serves those caches with on Hopper."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    dev = pp.device
    cu_q = torch.tensor(pp.cu_q, dtype=torch.int32, device=dev)
    seqused = torch.tensor(pp.seq_lens, dtype=torch.int32, device=dev)
    q, desc = pp.q, {}
    if fp8:
        q, k, v = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        one = torch.ones(pp.batch, pp.hkv, dtype=torch.float32, device=dev)
        desc = dict(q_descale=one, k_descale=one, v_descale=one)
    out = torch.empty_like(pp.q)
    return lambda: flash_attn_varlen_func(
        q, k, v, max_seqlen_q=pp.chunk, cu_seqlens_q=cu_q, max_seqlen_k=pp.seq,
        seqused_k=seqused, softmax_scale=pp.scale, causal=True, block_table=pp.block_table,
        out=out, fa_version=3, **desc)


# ------------------------------------------------------------------ report
def fmt_row(r: dict) -> str:
    g = lambda k, f=".1f": format(r[k], f) if k in r else "-"  # noqa: E731
    return (f"D={r['d']} b{r['batch']:<3} ctx {r['ctx'] // 1024:>4}K  ours {g('ours_us')} us"
            f"  FI-nvfp4 {g('fi_nvfp4_us')} us  ours/FI {g('ours_vs_fi_nvfp4', '.2f')}x"
            f"  FP8({r.get('fp8_yardstick')}) x ours {g('ours_vs_fp8', '.2f')}"
            f"  x FI {g('fi_nvfp4_vs_fp8', '.2f')}  TB/s ours {g('ours_TBps', '.2f')}"
            f"  FI {g('fi_nvfp4_TBps', '.2f')}")


def fmt_prefill(r: dict) -> str:
    g = lambda k, f=".0f": format(r[k], f) if k in r else "-"  # noqa: E731
    return (f"prefill b{r['batch']} prefix {r['prefix'] // 1024}K + chunk {r['chunk']}: ours "
            f"{g('ours_us')} us ({r.get('ours_attn')}; gather {g('ours_gather_us')}, put "
            f"{g('ours_put_us')})  FI-nvfp4 {g('fi_nvfp4_us')} us  ours/FI "
            f"{g('ours_vs_fi_nvfp4', '.2f')}x  FI-bf16 {g('fi_bf16_us')}  FA3-bf16 "
            f"{g('fa3_bf16_us')}  FA3-fp8 {g('fa3_fp8_us')}  writers ours "
            f"{g('ours_write_search_us')} / FI {g('fi_write_us')} us")


def print_table(res: dict) -> None:
    print(f"\n{res['gpu']}, FlashInfer {res.get('flashinfer')}, vLLM {res.get('vllm')}, "
          f"heads {res['heads']}, page {res['page']}; decode us (CUDA graphs), KV TB/s")
    print("| D | batch | ctx | ours | FI NVFP4 | ours/FI | FP8 | ours vs FP8 | FI vs FP8 "
          "| ours TB/s | FI TB/s | FI BF16 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["rows"]:
        g = lambda k, f=".1f": format(r[k], f) if k in r else "-"  # noqa: E731
        fp8 = r.get("fa3_fp8_us", r.get("fi_fp8_us"))
        print(f"| {r['d']} | {r['batch']} | {r['ctx'] // 1024}K | {g('ours_us')} | "
              f"{g('fi_nvfp4_us')} | {g('ours_vs_fi_nvfp4', '.2f')} | "
              f"{'-' if fp8 is None else format(fp8, '.1f')} {r.get('fp8_yardstick') or ''} | "
              f"{g('ours_vs_fp8', '.2f')} | {g('fi_nvfp4_vs_fp8', '.2f')} | "
              f"{g('ours_TBps', '.2f')} | {g('fi_nvfp4_TBps', '.2f')} | {g('fi_bf16_us')} |")
    if res.get("prefill_rows"):
        print("\n| prefix + chunk | ours us (attn) | FI NVFP4 us | ours/FI | ours TFLOP/s | "
              "FI TFLOP/s | FA3 BF16 us | FA3 FP8 us | FI BF16 us | write ours / FI us |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in res["prefill_rows"]:
            g = lambda k, f=".0f": format(r[k], f) if k in r else "-"  # noqa: E731
            print(f"| {r['batch']} x ({r['prefix'] // 1024}K + {r['chunk']}) | {g('ours_us')} "
                  f"({r.get('ours_attn')}) | {g('fi_nvfp4_us')} | {g('ours_vs_fi_nvfp4', '.2f')} "
                  f"| {g('ours_TFLOPs')} | {g('fi_nvfp4_TFLOPs')} | {g('fa3_bf16_us')} | "
                  f"{g('fa3_fp8_us')} | {g('fi_bf16_us')} | {g('ours_write_search_us')} / "
                  f"{g('fi_write_us')} |")
    print("\nKV bytes per token per KV head (scales included): " + ", ".join(
        f"D={d}: " + " ".join(f"{k} {v}" for k, v in c.items())
        for d, c in res["capacity"].items()))
    print("checks (max |err| / max(1, |ref|)): " + ", ".join(
        f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in res["checks"].items()))


def plot(res: dict, path: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    # colour: batch; line: head dim (D = 128 solid, 256 dotted); marker: ours o, FlashInfer s
    batches = sorted({r["batch"] for r in res["rows"]})
    colours = {b: f"C{i}" for i, b in enumerate(batches)}
    for d in sorted({r["d"] for r in res["rows"]}):
        line = "-" if d == 128 else ":"
        for b in batches:
            rs = sorted((r for r in res["rows"] if (r["d"], r["batch"]) == (d, b)),
                        key=lambda r: r["ctx"])
            for ax, key, marker in ((axes[0], "ours_vs_fi_nvfp4", "o"),
                                    (axes[1], "ours_vs_fp8", "o"),
                                    (axes[1], "fi_nvfp4_vs_fp8", "s")):
                xs = [r["ctx"] for r in rs if key in r]
                if xs:
                    ax.plot(xs, [r[key] for r in rs if key in r], line + marker,
                            color=colours[b], label=f"{key.split('_vs')[0]} D{d} b{b}")
    for ax, title in ((axes[0], "decode: ours speed-up over FlashInfer NVFP4 (x)"),
                      (axes[1], "decode: speed vs FP8 (x; FA3 FP8 where it ran)")):
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=5, ncol=2)
    pr = res.get("prefill_rows") or []
    keys = [k for k in ("ours", "fi_nvfp4", "fi_bf16", "fa3_bf16", "fa3_fp8")
            if any(f"{k}_us" in r for r in pr)]
    for i, k in enumerate(keys):
        axes[2].bar([j + i * 0.8 / max(1, len(keys)) for j in range(len(pr))],
                    [r.get(f"{k}_us", 0) / 1e3 for r in pr], 0.8 / max(1, len(keys)), label=k)
    axes[2].set_xticks(range(len(pr)))
    axes[2].set_xticklabels([f"{r['prefix'] // 1024}K+{r['chunk']}" for r in pr])
    axes[2].set_title("chunked prefill, one layer (ms)", fontsize=9)
    axes[2].legend(fontsize=6)
    fig.suptitle(f"NVFP4 KV on {res['gpu']}: ours vs FlashInfer {res.get('flashinfer')} as "
                 f"vLLM 0.33 calls it, {res['date']}", fontsize=10)
    fig.tight_layout()
    common.save_figure(fig, path, dpi=90)


def join(runs) -> dict:
    """One result from several runs of one GPU (e.g. D = 128, D = 256, prefill): rows keyed
    by shape, a later run's row replacing an earlier one's; each run's header under "runs"."""
    res, decode, prefill = None, {}, {}
    for run in runs:
        res = res or {k: v for k, v in run.items()
                      if k not in ("rows", "prefill_rows", "checks", "capacity")}
        if run["gpu"] != res["gpu"]:
            raise SystemExit(f"--join: runs on {res['gpu']} and {run['gpu']}")
        res.setdefault("runs", []).append({k: run.get(k) for k in
                                           ("run", "checks_failed", "flashinfer")})
        res["capacity"] = {**res.get("capacity", {}), **run.get("capacity", {})}
        res["checks"] = {**res.get("checks", {}), **run.get("checks", {})}
        decode.update({(r["d"], r["batch"], r["ctx"]): r for r in run.get("rows", [])})
        prefill.update({(r["prefix"], r["chunk"]): r for r in run.get("prefill_rows") or []})
    res["checks_failed"] = failed_checks(res["checks"])
    res["rows"] = [decode[k] for k in sorted(decode)]
    res["prefill_rows"] = [prefill[k] for k in sorted(prefill)]
    return res


# ------------------------------------------------------------------ main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="evals/results/upstream_nvfp4.json")
    ap.add_argument("--dims", type=int, nargs="+", default=[128],
                    help="head dims of the decode sweep (FlashInfer's NVFP4 path: 128, 256)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--page", type=int, default=16, help="vLLM's FlashInfer block size")
    ap.add_argument("--fi-layouts", nargs="+", default=["NHD"], choices=["NHD", "HND"],
                    help="FlashInfer cache layouts (vLLM 0.33 on SM90 resolves NHD)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="sizes the workspaces as vLLM does")
    ap.add_argument("--max-dense-bytes", type=float, default=60e9,
                    help="skip an FP8/BF16 baseline whose cache is larger")
    ap.add_argument("--budget-s", type=float, default=400,
                    help="start no new decode shape after this many seconds")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--prefix", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--prefill-batch", type=int, default=1)
    ap.add_argument("--prefill-d", type=int, default=128)
    ap.add_argument("--build-fi-modules", metavar="DIR",
                    help="compile the FlashInfer modules (nvcc, no GPU) into DIR and exit")
    ap.add_argument("--table", metavar="JSON", help="print a results file's table and exit")
    ap.add_argument("--join", metavar="JSON", nargs="+",
                    help="merge runs' files into --out (decode rows by shape and prefill rows "
                         "by problem, a later file's winning) with one PNG, and exit")
    args = ap.parse_args(argv)
    bad = [d for d in args.dims if d not in FI_NVFP4_HEAD_DIMS]
    if bad and not args.build_fi_modules:
        ap.error(f"--dims {bad}: vLLM 0.33 serves NVFP4 through FlashInfer only at head dims "
                 f"{FI_NVFP4_HEAD_DIMS}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.build_fi_modules:
        build_fi_modules(args.build_fi_modules, args.dims)
        return
    if args.table:
        print_table(common.read_json(args.table))
        return
    if args.join:
        res = join(common.read_json(f) for f in args.join)
        common.write_json(args.out, res)
        plot(res, common.png_path(args.out))
        print_table(res)
        return
    import flashinfer
    device = torch.device("cuda")
    dims = sorted(set(args.dims) | ({args.prefill_d} if not args.no_prefill else set()))
    status = fi_module_status(dims, () if args.no_prefill else (args.prefill_d,))
    if any(v == "jit" for v in status.values()):
        print("FlashInfer will JIT-compile (nvcc, minutes each):",
              [k for k, v in status.items() if v == "jit"], flush=True)
    res = common.results_header(True, triton=triton.__version__, flashinfer=flashinfer.__version__,
                                heads=[args.hq, args.hkv], page=args.page,
                                fi_layouts=args.fi_layouts, fi_modules=status)
    res["capacity"] = {d: {f: bytes_per_token_head(f, d) for f in FORMATS} for d in dims}
    workspace = fi_workspace(args, device)
    writer = fi_writer()
    res["fi_writer"] = "flashinfer" if writer is not None else "torch twin (fi_write)"
    fa3 = have_vllm_fa3()
    res["copy_bandwidth_TBps"] = copy_bandwidth(device) / 1e12
    checks = {}
    for d in args.dims if not args.no_decode else []:
        checks.update({f"D{d}_{k}": v for k, v in
                       check_decode(args, d, device, workspace, writer, fa3).items()})
    if not args.no_prefill:
        checks.update({f"D{args.prefill_d}_{k}": v for k, v in
                       prefill_rows(args, device, workspace, writer, fa3, True).items()})
    if writer is not None:
        checks.update(check_fi_writer(args, device, writer))
    res["checks"] = checks
    res["checks_failed"] = failed_checks(checks)
    print("checks:", {k: (f"{v:.2e}" if isinstance(v, float) else v)
                      for k, v in checks.items()}, "failed:", res["checks_failed"], flush=True)
    common.write_json(args.out, res)  # written again after every row: a timeout keeps them
    t_end = time.time() + args.budget_s
    for d in args.dims if not args.no_decode else []:
        decode_rows(args, d, device, workspace, writer, fa3, t_end,
                    lambda row: (res["rows"].append(row), common.write_json(args.out, res)))
    if not args.no_prefill:
        res["prefill_rows"] = prefill_rows(args, device, workspace, writer, fa3)
    common.write_json(args.out, res)
    plot(res, common.png_path(args.out))
    print_table(res)


if __name__ == "__main__":
    main()
