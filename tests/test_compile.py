"""Every Triton kernel compiles to machine code for Ampere (sm_80), Ada (sm_89) and Hopper
(sm_90), with Triton's bundled ptxas: runs on a CPU-only machine, so CI catches code the
interpreter accepts but the compiler rejects (constexpr globals, inline PTX, layouts), and
floating-point contraction the interpreter would not show (the writer is compiled without).

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


def test_kernels_compile_for_sm80_sm89_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == {}


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
