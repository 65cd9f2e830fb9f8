"""Design study, SASS only (no GPU, not used by the plugin): can V reach the second MMA of
the decode kernel, O^T = V^T P^T, from registers instead of through shared memory?

Today a page's V words hold 8 head-dim elements of one token, while the Hopper wgmma A operand
(V^T: rows = head dim, contraction = tokens) wants each 32-bit register to hold one head-dim
element of two consecutive tokens; so V^T is staged in shared memory (32 KB per 128-token
tile). The proposed layout (evals/RESULTS.md, "What bounds it"): a word holds 4 head-dim
elements of a token pair, d = 16 w + r + {0, 8, 64, 72} (the 4 rows one thread (warp w, lane
4 r + c) holds in the two 64-row halves of V^T), and a page's words are ordered d-quad-major,
token-pair-minor (word (q, tp) at 8 q + tp, tp = 2 c + u), so each thread loads its 2 words
of a page as one 8-byte vector and lanes sit where the MMA wants them; the tokens are then
contracted in the permuted order (page, c, u, parity), P^T's rows alike.

Compiles two fragments for sm_90 with Triton's ptxas, each decoding a V tile of 8 pages (128
tokens) and multiplying it by a P^T [128, 16] (no scales, no softmax: the data movement is
the question; the decoder's bit semantics are today's, so neither fragment computes the real
values): `rows`, today's load-decode-transpose, and `pairs`, the proposed layout. Prints
shared memory, registers and the instruction mix.

    python evals/v_layout_study.py
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_decode as pd  # noqa: E402
from vllm_nvfp4kv.kernels.codec import word_values  # noqa: E402


@triton.jit
def _pairs(v_ptr, pt_ptr, out_ptr, S: tl.constexpr):
    s = tl.arange(0, S)[:, None, None, None, None]     # page of the tile
    u = tl.arange(0, 2)[None, :, None, None, None]     # token pair 2 c + u of the page
    w = tl.arange(0, 4)[None, None, :, None, None]     # warp
    r = tl.arange(0, 8)[None, None, None, :, None]     # lane // 4
    c = tl.arange(0, 4)[None, None, None, None, :]     # lane % 4
    words = tl.load(v_ptr + s * 256 + (8 * w + r) * 8 + 2 * c + u)      # [S, 2, 4, 8, 4]
    vals = tl.reshape(word_values(words, True), (S, 2, 4, 8, 4, 2, 2, 2))  # .. m h p
    # element 2 k + p, k = 2 m + h: row d = 64 m + 16 w + 8 h + r, token parity p
    vt = tl.reshape(tl.permute(vals, (5, 2, 6, 3, 0, 4, 1, 7)), (128, S * 16))
    tok = tl.arange(0, S * 16)
    pt = tl.load(pt_ptr + tok[:, None] * 16 + tl.arange(0, 16)[None, :])
    d = tl.arange(0, 128)
    tl.store(out_ptr + d[:, None] * 16 + tl.arange(0, 16)[None, :], tl.dot(vt, pt))


@triton.jit
def _rows(v_ptr, pt_ptr, out_ptr, S: tl.constexpr):
    tok = tl.arange(0, S * 16)
    words = tl.load(v_ptr + tok[:, None] * 16 + tl.arange(0, 16)[None, :])
    v = tl.reshape(word_values(words, True), (S * 16, 128))
    pt = tl.load(pt_ptr + tok[:, None] * 16 + tl.arange(0, 16)[None, :])
    d = tl.arange(0, 128)
    tl.store(out_ptr + d[:, None] * 16 + tl.arange(0, 16)[None, :],
             tl.dot(tl.trans(v), pt))


def study(fn) -> dict:
    sig = dict(v_ptr="*i32", pt_ptr="*fp16", out_ptr="*fp32", S="constexpr")
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={"S": 8},
                                    attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    sass = pd._cuda_tool(k, "nvdisasm", "-c")
    ops = collections.Counter(
        m.group(1) for x in sass.splitlines()
        if (m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", x)))
    return {"instructions": sum(ops.values()), "resources": pd.resources(k),
            "shared_bytes": k.metadata.shared,
            "mix": {o: ops[o] for o in ("STS", "LDS", "LDSM", "BAR", "HGMMA", "LOP3", "SHF",
                                        "IMAD")}}


def main():
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawTextHelpFormatter).parse_args()
    for name, fn in (("rows (today)", _rows), ("pairs (proposed)", _pairs)):
        print(name, study(fn))


if __name__ == "__main__":
    main()
