"""The NVFP4 KV-cache page format, written down once.

A vLLM KV-cache page holds one (layer, block) of ``block_size`` tokens. Its logical tensor is
``[num_blocks, 2 * num_kv_heads, block_size, head_dim // 2 + head_dim // 16]`` uint8, exactly
vLLM 0.26's ``page_size_bytes`` for ``KVQuantMode.NVFP4``. The F-byte rows only size the page;
inside a page the bytes are laid out by side (K then V), each side head-major::

    page = [ K data | K scales | V data | V scales ]
    K data   [heads][block_size][D/8]  little-endian 32-bit words, word j = elements 8j .. 8j+7
    K scales [heads][block_size][D/16] one E4M3 byte per 16 consecutive elements
    V data   [heads][D/4][block_size/2] words: word (q, j) = elements 4q .. 4q+3 of the two
                                        tokens at V slots 2j, 2j+1 (a token pair)
    V scales [heads][D/16][block_size] byte (g, slot): group g of the token at that V slot

Scales are linear (no swizzle). V is stored token-pair-major because the decode kernel's
second product, O^T = V^T P^T, contracts over tokens: the Hopper wgmma register operand wants
one 32-bit register to hold one head-dim element of two consecutive tokens, which a V word
decodes into directly (no shared-memory transpose). Token t of a page sits at V slot
``v_slot(t)``: within each 16 tokens, t = 8a + 2b + p goes to slot 4b + 2a + p, so the lane
that decodes slots 4c .. 4c+3 (two words, and one word of their scales) holds tokens 2c, 2c+1,
2c+8, 2c+9, the operand's columns for that lane.

Inside a K word, element e = 2k + p (pair k = 0..3, p = 0 low / 1 high half) keeps its 3-bit
magnitude code at bits WORD_MAG_BITS[e] .. +2 (mod 32: element 5 uses bits 31, 0, 1) and its
sign at bit WORD_SIGN_BITS[e]. Inside a V word, element e = 2k + p is head-dim element 4q + k
of the token with slot parity p, at VWORD_MAG_BITS[e] / VWORD_SIGN_BITS[e]; the token with
p = 0 owns bytes 1-2 of the word, the one with p = 1 bytes 3 and 0, so the writer stores whole
bytes of one token. Why not two nibbles per byte: rotating a word right by its layout's
PAIR_ROTATION[k] brings pair k's magnitudes to bits 9..11 and 25..27 of an fp16x2 register,
where with the sign at bit 15 / 31 (rotation SIGN_ROTATION[k]) they read as
``value * 2**-14`` (codec.py); where both rotations are equal one AND finishes the pair.
Decoding a word takes 11 GPU instructions in either layout instead of 17 for nibbles
(codec.e2m1_word_fp16).

vLLM 0.26's SM100 writer swizzles the V scales for trtllm-gen and keeps V in rows; this format
does not, and only this package's kernels read it.

Encoding of 16 values x[0:16] of one (side, head, token, group) with the layer's FP32 global
scale ``g`` (vLLM's ``k_scale`` / ``v_scale``; 1.0 when the checkpoint has none)::

    amax  = max |x|                       (NaN counts as 0)
    s     = e4m3(amax / 6 / g)            round-to-nearest-even, saturating at 448
    scale = float(s) * g                  (fp32)
    r     = 1 / scale if scale > 0 else 0 (fp32)
    q     = e2m1(x * r)                   round-to-nearest-even on {0,.5,1,1.5,2,3,4,6}, saturating
    value = e2m1_value(q) * float(s) * g  (decoding)

The writer chooses each block's scale byte by one of three rules (BLOCK_SCALE_RULES; the
option block_scales); the decoding and the stored format are the same for all three:

  * ``amax6``: s as above;
  * ``4over6``: also ``s4 = e4m3(amax / 4 / g)`` (a finer grid near amax), kept where its
    squared error (sum over the block of (value - x)^2, NaN/Inf as 0) is strictly smaller;
  * ``search`` (the default): s, s4, and the code one below each (amax just beyond 6 or
    4, clipped there), tried in the order s, s4, s - 1, s4 - 1 (s - 1 not where s is 0 or
    already saturates at 448; s4 - 1 only where it is above s); the first with the smallest
    squared error is kept. E4M3 codes of non-negative values are ordered like the values.
    On Gaussian blocks this takes 4over6's relative squared error from 0.0076 to 0.0068
    (trying every code between s - 1 and s4, up to 8 scales, reaches 0.0067).

Special values (the cache never holds a non-finite value, so no NaN can leak from it):
  * all-zero blocks, and blocks whose scale underflows E4M3: scale byte 0, all codes 0, decode
    to exact zeros. Guaranteed below amax = 4 * 2**-10 * g with 4over6 and search, below
    6 * 2**-10 * g with amax6; in between, they may keep the smallest scale (2**-9) instead;
  * |x| beyond the block's range (including +-Inf, and anything beyond 6 * 448 * g): saturate
    to +-6 * scale;
  * NaN: stored as 0 (code 0) and ignored by amax. A NaN in K/V therefore does not poison later
    queries through the cache; attention over the step's own unquantized K/V still sees it.
  * negative zero and values that round to zero are stored as +0 (the sign bit is set only on
    nonzero codes), so equal inputs give equal bytes.
"""
from __future__ import annotations

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MAX_CODE = 0x7E  # its byte (0x7F is NaN)
GROUP_SIZE = 16  # values per E4M3 block scale
BLOCK_SCALE_RULES = ("amax6", "4over6", "search")  # how the writer picks a block's scale
# the rule where none is given: the writers' and references' default, and the plugin's
# (evals/RESULTS.md: its KL)
DEFAULT_BLOCK_SCALES = "search"
# The bits of a data word (see above): rotating it right by *_PAIR_ROTATION[k] puts pair k's
# magnitudes at bits 9..11 / 25..27; by *_SIGN_ROTATION[k], its signs at bits 15 / 31.
WORD_PAIR_ROTATION = (0, 3, 6, 9)      # K words
WORD_SIGN_ROTATION = (23, 24, 6, 9)
VWORD_PAIR_ROTATION = (0, 7, 3, 10)    # V words: p = 0's 16 bits are exactly bits 8..23
VWORD_SIGN_ROTATION = (0, 7, 8, 25)


def element_bits(p, pair_rotation, sign_rotation):
    """(lowest magnitude bit, sign bit) of element 2k + p of a word, given pair k's rotations
    (ints, integer tensors, or Triton tensors: codec jits this)."""
    return (9 + 16 * p + pair_rotation) % 32, (15 + 16 * p + sign_rotation) % 32


def word_bits(pair_rotation, sign_rotation):
    """(magnitude bit, sign bit) of elements e = 2k + p, 0..7, of a word layout."""
    bits = [element_bits(p, pair_rotation[k], sign_rotation[k]) for k in range(4) for p in (0, 1)]
    return tuple(m for m, _ in bits), tuple(s for _, s in bits)


WORD_MAG_BITS, WORD_SIGN_BITS = word_bits(WORD_PAIR_ROTATION, WORD_SIGN_ROTATION)
VWORD_MAG_BITS, VWORD_SIGN_BITS = word_bits(VWORD_PAIR_ROTATION, VWORD_SIGN_ROTATION)


def v_slot(t):
    """V slot of token t of a page (int, integer tensor, or Triton tensor: codec jits this):
    within each 16 tokens, t = 8a + 2b + p -> 4b + 2a + p."""
    return (t & ~15) | (((t >> 1) & 3) << 2) | (((t >> 3) & 1) << 1) | (t & 1)


def v_token_bytes(p):
    """The two bytes (low first) that a token at V slot parity p owns in each of its V words
    (int, integer tensor, or Triton tensor: codec jits this)."""
    return 1 + 2 * p, (2 + 2 * p) % 4


# E2M1 magnitudes by 3-bit code; bit 3 of a 4-bit code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision thresholds on |x * r| between consecutive codes. At a tie the even code wins:
# 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0.
# (threshold, True when the tie rounds up)
E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                   (2.5, False), (3.5, True), (5.0, False))

SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)


def check_head_dim(head_dim: int) -> None:
    if head_dim % GROUP_SIZE != 0 or head_dim <= 0:
        raise ValueError(f"NVFP4 KV needs head_dim to be a positive multiple of {GROUP_SIZE}, "
                         f"got {head_dim}")


def row_bytes(head_dim: int) -> int:
    """Bytes of one (side, head, token): packed data plus block scales (72 at head_dim 128)."""
    check_head_dim(head_dim)
    return head_dim // 2 + head_dim // GROUP_SIZE


def page_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one (layer, block) page: block_size * heads * 2 * (D/2 + D/16)."""
    return block_size * num_kv_heads * 2 * row_bytes(head_dim)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int]:
    """The logical uint8 shape vLLM allocates for NVFP4: [num_blocks, 2*H, N, D/2 + D/16]."""
    return (num_blocks, 2 * num_kv_heads, block_size, row_bytes(head_dim))


class PageLayout:
    """Byte offsets inside one page. All offsets are relative to the page start."""

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int):
        check_head_dim(head_dim)
        if block_size % 16:
            raise ValueError(f"NVFP4 KV needs block_size a multiple of 16, got {block_size}")
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        self.data_bytes = head_dim // 2            # per (head, token)
        self.scale_bytes = head_dim // GROUP_SIZE  # per (head, token)
        self.side_data = num_kv_heads * block_size * self.data_bytes
        self.side_bytes = num_kv_heads * block_size * (self.data_bytes + self.scale_bytes)
        self.page_bytes = 2 * self.side_bytes

    def data_offsets(self, side: int, head: int, token: int) -> list[int]:
        """The D/2 data bytes of (side, head, token). K: one contiguous row. V: for each
        quad q, the two bytes the token owns in word (q, v_slot(token) // 2), low first."""
        base = side * self.side_bytes + head * self.block_size * self.data_bytes
        if side == 0:
            return list(range(base + token * self.data_bytes,
                              base + (token + 1) * self.data_bytes))
        slot = v_slot(token)
        words = [base + 4 * (q * (self.block_size // 2) + slot // 2)
                 for q in range(self.head_dim // 4)]
        p = slot % 2
        return [w + b for w in words for b in v_token_bytes(p)]

    def scale_offsets(self, side: int, head: int, token: int) -> list[int]:
        """The D/16 scale bytes of (side, head, token), group order."""
        base = side * self.side_bytes + self.side_data + head * self.block_size * self.scale_bytes
        if side == 0:
            return list(range(base + token * self.scale_bytes,
                              base + (token + 1) * self.scale_bytes))
        return [base + g * self.block_size + v_slot(token) for g in range(self.scale_bytes)]
