"""Every Triton kernel compiles to machine code for Ampere (sm_80), Ada (sm_89) and Hopper
(sm_90), with Triton's bundled ptxas: runs on a CPU-only machine, so CI catches code the
interpreter accepts but the compiler rejects (constexpr globals, inline PTX, layouts),
floating-point contraction the interpreter would not show (the writer is compiled without),
and, per head size, the resident programs per SM that the decode launcher's split rule
assumes, without spills, with K and V^T decoded straight into the wgmma operands.

The compilation runs in a subprocess: kernels imported under TRITON_INTERPRET=1 (the other
tests on a CPU) are interpreter objects, not compilable."""
import json
import os
import re
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


def _register_operand_dots(kernel) -> list[bool]:
    """For each wgmma of the kernel's TTGIR: whether its A operand comes from registers as
    computed (not read back from shared memory or converted: ttg.local_load /
    ttg.convert_layout), with no layout conversion of fp16 or int32 tensors (decoded values,
    page words) anywhere in the kernel."""
    ir = kernel.asm["ttgir"]
    defs = {m.group(1): m.group(2) for m in re.finditer(r"(%[\w.]+)(?::\d+)? = ([\w.]+)", ir)}
    converted = re.findall(r"ttg\.convert_layout %[\w.]+ : tensor<[\dx]*(?:f16|i32),", ir)
    return [defs.get(a) not in ("ttg.local_load", "ttg.convert_layout") and not converted
            for a in re.findall(r"ttng\.warp_group_dot (%[\w.]+)", ir)]


def _hopper_launches() -> dict:
    """Per head size of decode.HOPPER_LAUNCHES, the sm_90 build of the launch (its tile, the
    default pipeline, its register cap; GQA 8, softcap, window and sinks on): registers,
    spill stack, programs per SM, and whether every wgmma takes its A operand from
    registers (K and V^T decoded straight into the operand layouts; at D = 64 load_vt_mma's
    lane-dependent decode is right only in that layout)."""
    from vllm_nvfp4kv.kernels import aot
    from vllm_nvfp4kv.kernels.decode import HOPPER_LAUNCHES
    out = {}
    for d in HOPPER_LAUNCHES:
        k = aot.compile_hopper_decode(d, qpk=8, features=True)
        out[d] = {**aot.resources(k, 90), "register_operands": _register_operand_dots(k)}
    return out


def _reduces() -> dict:
    """Per head size of decode.HOPPER_LAUNCHES and split cap (decode.max_splits: 64, and 128
    at small grids), the sm_90 build of the split-KV reduction: registers, spill stack."""
    from vllm_nvfp4kv.kernels import aot
    from vllm_nvfp4kv.kernels.decode import HOPPER_LAUNCHES, MAX_SPLITS, SMALL_GRID_MAX_SPLITS
    return {f"{d}/{s}": aot.resources(aot.compile_reduce(d, s), 90)
            for d in HOPPER_LAUNCHES for s in (MAX_SPLITS, SMALL_GRID_MAX_SPLITS)}


def _large_head_launches() -> dict:
    """The decode launch at head sizes without a Hopper launch, as decode_attention chooses
    its tile (few splits and many: choose_block_n), on each architecture: registers, spill
    stack, shared memory and programs per SM."""
    import torch

    from vllm_nvfp4kv.kernels import aot
    from vllm_nvfp4kv.kernels.decode import choose_block_n
    fn, sig, _, _ = aot.specs()["decode"]
    cpu = torch.device("cpu")
    out = {}
    for d in (160, 288, 512):
        for splits in (4, 32):
            bn = choose_block_n(splits, cpu, d)
            const = aot.decode_constexprs(bn, 4, 4, d, mma_k=False, features=True,
                                          mma_v=False, bt_ahead=False)
            for arch in ARCHS:
                k = aot.compile_kernel(fn, sig, const, arch, 4, 2)
                out[f"D{d} tile {bn} sm_{arch}"] = aot.resources(k, arch)
    return out


def test_kernels_compile_for_sm80_sm89_sm90():
    from vllm_nvfp4kv.kernels.decode import HOPPER_LAUNCHES
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["failures"] == {}
    # choose_num_splits fills one wave of this many programs per SM on Hopper, per head size
    for d, launch in HOPPER_LAUNCHES.items():
        got = out["hopper_launches"][str(d)]
        assert got["programs_per_sm"] == launch.programs_per_sm, (d, got)
        assert got["stack"] == 0, (d, got)  # no spills, also under the register cap
        assert len(got["register_operands"]) == 2 and all(got["register_operands"]), (d, got)
    # the reduction after a decode of up to 128 splits: partials summed in chunks, no spill
    # (all 128 x 256 at once spill at D = 256)
    assert len(out["reduces"]) == 6
    for key, got in out["reduces"].items():
        assert got["stack"] == 0, (key, got)
    # the other head sizes up to 512: every launch the launcher picks fits an SM of each
    # architecture without spilling (128-token tiles at D > 256 did not fit an Ada SM, and
    # spilled on it at D = 160 with triton 3.7)
    assert {k.rsplit(" ", 1)[0] for k in out["large_heads"]} == {
        "D160 tile 64", "D288 tile 32", "D512 tile 32"}
    for key, got in out["large_heads"].items():
        assert got["programs_per_sm"] >= 1 and got["stack"] == 0, (key, got)


if __name__ == "__main__":
    print(json.dumps({"failures": _compile_all(), "hopper_launches": _hopper_launches(),
                      "reduces": _reduces(), "large_heads": _large_head_launches()}))
