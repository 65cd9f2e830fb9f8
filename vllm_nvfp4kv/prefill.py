"""Prefill paths of the NVFP4 backend (the seed design's paths 1 and 2).

* Initial prefill (no cached prefix in the step): attention over the step's own unquantized
  K/V; the same K/V are quantized into the cache by the writer (do_kv_cache_update).
* Chunked prefill / extend: the cached prefixes are dequantized by ONE gather launch into a
  workspace shared by all layers, the chunk's own (exact) K/V join them, and one varlen
  attention call covers both. Requests are packed into rounds that fit the workspace; a
  prefix longer than the workspace is attended in pieces merged by LSE.

Planning (index math, rounds, device index tensors) happens once per step in the metadata
builder (``plan_prefill``); the per-layer path (``run_prefill``) only launches kernels
(``ops``: Triton / FlashAttention on CUDA, the torch references elsewhere).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_nvfp4kv import ops
from vllm_nvfp4kv.cache_space import CacheSpace
from vllm_nvfp4kv.dense_attention import merge_lse, to_fp8
from vllm_nvfp4kv.ops import AttentionParams, dense_attention
from vllm_nvfp4kv.workspace import FP8_DIV


@dataclass
class Round:
    """Prefill requests r0:r1 (batch rows), query rows t0:t1, attended in one call."""
    r0: int
    r1: int
    t0: int
    t1: int
    cu_q: torch.Tensor              # [n+1] int32, round-local query offsets
    cu_k: torch.Tensor              # [n+1] int32, workspace (or own K/V) offsets
    cu_q_cpu: torch.Tensor
    cu_k_cpu: torch.Tensor
    max_q: int
    max_k: int
    ws_tokens: int = 0              # 0: no cached prefix, attend the step's own K/V
    cu_ctx: torch.Tensor | None = None      # [n+1] int32 prefix tokens to gather, cumulative
    ctx_starts: torch.Tensor | None = None  # [n] int32 first prefix token gathered
    ctx_dst: torch.Tensor | None = None     # [n] int32 workspace row of that token
    max_ctx: int = 0
    chunk_dst: torch.Tensor | None = None   # [t1-t0] int64 workspace rows of the chunk's K/V


@dataclass
class LongPrefix:
    """One request whose prefix does not fit the workspace: pieces merged by LSE."""
    r: int
    t0: int
    t1: int
    pieces: list[tuple[int, int]]   # (first token, count) of the prefix
    chunk_from_cache: bool = False
    tensors: dict = field(default_factory=dict)


@dataclass
class PrefillPlan:
    rounds: list[Round]
    long: list[LongPrefix]
    ws_rows: int  # workspace rows this step uses (<= capacity)


@dataclass
class PrefillInputs:
    """One layer's prefill of one step besides its plan: the step's rows as the model has
    them, the cache and workspace, the layer's attention and cache space."""
    q: torch.Tensor            # [T, Hq, D] the step's query rows
    key: torch.Tensor          # [T, Hkv, D]
    value: torch.Tensor        # [T, Hkv, D]
    out: torch.Tensor          # [T, Hq, D], written (the prefill rows)
    kv_cache: torch.Tensor     # [num_blocks, 2 Hkv, N, D/2 + D/16] uint8
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    ws_k: torch.Tensor         # [rows, Hkv, D] the shared workspace (model dtype or FP8)
    ws_v: torch.Tensor
    k_scale: torch.Tensor      # [1] fp32 global scales
    v_scale: torch.Tensor
    attn: AttentionParams
    space: CacheSpace = field(default_factory=CacheSpace)  # what the cache stores


def _i32(xs, device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32).to(device, non_blocking=True)


def plan_prefill(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, first: int,
                 num_reqs: int, capacity: int, window: int | None,
                 device: torch.device, chunk_from_cache: bool = False) -> PrefillPlan:
    """Plan the prefill requests first:num_reqs (their query rows are contiguous).
    capacity: workspace rows; window: sliding window (only the last window-1 prefix tokens
    are needed). chunk_from_cache: attend over the chunk's own K/V as read back from the cache
    (dequantized) instead of its exact values, so that a later prefix-cache hit on the same
    tokens computes exactly what this step computes."""
    qsl = query_start_loc_cpu.tolist()
    sl = seq_lens_cpu.tolist()
    reqs = []  # (row, t0, t1, prefix_start, prefix_len)
    for r in range(first, num_reqs):
        t0, t1 = qsl[r], qsl[r + 1]
        ctx = sl[r] - (t1 - t0)
        start = max(0, ctx - (window - 1)) if window else 0
        reqs.append((r, t0, t1, start, ctx - start))
    rounds, long, i = [], [], 0
    while i < len(reqs):
        r, t0, t1, start, n_ctx = reqs[i]
        if n_ctx + (t1 - t0) > capacity:  # alone too big: pieces (no window then, see above)
            step = capacity
            long.append(LongPrefix(r, t0, t1, [(s, min(step, start + n_ctx - s))
                                               for s in range(start, start + n_ctx, step)],
                                   chunk_from_cache))
            i += 1
            continue
        j, used = i, 0
        while j < len(reqs) and used + reqs[j][4] + (reqs[j][2] - reqs[j][1]) <= capacity:
            used += reqs[j][4] + reqs[j][2] - reqs[j][1]
            j += 1
        rounds.append(_make_round(reqs[i:j], device, chunk_from_cache))
        i = j
    for lp in long:
        lp.tensors = _long_tensors(lp, device)
    ws_rows = max([r.ws_tokens for r in rounds] + [n for lp in long for _, n in lp.pieces]
                  + [1])
    return PrefillPlan(rounds, long, ws_rows)


def ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """int64 [sum(counts)]: starts[i] + 0 .. counts[i]-1 for each i, concatenated, in tensor
    ops (a Python list of one int per row cost ~0.8 ms of host time per 8K-token chunk)."""
    starts, counts = starts.long(), counts.long()
    offsets = torch.cumsum(counts, 0) - counts
    return (torch.repeat_interleave(starts - offsets, counts)
            + torch.arange(int(counts.sum()), device=counts.device))


def _make_round(reqs, device, chunk_from_cache: bool) -> Round:
    cu_q, cu_k, cu_ctx, starts, dst = [0], [0], [0], [], []
    chunk_rows, chunk_lens = [], []  # where each request's chunk goes in the workspace
    t_base = reqs[0][1]
    any_ctx = chunk_from_cache or any(n for *_, n in reqs)
    for _, t0, t1, start, n_ctx in reqs:
        q_len = t1 - t0
        k0 = cu_k[-1]
        cu_q.append(cu_q[-1] + q_len)
        if any_ctx:
            cu_k.append(k0 + n_ctx + q_len)
            starts.append(start)
            dst.append(k0)
            if chunk_from_cache:  # the chunk is gathered with its prefix
                cu_ctx.append(cu_ctx[-1] + n_ctx + q_len)
            else:
                cu_ctx.append(cu_ctx[-1] + n_ctx)
                chunk_rows.append(k0 + n_ctx)
                chunk_lens.append(q_len)
        else:
            cu_k.append(k0 + q_len)
    rnd = Round(reqs[0][0], reqs[-1][0] + 1, t_base, reqs[-1][2], _i32(cu_q, device),
                _i32(cu_k, device), torch.tensor(cu_q), torch.tensor(cu_k),
                max(b - a for a, b in zip(cu_q, cu_q[1:])),
                max(b - a for a, b in zip(cu_k, cu_k[1:])))
    if any_ctx:
        rnd.ws_tokens = cu_k[-1]
        rnd.cu_ctx, rnd.ctx_starts = _i32(cu_ctx, device), _i32(starts, device)
        rnd.ctx_dst = _i32(dst, device)
        rnd.max_ctx = max(b - a for a, b in zip(cu_ctx, cu_ctx[1:]))
        if chunk_rows:
            rnd.chunk_dst = ranges(torch.tensor(chunk_rows), torch.tensor(chunk_lens)).to(
                device, non_blocking=True)
    return rnd


def _long_tensors(lp: LongPrefix, device) -> dict:
    q_len = lp.t1 - lp.t0
    t = {"cu_q": _i32([0, q_len], device), "cu_q_cpu": torch.tensor([0, q_len])}
    if lp.chunk_from_cache:  # where the chunk starts in its sequence
        t["chunk_start"] = _i32([lp.pieces[-1][0] + lp.pieces[-1][1]], device)
    for s, n in lp.pieces:
        t[(s, n)] = (_i32([0, n], device), torch.tensor([0, n]), _i32([s], device))
    return t


def gather_into(kv_cache, block_table, cu_ctx, ctx_starts, ctx_dst, ws_k, ws_v, k_scale,
                v_scale, max_ctx) -> None:
    """Dequantize prefixes into workspace rows (ops.gather_cache). An FP8 workspace gets
    (e2m1 * e4m3) / FP8_DIV: the global scales go to the attention's descale."""
    fp8 = ws_k.dtype == torch.float8_e4m3fn
    if fp8:
        k_scale = v_scale = torch.ones_like(k_scale)
    ops.gather_cache(kv_cache, block_table, cu_ctx, ctx_starts, ws_k, ws_v, k_scale, v_scale,
                     max_ctx, out_div=FP8_DIV if fp8 else 1.0, out_starts=ctx_dst)


def _put_chunk(k, v, rows, ws_k, ws_v, space: CacheSpace, k_div, v_div,
               kernel: bool | None = None) -> None:
    """The chunk's exact K/V [T, Hkv, D], made finite and taken into the cache's space, into
    workspace rows (FP8: divided by k_div / v_div): ops.put_rows, one launch per side on CUDA
    (it replaced nan_to_num, the centering, the rotation GEMM and index_copy: five launches
    for K). kernel: as ops.put_rows (the tests run the kernel in Triton's interpreter)."""
    ops.put_rows(k, rows, ws_k, space.k_sub, space.k_mul, space.k_rotation(), k_div, kernel)
    ops.put_rows(v, rows, ws_v, None, None, space.rotate_v, v_div, kernel)


def _finite(x: torch.Tensor) -> torch.Tensor:
    big = torch.finfo(x.dtype).max
    return torch.nan_to_num(x, nan=0.0, posinf=big, neginf=-big)


def _fp8_query(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q in E4M3 with a per-call scale from its finite amax (no host sync): (q_fp8, descale).
    The scale is shared by the round's requests: an outlier query coarsens the others'."""
    q = _finite(q)
    q_div = q.abs().amax().float().clamp(1e-30, torch.finfo(torch.float32).max) / 448.0
    return to_fp8(q, q_div), q_div


def run_prefill(plan: PrefillPlan, x: PrefillInputs) -> None:
    """Attention of the prefill query rows (per-layer; only launches). x.q, x.key, x.value,
    x.out as the model has them; x.space: what the cache stores instead (centered / smoothed /
    rotated K, rotated V), so where it is read, q and the chunk's K/V are transformed alike
    and the output taken back. Path 1 reads no cache: it attends the exact K/V as they are."""
    a = x.attn
    # The step's exact K/V as the cache stores them (NaN -> 0, +-Inf -> finite): varlen FA
    # reads K/V tiles across sequence boundaries and zeroes the masked scores, so a NaN or
    # Inf V row of one request would turn into 0 * NaN = NaN in its neighbour's output.
    # Only for the paths that attend them as they are; _put_chunk does it for the others.
    key, value = x.key, x.value
    if plan.long or any(rnd.ws_tokens == 0 for rnd in plan.rounds):
        key, value = _finite(key), _finite(value)
    fp8 = x.ws_k.dtype == torch.float8_e4m3fn
    if fp8:  # what the FP8 workspace values are multiplied by (gather_into)
        k_div, v_div = x.k_scale * FP8_DIV, x.v_scale * FP8_DIV
    for rnd in plan.rounds:
        qs, os = x.q[rnd.t0:rnd.t1], x.out[rnd.t0:rnd.t1]
        descale = None
        if rnd.ws_tokens == 0:  # path 1: the step's own K/V
            k, v = key[rnd.t0:rnd.t1], value[rnd.t0:rnd.t1]
        else:                   # path 2: cached prefixes + chunk in the workspace
            gather_into(x.kv_cache, x.block_table[rnd.r0:rnd.r1], rnd.cu_ctx, rnd.ctx_starts,
                        rnd.ctx_dst, x.ws_k, x.ws_v, x.k_scale, x.v_scale, rnd.max_ctx)
            qs = x.space.query(qs)
            if rnd.chunk_dst is not None:  # the chunk's exact K/V join the prefix
                _put_chunk(key[rnd.t0:rnd.t1], value[rnd.t0:rnd.t1], rnd.chunk_dst, x.ws_k,
                           x.ws_v, x.space, *((k_div, v_div) if fp8 else (None, None)))
            k, v = x.ws_k[:rnd.ws_tokens], x.ws_v[:rnd.ws_tokens]
            if fp8:  # FA3 FP8 takes all of Q, K, V in FP8
                qs, q_div = _fp8_query(qs)
                descale = (q_div, k_div, v_div)
        dense_attention(qs, k, v, os, rnd.cu_q, rnd.cu_k, rnd.max_q, rnd.max_k, a.scale, True,
                        a.window, a.softcap, a.sinks, a.fa_version, rnd.cu_q_cpu, rnd.cu_k_cpu,
                        descale=descale)
        if rnd.ws_tokens and x.space.rotate_v:
            os.copy_(x.space.output(os))
    for lp in plan.long:
        _run_long(lp, x, key, value)


def _run_long(lp: LongPrefix, x: PrefillInputs, key: torch.Tensor, value: torch.Tensor) -> None:
    """Prefix pieces (all keys precede all queries: no mask) and the chunk itself (causal,
    with the sinks), merged by LSE, all in the cache's space (run_prefill). key / value: the
    step's, made finite."""
    a, space = x.attn, x.space
    qs, q_len = space.query(x.q[lp.t0:lp.t1]), lp.t1 - lp.t0
    t = lp.tensors
    k, v = space.key(key[lp.t0:lp.t1]), space.value(value[lp.t0:lp.t1])
    if lp.chunk_from_cache:
        gather_into(x.kv_cache, x.block_table[lp.r:lp.r + 1], t["cu_q"], t["chunk_start"],
                    t["cu_q"][:1], x.ws_k, x.ws_v, x.k_scale, x.v_scale, q_len)
        k, v = x.ws_k[:q_len].clone(), x.ws_v[:q_len].clone()  # the pieces reuse the workspace
        if k.dtype == torch.float8_e4m3fn:  # this call attends in the model dtype
            k = (k.float() * (x.k_scale * FP8_DIV)).to(qs.dtype)
            v = (v.float() * (x.v_scale * FP8_DIV)).to(qs.dtype)
    acc = torch.empty_like(qs)
    lse = dense_attention(qs, k, v, acc, t["cu_q"], t["cu_q"], q_len, q_len, a.scale, True,
                          None, a.softcap, a.sinks, a.fa_version, t["cu_q_cpu"], t["cu_q_cpu"],
                          return_lse=True)
    acc = acc.float()
    part = torch.empty_like(qs)
    qp, descale = qs, None
    if x.ws_k.dtype == torch.float8_e4m3fn:  # as in run_prefill
        qp, q_div = _fp8_query(qs)
        descale = (q_div, x.k_scale * FP8_DIV, x.v_scale * FP8_DIV)
    for s, n in lp.pieces:
        cu_k, cu_k_cpu, start = t[(s, n)]
        gather_into(x.kv_cache, x.block_table[lp.r:lp.r + 1], cu_k, start, cu_k[:1], x.ws_k,
                    x.ws_v, x.k_scale, x.v_scale, n)
        plse = dense_attention(qp, x.ws_k[:n], x.ws_v[:n], part, t["cu_q"], cu_k, q_len, n,
                               a.scale, False, None, a.softcap, None, a.fa_version,
                               t["cu_q_cpu"], cu_k_cpu, return_lse=True, descale=descale)
        acc, lse = merge_lse(acc, lse, part, plse)
    x.out[lp.t0:lp.t1] = space.output(acc.to(x.out.dtype))
