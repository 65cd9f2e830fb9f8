"""Ahead-of-time compilation of the kernels as their launchers specialise them (argument
types, 16-byte alignment, constexprs), for any NVIDIA target with Triton's bundled ptxas: no
GPU needed. Used by tests/test_compile.py (every kernel compiles for sm_80/89/90) and
evals/profile_decode.py (SASS of the decode loop), and resources() gives the registers and
programs per SM that the decode launcher's split rule assumes."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from .decode import mma_k_applies
from .format import BLOCK_SCALE_RULES, DEFAULT_BLOCK_SCALES

P = "*u8"
# what the launchers' arguments are, beyond pointers, known to be multiples of 16
# (Triton's launcher specialises every int argument that is one at run time, unless the kernel
# says do_not_specialize; these are)
DIV16 = ("page_stride", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kt",
         "stride_kh", "stride_vt", "stride_vh")


def decode_constexprs(block_n: int = 128, warps: int = 4, qpk: int = 4, d: int = 128,
                      mma_k: bool = True, features: bool = False,
                      v_halves: bool = True, mma_v: bool = True, bt_ahead: bool = False,
                      kv_heads: int = 8, min_split_tiles: int = 1) -> dict:
    """The decode kernel's constexprs as decode_attention sets them (Llama-3-8B heads, page
    16, several splits); features: softcap, sliding window and sinks on."""
    mma_k = mma_k and mma_k_applies(d, warps, block_n)
    return dict(H=kv_heads, QPK=qpk, QG_PAD=max(16, triton.next_power_of_2(qpk)), N=16, D=d,
                G_PAD=triton.next_power_of_2(d // 16), BLOCK_N=block_n, SPLIT=True,
                USE_ASM=True, HAS_SOFTCAP=features, HAS_WINDOW=features, HAS_SINKS=features,
                MMA_K=mma_k, NW=warps, V_HALVES=v_halves,
                MMA_V=mma_v and mma_k and warps == 4, BT_AHEAD=bt_ahead,
                MIN_SPLIT_TILES=min_split_tiles)


def compile_hopper_decode(d: int, qpk: int = 4, kv_heads: int = 8, launches: dict | None = None,
                          features: bool = False):
    """The decode kernel as decode_attention launches it on Hopper at head size d
    (decode.HOPPER_LAUNCHES[d] or launches' replacement: its tile, 4 warps, block-table entries
    a tile ahead with 4 load stages where the tile is <= 128 tokens, else 2, its register
    cap), compiled for sm_90."""
    from . import decode
    launch = decode.hopper_launch(d, launches)
    bt_ahead = launch.block_n <= 128
    return compile_kernel(decode._decode_kernel, specs()["decode"][1],
                          decode_constexprs(launch.block_n, 4, qpk, d, features=features,
                                            bt_ahead=bt_ahead, kv_heads=kv_heads),
                          90, 4, 4 if bt_ahead else 2, launch.maxnreg)


def compile_reduce(d: int, num_splits: int, hq: int = 16, arch: int = 90):
    """The split-KV reduction as decode_attention launches it after a decode of num_splits
    splits at head size d (sinks on), compiled for sm_<arch>."""
    from . import decode
    fn, sig, _, warps = specs()["reduce"]
    return compile_kernel(fn, sig, decode.reduce_constexprs(hq, d, num_splits, True), arch,
                          warps)


# load pipeline depth of the specs that are built for a deeper one (others: 2)
STAGES = {"decode": 4, "decode-smem-k-bt-ahead": 3, "decode-d64": 4, "decode-d256": 4}


def specs() -> dict:
    """name -> (kernel, argument types, constexprs, num_warps)."""
    from . import cache_write, decode, gather, global_scale
    decode_sig = dict(q_ptr="*bf16", cache_ptr=P, block_table_ptr="*i32", seq_lens_ptr="*i32",
                      k_scale_ptr="*fp32", v_scale_ptr="*fp32", sinks_ptr="*fp32",
                      out_ptr="*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32",
                      stride_qt="i32", stride_qh="i32", stride_ot="i32", stride_oh="i32",
                      stride_bt="i32", page_stride="i64", sm_scale="fp32", softcap="fp32",
                      window="i32", num_splits="i32")
    write_sig = dict(key_ptr="*bf16", value_ptr="*bf16", cache_ptr=P, slot_ptr="*i64",
                     k_scale_ptr="*fp32", v_scale_ptr="*fp32", k_sub_ptr="*bf16",
                     rot_on_ptr="*i32", T="i32", stride_kt="i32", stride_kh="i32", stride_vt="i32",
                     stride_vh="i32", page_stride="i64", rot_c="fp32")

    reduce_sig = dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", sinks_ptr="*fp32",
                      out_ptr="*bf16", stride_ot="i32", stride_oh="i32", num_splits="i32")
    put_sig = dict(x_ptr="*bf16", rows_ptr="*i64", out_ptr="*bf16", sub_ptr="*bf16",
                   mul_ptr="*bf16", rot_on_ptr="*i32", div_ptr="*fp32", T="i32", big="fp32",
                   rot_c="fp32", stride_xt="i32", stride_xh="i32", stride_ot="i32",
                   stride_oh="i32")

    def write_constexprs(k_sub=False, rotate_k=False, rot_flag=False, bt=1):
        return dict(H=8, N=16, D=128, G_PAD=8, HAS_K_SUB=k_sub, ROTATE_K=rotate_k,
                    ROT_FLAG=rot_flag, LOG2_D=7, BT=bt,
                    RULE=BLOCK_SCALE_RULES.index(DEFAULT_BLOCK_SCALES))
    return {
        "write": (cache_write._write_kernel, write_sig, write_constexprs(), 1),
        # the prefill launch (cache_write.tokens_per_program_for)
        "write-2-tokens": (cache_write._write_kernel, write_sig, write_constexprs(bt=2), 1),
        "write-k-transform": (cache_write._write_kernel, write_sig,
                              write_constexprs(k_sub=True, rotate_k=True), 1),
        "write-k-transform-flag": (cache_write._write_kernel, write_sig,
                                   write_constexprs(k_sub=True, rotate_k=True, rot_flag=True),
                                   1),
        "gather": (gather._gather_kernel,
                   dict(cache_ptr=P, block_table_ptr="*i32", cu_tokens_ptr="*i32",
                        seq_starts_ptr="*i32", out_starts_ptr="*i32", k_out_ptr="*bf16",
                        v_out_ptr="*bf16", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                        out_div="fp32", stride_bt="i32", page_stride="i64", stride_ot="i32",
                        stride_oh="i32"),
                   dict(H=8, N=16, D=128, G_PAD=8, BLOCK_T=32, USE_ASM=True,
                        HAS_OUT_STARTS=True), 4),
        # the chunk's K into a BF16 workspace (centered, per-layer rotation), and V into FP8
        "put-rows": (gather._put_rows_kernel, put_sig,
                     dict(D=128, LOG2_D=7, BLOCK_T=16, HAS_SUB=True, HAS_MUL=False, ROTATE=True,
                          ROT_FLAG=True, FP8=False), 4),
        "put-rows-fp8": (gather._put_rows_kernel, {**put_sig, "out_ptr": P},
                         dict(D=128, LOG2_D=7, BLOCK_T=16, HAS_SUB=False, HAS_MUL=False,
                              ROTATE=False, ROT_FLAG=False, FP8=True), 4),
        # the Hopper launch: block-table entries a tile ahead, 4 load stages (STAGES)
        "decode": (decode._decode_kernel, decode_sig,
                   decode_constexprs(features=True, bt_ahead=True), 4),
        "decode-smem-k-d96": (decode._decode_kernel, decode_sig,
                              decode_constexprs(d=96, features=True), 4),
        # the Hopper launches at D = 64 (gpt-oss heads: 8 per KV head) and 256 (Qwen3-Next:
        # 8), decode.HOPPER_LAUNCHES (their register cap: compile_hopper_decode)
        "decode-d64": (decode._decode_kernel, decode_sig,
                       decode_constexprs(qpk=8, d=64, features=True, bt_ahead=True), 4),
        "decode-d256": (decode._decode_kernel, decode_sig,
                        decode_constexprs(block_n=64, qpk=8, d=256, features=True,
                                          bt_ahead=True, kv_heads=2), 4),
        "decode-drain": (decode._decode_kernel, decode_sig, decode_constexprs(features=True), 4),
        "decode-smem-k-bt-ahead": (decode._decode_kernel, decode_sig,
                                   decode_constexprs(features=True, mma_k=False, bt_ahead=True),
                                   4),
        "decode-8warps": (decode._decode_kernel, decode_sig, decode_constexprs(warps=8), 8),
        "decode-full-v": (decode._decode_kernel, decode_sig,
                          decode_constexprs(features=True, v_halves=False, mma_v=False), 4),
        "decode-v-rows": (decode._decode_kernel, decode_sig,
                          decode_constexprs(features=True, mma_v=False), 4),
        # the launcher's default off Hopper (decode.has_wgmma): K through shared memory
        "decode-smem-k": (decode._decode_kernel, decode_sig,
                          decode_constexprs(features=True, mma_k=False), 4),
        # the split-KV reduction up to 64 splits, and past them (decode.max_splits) at the
        # largest head size (compile_reduce: every head size and cap)
        "reduce": (decode._reduce_kernel, reduce_sig,
                   decode.reduce_constexprs(32, 128, decode.MAX_SPLITS, True), 4),
        "reduce-d256-s128": (decode._reduce_kernel, reduce_sig,
                             decode.reduce_constexprs(16, 256, decode.SMALL_GRID_MAX_SPLITS,
                                                      True), 4),
        "calibrate": (global_scale._calibrate_kernel,
                      dict(key_ptr="*bf16", value_ptr="*bf16", slot_ptr="*i64",
                           k_scale_ptr="*fp32", v_scale_ptr="*fp32", flag_ptr="*i32", T="i32",
                           factor="fp32", stride_kt="i32", stride_kh="i32", stride_vt="i32",
                           stride_vh="i32"),
                      dict(H=8, D=128, D_PAD=128, BLOCK_T=16), 4),
    }


def compile_kernel(fn, signature: dict, constexprs: dict, arch: int, num_warps: int,
                   num_stages: int = 2, maxnreg: int | None = None):
    """triton.compile for cuda sm_<arch>, pointers (but those the kernel does not specialise on
    alignment) and DIV16 arguments 16-byte aligned; maxnreg: cap on registers per thread
    (ptxas spills the rest)."""
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    unaligned = set(fn.do_not_specialize_on_alignment)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items())
             if (v.startswith("*") and k not in unaligned) or k in DIV16}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       **launch_options(fn),
                                       **({} if maxnreg is None else {"maxnreg": maxnreg})))


# per SM: shared memory a kernel may use, resident threads (CUDA programming guide; 65,536
# registers on all three)
SM_LIMITS = {80: (164 * 1024, 2048), 89: (100 * 1024, 1536), 90: (227 * 1024, 2048)}


def cuda_tool(kernel, tool: str, *args: str) -> str:
    """Output of one of Triton's bundled CUDA binary tools (nvdisasm, cuobjdump) run on a
    compiled kernel's cubin."""
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([exe, *args, f.name], capture_output=True, text=True).stdout


def resources(kernel, arch: int) -> dict:
    """Registers per thread, spill stack and shared memory of a kernel compiled for
    sm_<arch>, and the programs of it that fit one SM (registers, shared memory, threads)."""
    out = cuda_tool(kernel, "cuobjdump", "-res-usage")
    regs, stack = (int(re.search(rf"{k}:(\d+)", out).group(1)) for k in ("REG", "STACK"))
    smem, threads = kernel.metadata.shared, 32 * kernel.metadata.num_warps
    smem_max, threads_max = SM_LIMITS[arch]
    fit = min(65536 // (regs * threads), smem_max // max(1, smem), threads_max // threads)
    return dict(registers=regs, stack=stack, shared=smem, programs_per_sm=fit)


def launch_options(fn) -> dict:
    """Compile options a kernel's launcher passes besides num_warps and num_stages."""
    from . import cache_write
    if fn is cache_write._write_kernel:
        return dict(enable_fp_fusion=cache_write.WRITE_COMPILE_OPTIONS["enable_fp_fusion"])
    return {}
