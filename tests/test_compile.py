"""Every Triton kernel compiles to machine code for Ampere (sm_80), Ada (sm_89) and Hopper
(sm_90), with Triton's bundled ptxas: runs on a CPU-only machine, so CI catches code the
interpreter accepts but the compiler rejects (constexpr globals, inline PTX, layouts),
floating-point contraction the interpreter would not show (the writer is compiled without),
and the resident programs per SM that the decode launcher's split rule assumes.

The compilation runs in a subprocess: kernels imported under TRITON_INTERPRET=1 (the other
tests on a CPU) are interpreter objects, not compilable."""
import json
import os
import subprocess
import sys

ARCHS = (80, 89, 90)


def _compile_all() -> dict:
    from vllm_nvfp4kv.kernels import aot, cache_write
    failures = {}
    for name, (fn, sig, const, warps) in aot.specs().items():
        for arch in ARCHS:
            try:
                k = aot.compile_kernel(fn, sig, const, arch, warps, aot.STAGES.get(name, 2))
                assert k.asm["cubin"]
                # the writer's E2M1 rounding matches the reference only without contraction
                # (cache_write.WRITE_COMPILE_OPTIONS): the interpreter never contracts
                assert fn is not cache_write._write_kernel or "fma." not in k.asm["ptx"], \
                    "fused multiply-add in the cache writer"
            except Exception as e:  # noqa: BLE001 - reported by the test
                failures[f"{name} sm_{arch}"] = f"{type(e).__name__}: {e}"[:400]
    return failures


def _decode_programs_per_sm() -> int:
    """Programs of the Hopper decode launch (D = 128, 128-token tiles, the default pipeline)
    that fit one SM, from the sm_90 build's registers and shared memory."""
    from vllm_nvfp4kv.kernels import aot
    fn, sig, _, warps = aot.specs()["decode"]
    k = aot.compile_kernel(fn, sig, aot.decode_constexprs(block_n=128, bt_ahead=True), 90,
                           warps, aot.STAGES["decode"])
    return aot.resources(k, 90)["programs_per_sm"]


def test_kernels_compile_for_sm80_sm89_sm90():
    from vllm_nvfp4kv.kernels.decode import HOPPER_PROGRAMS_PER_SM
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["failures"] == {}
    # choose_num_splits fills one wave of this many programs per SM on Hopper
    assert out["decode_sm90_programs_per_sm"] == HOPPER_PROGRAMS_PER_SM


if __name__ == "__main__":
    print(json.dumps({"failures": _compile_all(),
                      "decode_sm90_programs_per_sm": _decode_programs_per_sm()}))
