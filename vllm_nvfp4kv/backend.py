"""vLLM attention backend for the NVFP4 KV cache (``--kv-cache-dtype nvfp4``) on GPUs where
vLLM has none (SM80-SM90, and SM120), and on vLLM's CPU platform (torch references).

Wiring only: the options are ``config.NvFp4KVConfig`` (one per engine), each layer's
first-batch adaptation is ``adaptation.LayerAdaptation``, the prefill paths ``prefill.py``,
and every kernel launch goes through ``ops`` (Triton on CUDA, the references elsewhere). The
cache page layout is the one vLLM 0.26 sizes for NVFP4 (``[num_blocks, 2*H, N, D/2 + D/16]``
uint8; K/V data then scales per side, head-major, linear scales): see ``kernels/format.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                       AttentionMetadata, AttentionMetadataBuilder,
                                       AttentionType, CommonAttentionMetadata)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from vllm_nvfp4kv import compat, config, ops, warmup
from vllm_nvfp4kv.adaptation import LayerAdaptation
from vllm_nvfp4kv.capacity import log_capacity
from vllm_nvfp4kv.kernels import format as fmt
from vllm_nvfp4kv.kernels.decode import (DECODE_VARIANTS, DEFAULT_SPLIT_RULE, choose_num_splits,
                                         launch_splits)
from vllm_nvfp4kv.prefill import PrefillInputs, PrefillPlan, plan_prefill, run_prefill
from vllm_nvfp4kv.scales import global_scales
from vllm_nvfp4kv.workspace import workspace_capacity, workspace_dtype, workspace_views


class NvFp4AttentionBackend(AttentionBackend):
    """Registered as AttentionBackendEnum.CUSTOM (vLLM requires the member name)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(compat.NVFP4_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(fmt.SUPPORTED_BLOCK_SIZES)

    @staticmethod
    def get_impl_cls() -> type["NvFp4AttentionImpl"]:
        return NvFp4AttentionImpl

    @staticmethod
    def get_builder_cls() -> type["NvFp4MetadataBuilder"]:
        return NvFp4MetadataBuilder

    # --- the page's shape: vLLM 0.26 asks for it (get_kv_cache_shape / stride order) ---
    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "nvfp4") -> tuple[int, ...]:
        if cache_dtype_str not in compat.NVFP4_CACHE_DTYPES:
            raise ValueError(f"the NVFP4 backend serves kv_cache_dtype 'nvfp4' only, got "
                             f"{cache_dtype_str!r}; layers skipped from NVFP4 need another "
                             "backend (leave --attention-backend unset)")
        return fmt.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # Identity (blocks first, head-major pages) whatever vLLM's global NHD/HND setting:
        # the format owns the bytes inside a page.
        return (1, 0, 2, 3, 4) if include_num_layers_dimension else (0, 1, 2, 3)

    @classmethod
    def get_required_kv_cache_layout(cls):
        return None

    # --- ... and vLLM >= 0.32 has the backend publish it (compat: the layout refactor) ---
    @classmethod
    def customize_spec(cls, spec):
        """[B, 2 * num_kv_heads, N, D/2 + D/16] bytes, as ``kv_cache_shape``."""
        if spec.state_content_bytes is not None or not spec.kv_quant_mode.is_nvfp4:
            return spec
        _check_one_head_size(spec)
        return replace(spec, num_head_slots=2 * spec.num_kv_heads,
                       state_content_bytes=fmt.row_bytes(spec.head_size))

    @classmethod
    def supported_kv_cache_layouts(cls):
        return compat.block_contiguous_layouts()

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size % fmt.GROUP_SIZE == 0 and 32 <= head_size <= 512

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major >= 8

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                               has_sink, use_sparse, use_mm_prefix, use_per_head_quant_scales,
                               device_capability, attn_type, **kwargs) -> list[str]:
        """vLLM's checks, with each refusal saying why and what to do instead."""
        reasons = super().validate_configuration(
            head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
            use_mm_prefix, use_per_head_quant_scales, device_capability, attn_type, **kwargs)
        way_out = "; use --kv-cache-dtype fp8 (or auto) for this model/GPU"
        explain = {
            "head_size not supported":
                f"NVFP4 KV needs head_size to be a multiple of 16 in [32, 512], got {head_size}",
            "compute capability not supported":
                f"NVFP4 KV (vllm-nvfp4kv) needs compute capability >= 8.0, got "
                f"{device_capability}",
            "block_size not supported":
                f"NVFP4 KV needs a block size that is a multiple of 16 (its kernels use "
                f"{list(fmt.SUPPORTED_BLOCK_SIZES)}-token blocks), got {block_size} "
                f"(set --block-size 16)",
            "dtype not supported": f"NVFP4 KV needs bf16/fp16 activations, got {dtype}",
        }
        reasons = [explain.get(r, "NVFP4 KV: " + r) + way_out for r in reasons]
        if has_sink and device_capability is not None \
                and device_capability.major not in SINK_CAPABILITY_MAJORS:
            # prefill attends through vLLM's FlashAttention; only FA3/FA4 take sinks (s_aux)
            reasons.append(
                f"NVFP4 KV with attention sinks (gpt-oss) needs FlashAttention 3 or 4 for "
                f"prefill (compute capability 9.x or 10.x); this GPU ({device_capability}) "
                f"has FlashAttention 2, which has no sinks" + way_out)
        return reasons


# compute capabilities whose FlashAttention (3 on Hopper, 4 on Blackwell) takes sink logits
SINK_CAPABILITY_MAJORS = (9, 10)


def _check_one_head_size(spec, layer_names=()) -> None:
    """The page format has one head size for K and V."""
    head_size_v = getattr(spec, "head_size_v", None) or spec.head_size
    if head_size_v != spec.head_size:
        where = f" (layers {', '.join(layer_names[:3])})" if layer_names else ""
        raise ValueError(
            f"NVFP4 KV cache (vllm-nvfp4kv) needs equal K and V head sizes, got head_size "
            f"{spec.head_size} and head_size_v {head_size_v}{where}; use --kv-cache-dtype "
            "fp8 or auto for this model")


@dataclass
class NvFp4Metadata(AttentionMetadata):
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    seq_lens: torch.Tensor          # [num_reqs] int32, tokens including this step's
    block_table: torch.Tensor       # [num_reqs, max_blocks] int32
    decode_num_splits: int
    prefill: PrefillPlan | None


class NvFp4MetadataBuilder(AttentionMetadataBuilder[NvFp4Metadata]):
    """Per-step planning (split-KV count, prefill rounds and index tensors), done once per
    step and shared by every layer."""

    # Full CUDA graphs for uniform decode batches; mixed batches run attention eagerly.
    _cudagraph_support: ClassVar[AttentionCGSupport] = \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config: VllmConfig, device):
        _check_one_head_size(kv_cache_spec, layer_names)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)
        cfg = config.for_engine(vllm_config)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size
        self.window = getattr(kv_cache_spec, "sliding_window", None)
        # the most keys one decode reads (what the split count is sized for): a sliding
        # window bounds them
        max_len = vllm_config.model_config.max_model_len
        self.max_keys = min(max_len, self.window) if self.window else max_len
        self.capacity = workspace_capacity(vllm_config, self.window, cfg.workspace_prefix_tokens)
        self.prefill_from_cache = cfg.prefill_from_cache
        variant = DECODE_VARIANTS[cfg.decode_variant]
        self.split_rule = variant.get("split_rule", DEFAULT_SPLIT_RULE)
        self.launches = variant.get("launches")  # the decode launcher's tile per head size
        workspace_views(self.capacity, self.num_kv_heads, self.head_size,
                        workspace_dtype(vllm_config.model_config.dtype, cfg.workspace_dtype),
                        device)  # reserve before capture
        log_capacity(vllm_config, self.head_size, self.capacity, self.num_kv_heads)
        warmup.register(self)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> NvFp4Metadata:
        cam = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold)
        plan = None
        if num_prefills:
            seq_lens_cpu = cam.seq_lens_cpu_upper_bound  # exact for prefill rows
            if seq_lens_cpu is None:
                seq_lens_cpu = cam.seq_lens.cpu()
            plan = plan_prefill(cam.query_start_loc_cpu, seq_lens_cpu, num_decodes,
                                num_decodes + num_prefills, self.capacity, self.window,
                                self.device, self.prefill_from_cache)
        # split count from the batch shape only: valid for every replay of a captured graph
        splits = choose_num_splits(max(num_decodes, 1), self.num_kv_heads, self.max_keys,
                                   self.device, self.head_size, self.split_rule)
        return NvFp4Metadata(
            num_actual_tokens=cam.num_actual_tokens, num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens, num_prefills=num_prefills,
            seq_lens=cam.seq_lens, block_table=cam.block_table_tensor,
            decode_num_splits=splits, prefill=plan)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata):
        md = self.build(0, common_attn_metadata)
        md.seq_lens.fill_(1)  # real lengths arrive at replay
        return md

    def warmup_batches(self) -> list[NvFp4Metadata]:
        """Tiny steps that between them launch every kernel build this builder's steps can
        launch (warmup.py): a one-token decode per distinct decode build among the split
        counts of 1 to max_num_seqs decodes (what build chooses), and a decode beside a
        prefill of 2 tokens after a cached one (the prefix gather and, unless prefill_from_
        cache, the chunk's put_rows). Every token in page 0 of each sequence (block table
        zeros)."""
        dev = self.device
        counts = {choose_num_splits(b, self.num_kv_heads, self.max_keys, dev, self.head_size,
                                    self.split_rule)
                  for b in range(1, self.vllm_config.scheduler_config.max_num_seqs + 1)}
        splits = launch_splits(counts, dev, self.head_size, self.split_rule, self.launches)

        def step(seq_lens: list[int], ends: list[int], num_decodes: int, num_splits: int,
                 plan: PrefillPlan | None = None) -> NvFp4Metadata:
            return NvFp4Metadata(
                num_actual_tokens=ends[-1], num_decodes=num_decodes,
                num_decode_tokens=num_decodes, num_prefills=len(seq_lens) - num_decodes,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                block_table=torch.zeros(len(seq_lens), 1, dtype=torch.int32, device=dev),
                decode_num_splits=num_splits, prefill=plan)
        steps = [step([1], [0, 1], 1, s) for s in splits]
        seq_lens, ends = [1, 3], [0, 1, 3]  # a decode; 2 tokens after 1 cached
        plan = plan_prefill(torch.tensor(ends), torch.tensor(seq_lens), 1, 2, self.capacity,
                            self.window, dev, self.prefill_from_cache)
        return steps + [step(seq_lens, ends, 1, splits[0], plan)]


class NvFp4AttentionImpl(AttentionImpl[NvFp4Metadata]):
    supports_quant_query_input: bool = False  # Q stays BF16/FP16

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None, **kwargs):
        refuse = []
        if alibi_slopes is not None:
            refuse.append("ALiBi")
        if attn_type != AttentionType.DECODER:
            refuse.append(f"attention type {attn_type} (encoder/cross attention)")
        if kv_sharing_target_layer_name is not None:
            refuse.append("cross-layer KV sharing")
        if kv_cache_dtype not in compat.NVFP4_CACHE_DTYPES:
            refuse.append(f"kv_cache_dtype {kv_cache_dtype!r} on a layer routed to this backend")
        if refuse:
            raise NotImplementedError(
                "NVFP4 KV cache (vllm-nvfp4kv) does not support " + ", ".join(refuse)
                + ". Use --kv-cache-dtype fp8 or auto for this model.")
        fmt.check_head_dim(head_size)
        # the config in force while the model is built (None outside an engine: tests)
        vllm_config = get_current_vllm_config_or_none()
        self.config = config.for_engine(vllm_config)
        # nvfp4_4over6 (vLLM >= 0.32) names the writer's rule; the page format is the same
        self.block_scales = compat.NVFP4_CACHE_DTYPES[kv_cache_dtype] or self.config.block_scales
        self.decode_variant = DECODE_VARIANTS[self.config.decode_variant]
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.attn = ops.AttentionParams(self.scale, sliding_window,
                                        float(logits_soft_cap or 0.0), sinks)
        model_config = vllm_config.model_config if vllm_config else None
        self.adaptation = LayerAdaptation(
            self.config, self.block_scales, num_heads, num_kv_heads, head_size,
            sinks_or_softcap=sinks is not None or bool(logits_soft_cap),
            model=str(getattr(model_config, "model", "?")))
        self.space = self.adaptation.space  # what the cache stores (changed in place only)
        self.ws_capacity = workspace_capacity(vllm_config, sliding_window,
                                              self.config.workspace_prefix_tokens) \
            if vllm_config else 0

    def process_weights_after_loading(self, act_dtype: torch.dtype):
        if self.attn.sinks is not None:
            self.attn.sinks = self.attn.sinks.float()

    def warm_up(self, layer, kv_cache: torch.Tensor, steps: list[NvFp4Metadata],
                write_tokens: list[int], rewrite_tokens: list[int],
                dtype: torch.dtype) -> None:
        """Launch every kernel build this layer can launch, on dummy zeros of the model's
        dtype (warmup.py): a write of each of write_tokens padded tokens (slots -1: nothing
        written; the layer's first eager write, adaptation.py), where K's rotation is chosen
        per layer the first real batch's rewrite of each of rewrite_tokens, and the forward of
        each of steps (NvFp4MetadataBuilder.warmup_batches) into a scratch output. The cache
        is only read."""
        def zeros(tokens: int, heads: int) -> torch.Tensor:
            return torch.zeros(tokens, heads, self.head_size, dtype=dtype, device=kv_cache.device)
        kv = zeros(max(write_tokens + rewrite_tokens), self.num_kv_heads)
        slots = torch.full((kv.shape[0],), -1, dtype=torch.int64,  # vLLM's slot mapping dtype
                           device=kv_cache.device)
        for t in write_tokens:
            self.do_kv_cache_update(layer, kv[:t], kv[:t], kv_cache, slots[:t])
        if self.adaptation.chooses_rotation:  # known from the first write on
            for t in rewrite_tokens:
                self.adaptation.rewrite(layer, kv_cache, kv[:t], kv[:t], slots[:t])
        for md in steps:
            q = zeros(md.num_actual_tokens, self.num_heads).flatten(1)
            kv = zeros(md.num_actual_tokens, self.num_kv_heads).flatten(1)
            self.forward(layer, q, kv, kv, kv_cache, md, torch.empty_like(q))

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize this step's K/V [>= T, Hkv, D] into the cache at slot_mapping [T]."""
        t = slot_mapping.shape[0]
        key, value, fused_k = self.adaptation.prepare_write(layer, key[:t], value[:t],
                                                            slot_mapping)
        k_scale, v_scale = global_scales(layer)
        ops.write_cache(kv_cache, key, value, slot_mapping, k_scale, v_scale, self.block_scales,
                        fused_k)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: NvFp4Metadata | None,
                output: torch.Tensor, output_scale=None, output_block_scale=None,
                output_lse=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("NVFP4 KV backend: fused output quantization")
        ws_dtype = workspace_dtype(query.dtype, self.config.workspace_dtype)
        if attn_metadata is None:  # profiling run: make the workspace count in the budget
            self.adaptation.on_profile_run()
            if self.ws_capacity:
                workspace_views(self.ws_capacity, self.num_kv_heads, self.head_size, ws_dtype,
                                query.device)
            return output.fill_(0)
        md = attn_metadata
        n = md.num_actual_tokens
        q = query[:n].view(-1, self.num_heads, self.head_size)
        self.adaptation.on_forward(layer, q, kv_cache)
        out = output[:n].view(-1, self.num_heads, self.head_size)
        k_scale, v_scale = global_scales(layer)
        nd, b = md.num_decode_tokens, md.num_decodes
        if b:  # q in the cache's space: q.k as the model's
            ops.decode(self.space.query(q[:nd]), kv_cache, md.block_table[:b], md.seq_lens[:b],
                       out[:nd], k_scale, v_scale, self.attn, md.decode_num_splits,
                       self.decode_variant)
            if self.space.rotate_v:
                out[:nd] = self.space.output(out[:nd])
        if md.num_prefills:
            if self.attn.fa_version is None:
                self.attn.fa_version = ops.flash_attn_version(
                    q.device, self.head_size, self.attn.sinks is not None, ws_dtype)
            ws_k, ws_v = workspace_views(md.prefill.ws_rows, self.num_kv_heads, self.head_size,
                                         ws_dtype, query.device)
            run_prefill(md.prefill, PrefillInputs(
                q, key[:n].view(-1, self.num_kv_heads, self.head_size),
                value[:n].view(-1, self.num_kv_heads, self.head_size), out, kv_cache,
                md.block_table, ws_k, ws_v, k_scale, v_scale, self.attn, self.space))
        return output
