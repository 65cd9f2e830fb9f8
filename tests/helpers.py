"""Small helpers shared by the test modules (plain module: tests/ is on sys.path under pytest)."""
from pathlib import Path

import torch

# the page size of the tests' CPU engines (compat says why)
from vllm_nvfp4kv.compat import CPU_BLOCK_SIZE  # noqa: F401


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def garbage(shape, gen) -> torch.Tensor:
    """Random bytes, a quarter of them 0x7F / 0xFF (E4M3 NaN patterns, as scales)."""
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    pick = torch.rand(shape, generator=gen)
    x[pick < 0.125] = 0x7F
    x[(pick >= 0.125) & (pick < 0.25)] = 0xFF
    return x




def nvfp4_spec(block_size: int, num_kv_heads: int, head_size: int, head_size_v=None):
    """vLLM's KV-cache spec of an nvfp4 layer served by our backend, as the installed vLLM
    builds it (from 0.32 the backend publishes the page's packing: customize_spec)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    from vllm_nvfp4kv import compat
    from vllm_nvfp4kv.backend import NvFp4AttentionBackend
    spec = FullAttentionSpec(block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             head_size_v=head_size_v or head_size, dtype=torch.uint8,
                             kv_quant_mode=get_kv_quant_mode("nvfp4"))
    return NvFp4AttentionBackend.customize_spec(spec) if compat.has_layout_api() else spec


def vllm_cache_view(raw: torch.Tensor, spec, num_blocks: int) -> torch.Tensor:
    """One layer's KV cache as the installed vLLM views its raw int8 buffer for our backend:
    0.26 reshapes it with the backend's shape and stride order; from 0.32 it lays the spec's
    [B, H, N, C] bytes out in the layout resolved from the backends' declarations."""
    from vllm_nvfp4kv import compat
    from vllm_nvfp4kv.backend import NvFp4AttentionBackend as B
    if not compat.has_layout_api():
        from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache
        shape = B.get_kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads,
                                     spec.head_size)
        return _reshape_attention_kv_cache(raw, spec, shape, B.get_kv_cache_stride_order(),
                                           num_blocks, None)
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=num_blocks * page, layers=["layer"],
                           layer_stride=num_blocks * page, block_stride=page)
    return create_kv_cache_views(raw, spec, num_blocks, B.supported_kv_cache_layouts()[0],
                                 tensor)[0]


TINY_LLAMA = Path(__file__).resolve().parents[1] / "evals" / "models" / "tiny-llama"


def write_sharp_tiny_llama(out: Path) -> Path:
    """tiny-llama's architecture with seeded random weights large enough that attention and
    the output distribution are not flat, written as a real checkpoint. (With
    load_format="dummy" the weights are ~1e-3: every next-token distribution is uniform to
    1e-6, so an engine test on dummy weights cannot see a corrupted cache, and greedy picks
    sit at near-ties; and dummy weights are drawn per tensor-parallel shard.)"""
    import json

    from safetensors.torch import save_file
    cfg = json.loads((TINY_LLAMA / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    hd, hq, hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, inter, vocab = cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]

    def w(*shape, std=0.125):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    ones = torch.ones(hd, dtype=torch.bfloat16)
    t = {"model.embed_tokens.weight": w(vocab, hd, std=1.0), "model.norm.weight": ones,
         "lm_head.weight": w(vocab, hd)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(hq * d, hd),
                  p + "self_attn.k_proj.weight": w(hkv * d, hd),
                  p + "self_attn.v_proj.weight": w(hkv * d, hd),
                  p + "self_attn.o_proj.weight": w(hd, hq * d),
                  p + "mlp.gate_proj.weight": w(inter, hd), p + "mlp.up_proj.weight": w(inter, hd),
                  p + "mlp.down_proj.weight": w(hd, inter),
                  p + "input_layernorm.weight": ones, p + "post_attention_layernorm.weight": ones})
    save_file({k: v.clone() for k, v in t.items()}, str(out / "model.safetensors"))
    return out
