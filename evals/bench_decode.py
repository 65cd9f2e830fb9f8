"""Decode-attention kernel benchmark: NVFP4 (ours) vs FP8 and BF16 paged decode (vLLM's
FlashAttention-3; FlashInfer if FA3 is missing) and vLLM's own 4-bit KV caches
(kv_cache_dtype int4_per_token_head, TRITON_ATTN backend; turboquant_4bit_nc, TURBOQUANT
backend's Triton decode), measured in one run on one GPU.

Llama-3-8B-like heads by default (32 q / 8 kv, D=128), or several head configurations in one
process (--heads: head sizes 64/128/256, sinks, sliding windows; a PNG panel each), page size
16, random page order, one layer. Each timing is the median of CUDA-graph replays (triton.testing.do_bench_cudagraph).
Effective bandwidth = KV bytes read (+ q, out) / time, compared with the device copy bandwidth
(read + write of a 4 GiB clone) measured in the same run. Writes JSON and a PNG plot.

    python -P -m evals.bench_decode --out evals/results/decode_h200.json
    python -P -m evals.bench_decode --tune         # block/warps/stages sweep on a few shapes
    python -P -m evals.bench_decode --toy          # CPU, Triton interpreter, tiny sizes
    python -P -m evals.bench_decode --heads issue35 --baselines fa3 --batch 1 4 16 64 \
        --ctx 8192 32768 131072 262144 --rep-ms 25    # head sizes 64/128/256, FA3 only
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

if __name__ == "__main__" and "--toy" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from evals import common  # noqa: E402
from vllm_nvfp4kv.kernels import decode_attention, kv_cache_shape, reference, write_cache  # noqa: E402
from vllm_nvfp4kv.kernels.decode import (DECODE_VARIANTS, DEFAULT_SPLIT_RULE,  # noqa: E402
                                         HOPPER_PROGRAMS_PER_SM, SMALL_GRID_MAX_SPLITS,
                                         choose_block_n, choose_num_splits, clamp_splits,
                                         max_splits)

# K+V, D=128; int4: [K(64) | K scale+zero-point(4) | V(64) | V scale+zero-point(4)];
# tq4 (turboquant_4bit_nc): [K codebook indices(64) + norm(2) | V(64) + scale+zero(4)]
BYTES_PER_TOKEN_HEAD = {"bf16": 512, "fp8": 256, "nvfp4": 144, "int4": 136, "tq4": 134}
# --heads: q heads / KV heads / head dim, "+sinks" (per-head sink logits), "+wN" (an N-token
# sliding window); a set name stands for its list. issue35: Llama-3-8B (32/8 at 128),
# Gemma-3 1B (4/1 at 256), Qwen3.5 / Qwen3-Next gated attention (8/2 and 16/2 at 256),
# SmolLM2-135M (9/3 at 64), gpt-oss (64/8 at 64 with sinks; every other layer has a 128-token
# window)
HEAD_SETS = {"issue35": ["32/8/128", "4/1/256", "8/2/256", "16/2/256", "9/3/64",
                         "64/8/64+sinks", "64/8/64+sinks+w128"]}


def copy_bandwidth(device) -> float:
    """Bytes moved per second (read + write) by a device-to-device clone of 4 GiB."""
    x = torch.empty(4 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median")
    return 2 * (4 << 30) / (ms * 1e-3)


ONCE = False  # --once: every timed function runs once, no timing (compute-sanitizer runs)
REP_MS = 100  # --rep-ms: CUDA-graph replay time per measurement
SPLIT_LEN = 0  # --split-len: ours sizes its split count for at least this many tokens


def time_fn(fn, device) -> float:
    if device.type != "cuda" or ONCE:
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3
    # one eager call first: FA3's first call at a shape, captured straight into the timing
    # graph, made a later FA3 graph fault with an illegal address on the H200 (2026-12-04)
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")


class Problem:
    """Random decode problem: batch sequences of ctx tokens, pages in random order; sinks:
    random per-head sink logits [hq] fp32; window: a sliding window of that many tokens."""

    def __init__(self, batch, ctx, hq, hkv, d, page, device, sinks=False, window=None):
        self.batch, self.ctx, self.hq, self.hkv, self.d, self.page = batch, ctx, hq, hkv, d, page
        self.device, self.window = device, window
        self.blocks_per_seq = math.ceil(ctx / page)
        self.num_blocks = batch * self.blocks_per_seq
        g = torch.Generator(device="cpu").manual_seed(batch * 7919 + ctx)
        perm = torch.randperm(self.num_blocks, generator=g)
        self.block_table = perm.view(batch, -1).to(torch.int32).to(device)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device=device)
        self.scale = d ** -0.5
        self.one = torch.ones(1, dtype=torch.float32, device=device)  # k/v global scales
        self.sinks = (torch.randn(hq, generator=g) * 2).to(device) if sinks else None

    @classmethod
    def of(cls, args, batch, ctx, device):
        """The problem of a head configuration (args: hq, hkv, d, page, sinks, window)."""
        return cls(batch, ctx, args.hq, args.hkv, args.d, args.page, device, args.sinks,
                   args.window)

    def nvfp4_cache(self):
        cache = torch.empty(kv_cache_shape(self.num_blocks, self.page, self.hkv, self.d),
                            dtype=torch.uint8, device=self.device)
        chunk = 1 << 20  # fill with real quantized data, a chunk of tokens at a time
        total = self.num_blocks * self.page
        for s in range(0, total, chunk):
            n = min(chunk, total - s)
            kv = torch.randn(n, self.hkv, self.d, dtype=torch.bfloat16, device=self.device)
            write_cache(cache, kv, kv, torch.arange(s, s + n, device=self.device), 1.0, 1.0,
                        "amax6")
        return cache

    def dense_cache(self, dtype):
        """Separate K and V tensors [num_blocks, page, hkv, d] (FA3's paged layout)."""
        shape = (self.num_blocks, self.page, self.hkv, self.d)
        return tuple(torch.randn(shape, dtype=torch.bfloat16, device=self.device).to(dtype)
                     for _ in range(2))


def run_nvfp4(p: Problem, cache, out, **kw):
    return lambda: decode_attention(p.q, cache, p.block_table, p.seq_lens, out, p.scale,
                                    p.one, p.one, max_seq_len=max(p.ctx, SPLIT_LEN),
                                    sliding_window=p.window,
                                    sinks=p.sinks, **kw)


def fa3_fn(p: Problem, k, v, fp8: bool):
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    cu_q = torch.arange(p.batch + 1, dtype=torch.int32, device=p.device)
    q = p.q
    desc = {}
    if fp8:
        q = p.q.to(torch.float8_e4m3fn)
        one = torch.ones(p.batch, p.hkv, dtype=torch.float32, device=p.device)
        desc = dict(q_descale=one, k_descale=one, v_descale=one)
    out = torch.empty_like(p.q)
    return lambda: flash_attn_varlen_func(
        q, k, v, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=p.ctx, seqused_k=p.seq_lens,
        softmax_scale=p.scale, causal=True, block_table=p.block_table, out=out, fa_version=3,
        window_size=[p.window - 1, 0] if p.window else None,
        s_aux=None if p.sinks is None else p.sinks.to(torch.bfloat16), **desc)  # FA3: bf16 only


def int4_fn(p: Problem):
    """vLLM's int4_per_token_head decode, through the TRITON_ATTN backend's own impl:
    forward -> unified_attention -> unified_attention_int4 (RHT of q, split-dot kernel, 3D
    split-KV + reduce_segments when batch <= seq_threshold_3D, else 2D; inverse RHT of out).
    The cache is written by the backend's writer (do_kv_cache_update -> reshape_and_cache_int4)."""
    if p.device.type == "cpu":  # vLLM's CPU build stubs Triton out: run its kernels interpreted
        import vllm.triton_utils as vtu
        vtu.triton, vtu.tl = triton, triton.language
    from vllm.v1.attention.backends import triton_attn as ta
    dt = "int4_per_token_head"
    impl = ta.TritonAttentionImpl(p.hq, p.d, p.scale, p.hkv, None, None, dt)
    nb, h, pg, c = ta.TritonAttentionBackend.get_kv_cache_shape(p.num_blocks, p.page, p.hkv,
                                                                p.d, dt)
    # logical [blocks, hkv, page, 2 * (D/2 + 4)] uint8 over vLLM's default NHD memory order
    cache = torch.empty(nb, pg, h, c, dtype=torch.uint8, device=p.device).transpose(1, 2)
    chunk, total = 1 << 20, p.num_blocks * p.page
    for s in range(0, total, chunk):
        n = min(chunk, total - s)
        kv = torch.randn(n, p.hkv, p.d, dtype=torch.bfloat16, device=p.device)
        impl.do_kv_cache_update(None, kv, kv, cache, torch.arange(s, s + n, device=p.device))
    # as TritonAttentionMetadataBuilder: 128 // hkv (16 at 8 KV heads, also a graph capture size)
    thr, seg = ta.MIN_LAUNCH_GRID_SIZE_2D // p.hkv, ta.NUM_PAR_SOFTMAX_SEGMENTS
    f32 = dict(dtype=torch.float32, device=p.device)
    md = ta.TritonAttentionMetadata(
        num_actual_tokens=p.batch, max_query_len=1, max_seq_len=p.ctx, seq_lens=p.seq_lens,
        query_start_loc=torch.arange(p.batch + 1, dtype=torch.int32, device=p.device),
        block_table=p.block_table, slot_mapping=None, seq_threshold_3D=thr,
        num_par_softmax_segments=seg,
        softmax_segm_output=torch.empty(thr, p.hq, seg, triton.next_power_of_2(p.d), **f32),
        softmax_segm_max=torch.empty(thr, p.hq, seg, **f32),
        softmax_segm_expsum=torch.empty(thr, p.hq, seg, **f32), causal=True,
        use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None,
        suffix_kv_lens=None)
    out = torch.empty_like(p.q)
    return lambda: impl.forward(None, p.q, None, None, cache, md, out)


def check(args, device, **kw) -> dict[int, float]:
    """Ours (launch options kw) vs the torch reference on a small problem before any timing:
    the max abs error for one, four and 128 splits (asserted small; on a GPU 8448 tokens:
    66 of 128-token tiles, so the reduction's second chunk of 64 partials has live ones)."""
    p = Problem.of(args, 3, 8448 if device.type == "cuda" else 40, device)
    cache = p.nvfp4_cache()
    out = torch.empty_like(p.q)
    ref = reference.paged_attention(p.q, cache, p.block_table,
                                    torch.arange(p.batch + 1, device=device), p.seq_lens,
                                    p.scale, 1.0, 1.0, sliding_window=p.window, sinks=p.sinks)
    errs = {}
    for ns in (1, 4, SMALL_GRID_MAX_SPLITS):
        decode_attention(p.q, cache, p.block_table, p.seq_lens, out, p.scale, 1.0, 1.0,
                         num_splits=ns, sliding_window=p.window, sinks=p.sinks, **kw)
        errs[ns] = (out.float() - ref).abs().max().item()
        assert errs[ns] < 2e-2 * max(1.0, ref.abs().max().item()), f"mismatch {errs[ns]}"
    return errs


def header(args, device) -> dict:
    """What every results file starts with: date, device, versions, shape."""
    heads = [c.label for c in head_configs(args)] if args.heads else [args.hq, args.hkv, args.d]
    return common.results_header(device.type == "cuda", triton=triton.__version__,
                                 heads=heads, page=args.page)


def parse_heads(spec: str) -> dict:
    """'HQ/HKV/D[+sinks][+wN]' -> dict(hq, hkv, d, sinks, window) (--heads)."""
    base, *opts = spec.split("+")
    hq, hkv, d = map(int, base.split("/"))
    if any(o != "sinks" and not (o[:1] == "w" and o[1:].isdigit()) for o in opts):
        raise ValueError(f"head configuration {spec!r}: expected HQ/HKV/D[+sinks][+wN]")
    window = next((int(o[1:]) for o in opts if o != "sinks"), None)
    return dict(hq=hq, hkv=hkv, d=d, sinks="sinks" in opts, window=window)


def head_configs(args) -> list[argparse.Namespace]:
    """args once per --heads configuration (hq, hkv, d, sinks, window and its label set), or
    args with --hq/--hkv/--d alone."""
    specs = [x for h in args.heads for x in HEAD_SETS.get(h, [h])]
    if not specs:
        return [argparse.Namespace(**{**vars(args), "label": f"{args.hq}/{args.hkv}/{args.d}"})]
    return [argparse.Namespace(**{**vars(args), **parse_heads(x), "label": x}) for x in specs]


def tq4_fn(p: Problem, kv: torch.Tensor | None = None):
    """vLLM's turboquant_4bit_nc decode (Hadamard-rotated 4-bit Lloyd-Max keys with norm
    correction, 4-bit uniform values): the TURBOQUANT backend's launcher
    triton_turboquant_decode_attention (Triton stage 1 + LSE stage 2, 32 splits: the backend's
    default for CUDA graphs), over a cache written by its own store kernel with the backend's
    Hadamard matrix and centroids. FlashAttention-2, which the backend needs for prefill, is
    not involved. kv [slots, Hkv, D]: what slot s holds as K and V (default random)."""
    import vllm.triton_utils as vtu
    stub = vtu.triton, vtu.tl
    if p.device.type == "cpu":  # vLLM's CPU build stubs Triton out: import its kernels real
        vtu.triton, vtu.tl = triton, triton.language
    try:
        from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
        from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
        from vllm.v1.attention.ops.triton_turboquant_decode import (
            triton_turboquant_decode_attention)
        from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store
    finally:  # the rest of the process keeps what vLLM chose
        vtu.triton, vtu.tl = stub
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", p.d)
    assert cfg.slot_size_aligned == BYTES_PER_TOKEN_HEAD["tq4"] * p.d // 128
    cache = torch.zeros(p.num_blocks, p.page, p.hkv, cfg.slot_size_aligned, dtype=torch.uint8,
                        device=p.device)
    hadamard = _build_hadamard(p.d, str(p.device))
    centroids = get_centroids(p.d, cfg.centroid_bits).to(device=p.device, dtype=torch.float32)
    ordered = centroids.sort().values
    midpoints = (ordered[:-1] + ordered[1:]) / 2
    quant = dict(mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
                 value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8)
    chunk, total = 1 << 20, p.num_blocks * p.page
    for s in range(0, total, chunk):
        n = min(chunk, total - s)
        x = torch.randn(n, p.hkv, p.d, dtype=torch.bfloat16, device=p.device) if kv is None \
            else kv[s:s + n]
        triton_turboquant_store(x, x, cache, torch.arange(s, s + n, dtype=torch.int32,
                                                          device=p.device),
                                hadamard, midpoints, **quant)
    return lambda: triton_turboquant_decode_attention(
        p.q, cache, p.block_table, p.seq_lens, hadamard, centroids, p.scale,
        norm_correction=cfg.norm_correction, PiT=hadamard, max_num_kv_splits=32, **quant)


def kv_gbps(name: str, batch: int, ctx: int, args, ms: float) -> float:
    """KV bytes the decode of batch x ctx tokens reads with cache dtype `name`, per second
    (within the sliding window where args has one)."""
    tokens = min(ctx, args.window) if getattr(args, "window", None) else ctx
    byts = batch * tokens * args.hkv * BYTES_PER_TOKEN_HEAD[name] * args.d / 128
    return byts / (ms * 1e-3) / 1e9


def bench(args):
    device = torch.device("cuda" if torch.cuda.is_available() and not args.toy else "cpu")
    res = header(args, device)
    variant = DECODE_VARIANTS[args.variant]
    res["variant"] = args.variant
    configs = head_configs(args)
    errs = {c.label: max(check(c, device, **variant).values()) for c in configs}
    res["check_max_err"] = max(errs.values())
    if args.heads:
        res["check_max_err_by_heads"] = errs
    copy_bw = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    res["copy_bandwidth_GBps"] = copy_bw / 1e9
    print(f"# {res['gpu']}  copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    have_fa3 = not args.toy and "fa3" in args.baselines
    if have_fa3:
        try:
            from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: F401
        except Exception as e:  # noqa: BLE001
            print("no FA3:", e)
            have_fa3 = False
    t_end = time.time() + args.budget_s
    # contexts outermost: a budget cut drops the longest contexts of every head configuration
    for ctx in args.ctx:
        for c in configs:
            for batch in args.batch:
                if batch * ctx > args.max_tokens or time.time() > t_end:
                    continue
                row = bench_shape(c, device, batch, ctx, variant, have_fa3)
                row["nvfp4_frac_copy_bw"] = row.get("nvfp4_GBps", 0) * 1e9 / copy_bw
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache() if device.type == "cuda" else None
    return res


def bench_shape(args, device, batch: int, ctx: int, variant: dict, have_fa3: bool) -> dict:
    """One row of the sweep: ours (launch variant) and the baselines at batch x ctx with the
    head configuration of args (head_configs)."""
    p = Problem.of(args, batch, ctx, device)
    row = {"ctx": ctx, "batch": batch, "heads": args.label, "window": args.window,
           "sinks": args.sinks,
           "splits": choose_num_splits(batch, args.hkv, max(ctx, SPLIT_LEN), device, args.d,
                                       variant.get("split_rule", DEFAULT_SPLIT_RULE),
                                       variant.get("launches"))}
    cache = p.nvfp4_cache()
    out = torch.empty_like(p.q)
    row["nvfp4_ms"] = time_fn(run_nvfp4(p, cache, out, **variant), device)
    del cache
    if "int4" in args.baselines:
        try:  # vLLM's int4 decode hit an illegal address at 16 x 16K tokens on an H200
            if batch * ctx > args.int4_max_tokens:
                raise RuntimeError("skipped (--int4-max-tokens)")
            row["int4_ms"] = time_fn(int4_fn(p), device)
        except Exception as e:  # noqa: BLE001 (the baseline must never stop the sweep)
            print(f"int4 failed at b{batch} ctx {ctx}: {type(e).__name__}: {e}", flush=True)
    if "tq4" in args.baselines:
        try:
            row["tq4_ms"] = time_fn(tq4_fn(p), device)
        except Exception as e:  # noqa: BLE001 (the baseline must never stop the sweep)
            print(f"tq4 failed at b{batch} ctx {ctx}: {type(e).__name__}: {e}", flush=True)
    if have_fa3:
        for name, dt in (("fp8", torch.float8_e4m3fn), ("bf16", torch.bfloat16)):
            dense = batch * ctx * args.hkv * BYTES_PER_TOKEN_HEAD[name] * args.d / 128
            if dense > args.max_dense_bytes:
                continue
            try:
                k, v = p.dense_cache(dt)
                row[f"{name}_ms"] = time_fn(fa3_fn(p, k, v, name == "fp8"), device)
                del k, v
            except Exception as e:  # noqa: BLE001 (the baseline must never stop the sweep)
                print(f"FA3 {name} failed at {args.label} b{batch} ctx {ctx}: "
                      f"{type(e).__name__}: {e}", flush=True)
    for name in ("nvfp4", "int4", "tq4", "fp8", "bf16"):
        if f"{name}_ms" in row:
            row[f"{name}_GBps"] = kv_gbps(name, batch, ctx, args, row[f"{name}_ms"])
    for name in ("fp8", "bf16", "int4", "tq4"):
        if f"{name}_ms" in row:
            row[f"speedup_vs_{name}"] = row[f"{name}_ms"] / row["nvfp4_ms"]
    return row


def tune(args):
    """Tile size x load pipeline (2 stages, or 3-4 with the block table a tile ahead) x split
    count (the launcher's, half and twice it) at a few shapes: what choose_block_n,
    choose_num_splits and the default pipeline depth are set from."""
    device = torch.device("cuda")
    check(args, device)
    shapes = [(1, 32768), (8, 32768), (32, 8192), (64, 32768), (1, 262144)]
    pipelines = ((False, 2), (True, 3), (True, 4))  # (bt_ahead, num_stages)
    rows = []
    for batch, ctx in shapes:
        p = Problem(batch, ctx, args.hq, args.hkv, args.d, args.page, device)
        cache = p.nvfp4_cache()
        out = torch.empty_like(p.q)
        base = choose_num_splits(batch, args.hkv, ctx, device, args.d)
        for block_n in (64, 128):
            for bt_ahead, stages in pipelines:
                for ns in sorted({max(1, base // 2), base, min(64, base * 2)}):
                    try:
                        ms = time_fn(run_nvfp4(p, cache, out, block_n=block_n,
                                               bt_ahead=bt_ahead, num_stages=stages,
                                               num_splits=ns), device)
                    except Exception as e:  # noqa: BLE001 (out of resources etc.)
                        print("fail", block_n, bt_ahead, stages, type(e).__name__)
                        continue
                    gbps = kv_gbps("nvfp4", batch, ctx, args, ms)
                    rows.append(dict(batch=batch, ctx=ctx, block_n=block_n,
                                     bt_ahead=bt_ahead, stages=stages, splits=ns,
                                     default_splits=base, ms=ms, GBps=gbps))
        best = min((r for r in rows if r["batch"] == batch and r["ctx"] == ctx),
                   key=lambda r: r["ms"])
        print("best", json.dumps(best), flush=True)
        del cache
    return {"tune": rows}


def ab(args):
    """A/B of kernel variants at a few shapes in one process, FA3 FP8 as the yardstick:
    K decoded through shared memory (mma_k off) or straight into the MMA layout (on), 64-token
    tiles, 8 warps, twice the default split count (more CTAs per SM), a three-stage load
    pipeline, and DECODE_VARIANTS: V in rows through shared memory (v_rows; the default
    decodes V^T into the MMA operand), the split and tile rule before 2026-12-06 (per_sm8),
    other launches at D = 64 and 256 (d64_*, d256_*), at most 64 splits at every grid
    (cap64; the default takes up to 128 where 64 fill at most half a wave; --split-len
    sizes the split counts for a longer max_model_len, as the backend does, so short
    contexts get as many splits as long ones). Per --heads configuration
    (default: the one of --hq/--hkv/--d), at --shapes (default: six from 1 x 32K to
    16 x 128K); each variant timed (--variants, and mma_k, the default) is checked against
    the reference first."""
    device = torch.device("cuda")
    res = header(args, device)
    configs = head_configs(args)
    for c in configs:
        tag = f"_{c.label}" if args.heads else ""
        for name, kw in ab_variants(args, 1):
            kw = {k: v for k, v in kw.items() if k != "num_splits"}  # check() sets its own
            for ns, err in check(c, device, **kw).items():
                res[f"check_max_err_{name}_s{ns}{tag}"] = err
    print(json.dumps({k: v for k, v in res.items() if k.startswith("check")}), flush=True)
    res["copy_bandwidth_GBps"] = copy_bandwidth(device) / 1e9
    shapes = [tuple(map(int, x.split("x"))) for x in args.shapes] or [
        (1, 32768), (4, 32768), (16, 32768), (64, 32768), (1, 262144), (16, 131072)]
    for c in configs:
        for batch, ctx in shapes:
            ab_shape(c, device, batch, ctx, res)
    names = [n for n, _ in ab_variants(args, 1)]
    # against FA3 FP8 where the bundle (or .kit) is there; always against mma_k, the default
    for base, title in (("fp8", "FA3 FP8"), ("mma_k", "the default (mma_k)")):
        print(f"\nspeed vs {title} (x; > 1 is faster)\n| heads | batch | ctx | "
              + " | ".join(names) + " |")
        for r in res["rows"]:
            print(f"| {r['heads']} | {r['batch']} | {r['ctx'] // 1024}K | " + " | ".join(
                f"{r.get(base + '_ms', float('nan')) / r[n + '_ms']:.2f}" for n in names) + " |")
    return res


def ab_variants(args, base: int) -> list[tuple[str, dict]]:
    """ab()'s variants (name, decode_attention options) at a default split count base: all,
    or --variants and mma_k."""
    variants = (("smem_k", dict(mma_k=False)), ("mma_k", dict(mma_k=True)),
                ("mma_k_bn64", dict(mma_k=True, block_n=64)),
                ("mma_k_8warps", dict(mma_k=True, block_n=128, num_warps=8)),
                ("mma_k_2xsplits", dict(mma_k=True, num_splits=min(64, 2 * base))),
                ("mma_k_stages3", dict(mma_k=True, bt_ahead=False, num_stages=3)),  # Triton gives the extra
                # stage to the block-table loads; K/V stay one tile ahead (RESULTS.md)
                ("bt_ahead_s4_bn128", dict(mma_k=True, bt_ahead=True, num_stages=4,
                                           block_n=128)),  # 128-token tiles everywhere
                *((name, dict(mma_k=True, **kw)) for name, kw in DECODE_VARIANTS.items()
                  if name != "default"))
    return [(n, kw) for n, kw in variants
            if not args.variants or n in args.variants or n == "mma_k"]


def ab_shape(args, device, batch: int, ctx: int, res: dict):
    """ab()'s row at one shape and head configuration, appended to res["rows"]."""
    p = Problem.of(args, batch, ctx, device)
    cache, out = p.nvfp4_cache(), torch.empty_like(p.q)
    plan = max(ctx, SPLIT_LEN)  # what run_nvfp4 sizes the split count for
    base = choose_num_splits(batch, args.hkv, plan, device, args.d)
    row = {"heads": args.label, "batch": batch, "ctx": ctx, "split_len": plan, "splits": base}
    variants = ab_variants(args, base)
    for name, kw in variants:
        row[f"{name}_splits"] = kw.get("num_splits") or choose_num_splits(
            batch, args.hkv, plan, device, args.d, kw.get("split_rule", DEFAULT_SPLIT_RULE),
            kw.get("launches"))
        row[f"{name}_ms"] = time_fn(run_nvfp4(p, cache, out, **kw), device)
        row[f"{name}_GBps"] = kv_gbps("nvfp4", batch, ctx, args, row[f"{name}_ms"])
    del cache
    try:
        k, v = p.dense_cache(torch.float8_e4m3fn)
        row["fp8_ms"] = time_fn(fa3_fn(p, k, v, True), device)
        del k, v
        for name, _ in variants:
            row[f"{name}_vs_fp8"] = row["fp8_ms"] / row[f"{name}_ms"]
    except Exception as e:  # noqa: BLE001 (no bundle: ours only)
        print("no FA3:", type(e).__name__, e)
    res["rows"].append(row)
    print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()


def split_sweep(args):
    """Split-KV count x tile size at a few shapes: the launch's occupancy lever. Counts from
    programs per SM (ceil, the launcher's rule before 2026-12-06) and from whole waves of
    HOPPER_PROGRAMS_PER_SM (floor: no partly filled last wave; the launcher's rule since);
    launcher_default marks the launcher's own choice."""
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    res = {**header(args, device), "sms": sms, "resident_per_sm": HOPPER_PROGRAMS_PER_SM}
    shapes = [tuple(map(int, x.split("x"))) for x in args.shapes] or [
        (1, 32768), (4, 32768), (16, 32768), (64, 32768), (1, 262144), (16, 131072), (4, 8192),
        (32, 4096)]
    for batch, ctx in shapes:
        p = Problem(batch, ctx, args.hq, args.hkv, args.d, args.page, device)
        cache, out = p.nvfp4_cache(), torch.empty_like(p.q)
        programs = batch * args.hkv
        chosen = choose_num_splits(batch, args.hkv, ctx, device, args.d)
        chosen_bn = choose_block_n(chosen, device, args.d)
        counts = {}  # split count -> how it was chosen (the first rule that gives it)
        for per_sm in (2, 3, 4, 6, 8, 12):
            counts.setdefault(math.ceil(per_sm * sms / programs), f"{per_sm} per SM")
        for waves in (1, 2, 3):
            counts.setdefault(waves * HOPPER_PROGRAMS_PER_SM * sms // programs, f"{waves} wave(s)")
        counts.setdefault(chosen, "the launcher's")
        timed = set()
        for want, rule in sorted(counts.items()):
            # capped as choose_num_splits does
            ns = clamp_splits(want, ctx, max_splits(programs, HOPPER_PROGRAMS_PER_SM * sms))
            if ns in timed:
                continue  # clamped onto a count already timed
            timed.add(ns)
            for block_n in sorted({64, 128, chosen_bn}):
                ms = time_fn(run_nvfp4(p, cache, out, num_splits=ns, block_n=block_n), device)
                row = dict(batch=batch, ctx=ctx, rule=rule, splits=ns, block_n=block_n,
                           waves=round(ns * programs / (HOPPER_PROGRAMS_PER_SM * sms), 2),
                           launcher_default=(ns, block_n) == (chosen, chosen_bn),
                           ms=ms, GBps=kv_gbps("nvfp4", batch, ctx, args, ms))
                res["rows"].append(row)
        rows = [r for r in res["rows"] if (r["batch"], r["ctx"]) == (batch, ctx)]
        best = min(rows, key=lambda r: r["ms"])
        default = next(r for r in rows if r["launcher_default"])
        print(f"best {batch} x {ctx}: {best['splits']} splits ({best['rule']}), "
              f"{best['block_n']}-token tiles, {best['ms'] * 1e3:.1f} us; the launcher's "
              f"{default['splits']} / {default['block_n']}: {default['ms'] * 1e3:.1f} us "
              f"({default['ms'] / best['ms']:.2f}x)", flush=True)
        del cache
    return res


def plot(res, path):
    plt = common.pyplot()
    rows = res["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for b in batches:
        rs = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["ctx"])
        for name, style in (("nvfp4", "-o"), ("int4", "-.d"), ("tq4", "-.x"), ("fp8", "--s"),
                            ("bf16", ":^")):
            xs = [r["ctx"] for r in rs if f"{name}_ms" in r]
            if xs:
                axes[0].plot(xs, [r[f"{name}_GBps"] for r in rs if f"{name}_ms" in r], style,
                             label=f"{name} b{b}")
        for key, style, lab in (("speedup_vs_fp8", "-o", "FP8"),
                                ("speedup_vs_int4", "-.d", "INT4"),
                                ("speedup_vs_tq4", "-.x", "TQ 4-bit")):
            xs = [r["ctx"] for r in rs if key in r]
            if xs:
                axes[1].plot(xs, [r[key] for r in rs if key in r], style, label=f"vs {lab}, b{b}")
    bw = res.get("copy_bandwidth_GBps")
    if bw and bw == bw:
        axes[0].axhline(bw, color="k", lw=0.8, label="copy bandwidth")
    axes[1].axhline(1.6, color="r", lw=0.8, ls="--", label="target 1.6x")
    for ax, t in zip(axes, ("effective KV GB/s",
                            "NVFP4 speed-up over FP8 (FA3), INT4 and TQ 4-bit (vLLM Triton)")):
        if ax is axes[0] or any(k in r for r in rows for k in ("speedup_vs_fp8", "speedup_vs_int4",
                                                                 "speedup_vs_tq4")):
            ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(t)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"decode attention, {res['gpu']}, heads {res['heads']}, {res['date']}")
    fig.tight_layout()
    common.save_figure(fig, path, dpi=110)


def plot_heads(res, path):
    """Per head configuration (a panel each): NVFP4's speed-up over FA3 FP8 (solid) and BF16
    (dashed) against the context, a line per batch, with the issue's targets (1.5x, 2.5x)."""
    plt = common.pyplot()
    rows = res["rows"]
    labels = list(dict.fromkeys(r["heads"] for r in rows))
    cols = min(4, len(labels))
    nrows = math.ceil(len(labels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    colors = dict(zip(sorted({r["batch"] for r in rows}), plt.rcParams["axes.prop_cycle"]
                      .by_key()["color"]))
    for ax, label in zip(axes.flat, labels):
        for b, color in colors.items():
            rs = sorted((r for r in rows if r["heads"] == label and r["batch"] == b),
                        key=lambda r: r["ctx"])
            for key, style in (("speedup_vs_fp8", "-o"), ("speedup_vs_bf16", "--^")):
                xs = [r["ctx"] for r in rs if key in r]
                if xs:
                    ax.plot(xs, [r[key] for r in rs if key in r], style, color=color, ms=3,
                            label=f"b{b} vs {key[-4:].lstrip('_').upper()}")
        for target, ls in ((1.5, "-"), (2.5, "--")):
            ax.axhline(target, color="r", lw=0.7, ls=ls)
        ax.set_xscale("log", base=2)
        ax.set_title(f"heads {label}", fontsize=9)
        ax.set_xlabel("context (tokens)", fontsize=8)
        ax.set_ylabel("NVFP4 speed-up", fontsize=8)
    for ax in list(axes.flat)[len(labels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"decode attention vs FA3 FP8 (solid) and BF16 (dashed), {res['gpu']}, "
                 f"{res['date']}; targets 1.5x / 2.5x", fontsize=9)
    fig.tight_layout()
    common.save_figure(fig, path, dpi=110)


def join(paths: list[str]) -> dict:
    """--heads sweep results (e.g. run in several calls) as one, rows in order of first
    appearance; the header is the first file's, with the sources listed."""
    results = [common.read_json(p) for p in paths]
    if len({r["gpu"] for r in results}) != 1:
        raise SystemExit("--join: the files come from different GPUs")
    rows = {}
    for r in results:
        for row in r["rows"]:
            rows[(row["heads"], row["batch"], row["ctx"])] = row
    return {**results[0], "rows": list(rows.values()), "joined_from": list(paths)}


def print_markdown(res):
    print(f"{res['gpu']}, {res['date']}, torch {res['torch']}, triton {res['triton']}, "
          f"vLLM {res.get('vllm', '-')} FA3; heads {res['heads']}, page {res['page']}; "
          f"copy bandwidth {res['copy_bandwidth_GBps']:.0f} GB/s (read + write)\n")
    print("| heads | batch | context | BF16 FA3 ms | FP8 FA3 ms | INT4 Triton ms "
          "| TQ 4-bit Triton ms | NVFP4 ms | NVFP4 speed-up vs FP8 | vs BF16 | vs INT4 "
          "| vs TQ 4-bit | NVFP4 KV GB/s | INT4 KV GB/s | % of copy bw |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["rows"]:
        f = lambda k, fmt=".3f": format(r[k], fmt) if k in r else "-"  # noqa: E731
        heads = r.get("heads", "/".join(map(str, res["heads"])))
        print(f"| {heads} | {r['batch']} | {r['ctx'] // 1024}K | {f('bf16_ms')} | {f('fp8_ms')} | "
              f"{f('int4_ms')} | {f('tq4_ms')} | {f('nvfp4_ms')} | {f('speedup_vs_fp8', '.2f')}x | "
              f"{f('speedup_vs_bf16', '.2f')}x | {f('speedup_vs_int4', '.2f')}x | "
              f"{f('speedup_vs_tq4', '.2f')}x | "
              f"{r['nvfp4_GBps']:.0f} | {f('int4_GBps', '.0f')} | "
              f"{100 * r['nvfp4_frac_copy_bw']:.0f}% |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="evals/results/decode.json")
    ap.add_argument("--ctx", type=int, nargs="+",
                    default=[4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--heads", nargs="+", default=[], metavar="HQ/HKV/D[+sinks][+wN]",
                    help="head configurations, one after another in one process (instead of "
                    "--hq/--hkv/--d; with sinks, with an N-token sliding window; a set name: "
                    + ", ".join(f"{k} = {' '.join(v)}" for k, v in HEAD_SETS.items())
                    + "); the sweep and --ab")
    ap.add_argument("--baselines", nargs="*", default=["fa3", "int4", "tq4"],
                    choices=["fa3", "int4", "tq4"], help="the sweep's baselines (default all)")
    ap.add_argument("--rep-ms", type=float, default=100,
                    help="CUDA-graph replay time of each measurement (do_bench_cudagraph rep)")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=1 << 26, help="skip batch*ctx above this")
    ap.add_argument("--max-dense-bytes", type=float, default=60e9,
                    help="skip an FP8/BF16 baseline whose cache is larger")
    ap.add_argument("--budget-s", type=float, default=420, help="stop starting new shapes after")
    ap.add_argument("--int4-max-tokens", type=int, default=65536,
                    help="time vLLM's int4_per_token_head only up to batch*ctx tokens (it "
                         "faulted at 262,144 on an H200, poisoning the CUDA context)")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--ab", action="store_true", help="kernel variants A/B (see ab())")
    ap.add_argument("--variants", nargs="+", help="--ab: only these variants (and mma_k, the "
                    "default kernel), e.g. v_rows mma_k_bn64")
    ap.add_argument("--split-sweep", action="store_true", help="see split_sweep()")
    ap.add_argument("--shapes", nargs="+", default=[], metavar="BATCHxCTX",
                    help="--split-sweep, --ab: these shapes instead of their own, e.g. "
                    "8x32768")
    ap.add_argument("--split-len", type=int, default=0, metavar="TOKENS",
                    help="size our split counts for at least this many tokens (the backend "
                    "sizes them for max_model_len), e.g. 131072 with short --shapes")
    ap.add_argument("--toy", action="store_true", help="CPU interpreter at toy sizes")
    ap.add_argument("--table", metavar="JSON", help="print a results file as a markdown table")
    ap.add_argument("--join", nargs="+", metavar="JSON",
                    help="--heads sweeps of one GPU joined into --out (and its per-head PNG): "
                    "a later file's row replaces an earlier one's at the same heads, batch "
                    "and context")
    ap.add_argument("--variant", default="default", choices=sorted(DECODE_VARIANTS),
                    help="the sweep's NVFP4 launch variant (kernels.decode.DECODE_VARIANTS)")
    ap.add_argument("--once", action="store_true",
                    help="run each timed function once, untimed (under compute-sanitizer)")
    ap.set_defaults(sinks=False, window=None)  # the --hq/--hkv/--d problem: neither
    args = ap.parse_args()
    global ONCE, REP_MS, SPLIT_LEN
    ONCE, REP_MS, SPLIT_LEN = args.once, args.rep_ms, args.split_len
    if args.table:
        print_markdown(common.read_json(args.table))
        return
    if args.join:
        res = join(args.join)
        common.write_json(args.out, res)
        plot_heads(res, os.path.splitext(args.out.removesuffix(".gz"))[0] + ".png")
        return
    if args.toy:
        args.ctx, args.batch, args.hq, args.hkv = [64, 200], [1, 2], 4, 1
    res = (tune(args) if args.tune else ab(args) if args.ab
           else split_sweep(args) if args.split_sweep else bench(args))
    common.write_json(args.out, res)
    if args.ab or args.split_sweep:
        return
    if not args.tune and res["rows"]:
        (plot_heads if args.heads else plot)(res, common.png_path(args.out))
    if not args.tune:
        print(f"{'heads':>18} {'ctx':>8} {'b':>3} {'nvfp4 ms':>9} {'int4 ms':>8} {'tq4 ms':>8} "
              f"{'fp8 ms':>8} {'bf16 ms':>8} {'x int4':>6} {'x tq4':>6} {'x fp8':>6} "
              f"{'x bf16':>6} {'GB/s':>6} {'%copy':>6}")
        for r in res["rows"]:
            print(f"{r['heads']:>18} {r['ctx']:>8} {r['batch']:>3} {r['nvfp4_ms']:>9.4f} "
                  f"{r.get('int4_ms', float('nan')):>8.4f} {r.get('tq4_ms', float('nan')):>8.4f} "
                  f"{r.get('fp8_ms', float('nan')):>8.4f} {r.get('bf16_ms', float('nan')):>8.4f} "
                  f"{r.get('speedup_vs_int4', float('nan')):>6.2f} "
                  f"{r.get('speedup_vs_tq4', float('nan')):>6.2f} "
                  f"{r.get('speedup_vs_fp8', float('nan')):>6.2f} "
                  f"{r.get('speedup_vs_bf16', float('nan')):>6.2f} "
                  f"{r.get('nvfp4_GBps', float('nan')):>6.0f} "
                  f"{100 * r['nvfp4_frac_copy_bw']:>6.1f}")


if __name__ == "__main__":
    main()
