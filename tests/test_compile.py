"""Every Triton kernel compiles to machine code for Ampere (sm_80), Ada (sm_89) and Hopper
(sm_90), with Triton's bundled ptxas: runs on a CPU-only machine, so CI catches code the
interpreter accepts but the compiler rejects (constexpr globals, inline PTX, layouts).

The compilation runs in a subprocess: kernels imported under TRITON_INTERPRET=1 (the other
tests on a CPU) are interpreter objects, not compilable."""
import json
import os
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget

ARCHS = (80, 89, 90)

P = "*u8"
DIV16 = ("page_stride", "stride_qt", "stride_ot", "stride_bt", "stride_kt", "stride_vt")

def _kernels():
    from vllm_nvfp4kv.kernels import cache_write, decode, gather
    return {
        "write": (cache_write._write_kernel,
                  dict(key_ptr="*bf16", value_ptr="*bf16", cache_ptr=P, slot_ptr="*i64",
                       k_scale_ptr="*fp32", v_scale_ptr="*fp32", stride_kt="i32", stride_kh="i32",
                       stride_vt="i32", stride_vh="i32", page_stride="i64"),
                  dict(H=8, N=16, D=128, G_PAD=8, FOUR_OVER_SIX=True), 1),
        "gather": (gather._gather_kernel,
                   dict(cache_ptr=P, block_table_ptr="*i32", cu_tokens_ptr="*i32",
                        seq_starts_ptr="*i32", out_starts_ptr="*i32", k_out_ptr="*bf16",
                        v_out_ptr="*bf16", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                        out_div="fp32", stride_bt="i32", page_stride="i64", stride_ot="i32",
                        stride_oh="i32"),
                   dict(H=8, N=16, D=128, G_PAD=8, BLOCK_T=32, USE_ASM=True, HAS_OUT_STARTS=True),
                   4),
        "decode": (decode._decode_kernel,
                   dict(q_ptr="*bf16", cache_ptr=P, block_table_ptr="*i32", seq_lens_ptr="*i32",
                        k_scale_ptr="*fp32", v_scale_ptr="*fp32", sinks_ptr="*fp32",
                        out_ptr="*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32",
                        stride_qt="i32", stride_qh="i32", stride_ot="i32", stride_oh="i32",
                        stride_bt="i32", page_stride="i64", sm_scale="fp32", softcap="fp32",
                        window="i32"),
                   dict(H=8, QPK=4, QG_PAD=16, N=16, D=128, G_PAD=8, BLOCK_N=128, NUM_SPLITS=4,
                        USE_ASM=True, HAS_SOFTCAP=True, HAS_WINDOW=True, HAS_SINKS=True), 4),
        "reduce": (decode._reduce_kernel,
                   dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", sinks_ptr="*fp32",
                        out_ptr="*bf16", stride_ot="i32", stride_oh="i32"),
                   dict(HQ=32, D=128, D_PAD=128, NUM_SPLITS=4, S_PAD=4, HAS_SINKS=True), 4),
    }


def _compile_all() -> dict:
    failures = {}
    for name, (fn, sig, const, warps) in _kernels().items():
        sig = {**sig, **{k: "constexpr" for k in const}}
        # what the launcher specialises at run time: 16-byte aligned pointers and strides
        attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items())
                 if v.startswith("*") or k in DIV16}
        for arch in ARCHS:
            try:
                src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const,
                                                attrs=attrs)
                kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                        options=dict(num_warps=warps))
                assert kernel.asm["cubin"]
            except Exception as e:  # noqa: BLE001 - reported by the test
                failures[f"{name} sm_{arch}"] = f"{type(e).__name__}: {e}"[:400]
    return failures


def test_kernels_compile_for_sm80_sm89_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == {}


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
