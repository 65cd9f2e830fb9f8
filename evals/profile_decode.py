"""Profile one decode launch per kernel (ours, FA3 FP8, FA3 BF16) at one shape, for Nsight
Compute: where does the NVFP4 decode kernel lose bandwidth (issue slots, stalls, occupancy)?

    ncu --launch-skip 3 --launch-count 3 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section InstructionStats --section LaunchStats \\
        python -P -m evals.profile_decode --batch 8 --ctx 32768

Also prints the static instruction mix of our kernel's main loop (SASS via nvdisasm): issued
warp-instructions per KV byte, the quantity that bounds a software-dequantizing kernel.
Without a GPU, `--sass-only` compiles the kernel for sm_90 (or --arch) with Triton's own ptxas
and prints just that mix (the number the kernel's design is judged by before any GPU time):

    python -P -m evals.profile_decode --sass-only [--block-n 128 --warps 4 --stages 2]
        [--full-v] [--v-rows] [--no-mma-k] [--maxnreg 128] [--bt-ahead] [--arch 90|89|80]
        [--d 64|128|256] [--qpk 8]
    python -P -m evals.profile_decode --sass-only --launch --d 64   # decode.HOPPER_LAUNCHES[64]
"""
from __future__ import annotations

import argparse
import collections
import re

import torch

from evals import bench_decode as bd
from vllm_nvfp4kv.kernels import aot
from vllm_nvfp4kv.kernels.decode import hopper_launch
from vllm_nvfp4kv.kernels.format import row_bytes


def loop_mix(kernel, block_n: int, num_warps: int, bytes_per_token: int = 144) -> str:
    """Instruction counts of the longest loop in the kernel's SASS per KV byte
    (bytes_per_token: K + V bytes of one token and KV head, 144 at D = 128), and its cp.async
    waits (DEPBAR.LE SB0, n: wait until at most n copy groups are in flight; 0 at the loop top
    means each tile's loads are drained before it is used, none loading while one computes)."""
    sass = aot.cuda_tool(kernel, "nvdisasm", "-c")
    lines = [re.sub(r"/\*[^*]*\*/", "", x) for x in sass.splitlines()]
    labels = {m.group(1): i for i, x in enumerate(lines)
              if (m := re.match(r"\s*\.(L_x_\d+):", x))}
    best = (0, 0)
    for i, x in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", x)
        if m and m.group(1) in labels and labels[m.group(1)] < i \
                and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
    ops = collections.Counter(
        m.group(1) for x in lines[best[0]:best[1]]
        if (m := re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", x.strip())))
    n = sum(ops.values())
    return (f"loop: {n} instructions/thread per {block_n}-token tile, "
            f"{n * num_warps / (block_n * bytes_per_token):.3f} warp-instructions per KV byte; "
            f"top: {ops.most_common(10)}\n"
            f"cp.async waits (groups left in flight): "
            f"{', '.join(re.findall(r'DEPBAR.LE SB0, (0x[0-9a-f]+)', sass)) or 'none'}")


def compile_sass(block_n: int, warps: int, stages: int, qpk: int = 4, d: int = 128,
                 mma_k: bool = True, v_halves: bool = True, maxnreg: int | None = None,
                 arch: int = 90, mma_v: bool = True, bt_ahead: bool = False):
    """The decode kernel as the launcher specialises it (Llama-3-8B heads, page 16), compiled
    ahead of time for sm_<arch>: no GPU needed."""
    fn, sig, _, _ = aot.specs()["decode"]
    return aot.compile_kernel(fn, sig, aot.decode_constexprs(block_n, warps, qpk, d, mma_k,
                                                             v_halves=v_halves, mma_v=mma_v,
                                                             bt_ahead=bt_ahead),
                              arch, warps, stages, maxnreg)


def resources(kernel, arch: int = 90) -> str:
    r = aot.resources(kernel, arch)
    return (f"registers/thread {r['registers']}, spill stack {r['stack']} B, shared "
            f"{r['shared']} B: {r['programs_per_sm']} programs per SM of sm_{arch}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--skip-fa3", action="store_true")
    ap.add_argument("--sass-only", action="store_true", help="no GPU: compile for sm_ARCH, print "
                    "the loop's instruction mix")
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--no-mma-k", action="store_true", help="K through shared memory (the "
                    "layout before codec.load_tile_mma)")
    ap.add_argument("--full-v", action="store_true", help="with V in rows (--v-rows, --no-mma-k, "
                    "--arch 80/89): P.V over the whole head dim instead of in halves")
    ap.add_argument("--v-rows", action="store_true", help="V decoded in rows and transposed "
                    "through shared memory (not straight into the MMA operand)")
    ap.add_argument("--maxnreg", type=int, help="cap on registers per thread")
    ap.add_argument("--bt-ahead", action="store_true", help="block-table entries a tile ahead "
                    "(with --stages 3 or 4: K/V tiles stay in flight across the loop top; "
                    "the launcher's Hopper default is --bt-ahead --stages 4)")
    ap.add_argument("--d", type=int, default=128, help="--sass-only: head size")
    ap.add_argument("--qpk", type=int, default=4, help="--sass-only: query heads per KV head")
    ap.add_argument("--launch", action="store_true", help="--sass-only: the launcher's Hopper "
                    "launch at --d (decode.HOPPER_LAUNCHES: its tile, pipeline and register "
                    "cap, in place of --block-n, --warps, --stages, --bt-ahead, --maxnreg)")
    ap.add_argument("--arch", type=int, default=90, help="--sass-only: the sm_ target (80, 89: "
                    "mma.sync, where the launcher's default is --no-mma-k)")
    args = ap.parse_args()
    if args.sass_only:
        block_n, warps = args.block_n, args.warps
        if args.launch:
            block_n, warps = hopper_launch(args.d).block_n, 4
            kernel = aot.compile_hopper_decode(args.d, args.qpk)
        else:
            kernel = compile_sass(block_n, warps, args.stages, args.qpk, args.d,
                                  mma_k=not args.no_mma_k, v_halves=not args.full_v,
                                  maxnreg=args.maxnreg, arch=args.arch, mma_v=not args.v_rows,
                                  bt_ahead=args.bt_ahead)
        print(resources(kernel, args.arch))
        print(loop_mix(kernel, block_n, warps, 2 * row_bytes(args.d)))
        return
    dev = torch.device("cuda")
    p = bd.Problem(args.batch, args.ctx, 32, 8, 128, 16, dev)
    cache = p.nvfp4_cache()
    out = torch.empty_like(p.q)
    fns = [("nvfp4", bd.run_nvfp4(p, cache, out, mma_k=not args.no_mma_k))]
    if not args.skip_fa3:
        for name, dt in (("fp8", torch.float8_e4m3fn), ("bf16", torch.bfloat16)):
            k, v = p.dense_cache(dt)
            fns.append((name, bd.fa3_fn(p, k, v, name == "fp8")))
    for name, fn in fns:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
    from vllm_nvfp4kv.kernels.decode import _decode_kernel, choose_block_n, choose_num_splits
    kernel_cache = _decode_kernel.device_caches[torch.cuda.current_device()][0]
    for kernel in list(kernel_cache.values())[:1]:  # the variant just launched
        meta = kernel.metadata
        print(f"registers/thread {kernel.n_regs}, spills {kernel.n_spills}, "
              f"shared {meta.shared} B, warps {meta.num_warps}")
        block_n = choose_block_n(choose_num_splits(args.batch, 8, args.ctx, dev), dev)
        print(loop_mix(kernel, block_n, meta.num_warps))


if __name__ == "__main__":
    main()
