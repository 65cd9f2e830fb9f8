"""vLLM attention backend for the NVFP4 KV cache (``--kv-cache-dtype nvfp4``) on GPUs where
vLLM has none (SM80-SM90, and SM120), and on vLLM's CPU platform (torch references).

Wiring only; the options are ``config.NvFp4KVConfig`` (one per engine), the math lives in
``vllm_nvfp4kv.kernels`` (page format, writer, gather, decode) and ``prefill.py`` (initial and
chunked prefill). The cache page layout is the one vLLM 0.26
sizes for NVFP4 (``[num_blocks, 2*H, N, D/2 + D/16]`` uint8; K/V data then scales per side,
head-major, linear scales): see ``kernels/format.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                       AttentionMetadata, AttentionMetadataBuilder,
                                       AttentionType, CommonAttentionMetadata)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from vllm_nvfp4kv import compat, config
from vllm_nvfp4kv.kernels import decode_attention, format as fmt, reference, write_cache
from vllm_nvfp4kv.kernels.decode import DECODE_VARIANTS, DEFAULT_SPLIT_RULE, choose_num_splits
from vllm_nvfp4kv.prefill import PrefillPlan, plan_prefill, run_prefill
from vllm_nvfp4kv.cache_space import CacheSpace, rotation_helps
from vllm_nvfp4kv.calibration import k_mid_range, k_transform, log_once, prepare_write
from vllm_nvfp4kv.scales import K_OUTLIER_RATIO, global_scales, k_outlier_ratio
from vllm_nvfp4kv.workspace import workspace_capacity, workspace_dtype, workspace_views

logger = init_logger("vllm.nvfp4kv")  # under "vllm" so vLLM's log config applies


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
        return [explain.get(r, "NVFP4 KV: " + r) + way_out for r in reasons]


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
        self.max_model_len = vllm_config.model_config.max_model_len
        self.capacity = workspace_capacity(vllm_config, self.window, cfg.workspace_prefix_tokens)
        self.prefill_from_cache = cfg.prefill_from_cache
        self.split_rule = DECODE_VARIANTS[cfg.decode_variant].get("split_rule",
                                                                  DEFAULT_SPLIT_RULE)
        workspace_views(self.capacity, self.num_kv_heads, self.head_size,
                        workspace_dtype(vllm_config.model_config.dtype, cfg.workspace_dtype),
                        device)  # reserve before capture
        _log_capacity(vllm_config, self.head_size, self.capacity, self.num_kv_heads)

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
        splits = choose_num_splits(max(num_decodes, 1), self.num_kv_heads, self.max_model_len,
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


_capacity_logged = False
_K_OUTLIER_MODELS: set[str] = set()  # models (vLLM's model name) where a layer's first real
#                                      batch showed K outlier channels (NVFP4KV_CENTER_K=auto)


def _log_capacity(vllm_config: VllmConfig, head_size: int, ws_rows: int, kv_heads: int):
    """Once per process: KV capacity in tokens and what FP8 / BF16 would hold in the same
    memory (the workspace was counted before the KV cache was sized)."""
    global _capacity_logged
    blocks = vllm_config.cache_config.num_gpu_blocks
    if _capacity_logged or not blocks:
        return
    _capacity_logged = True
    tokens = blocks * vllm_config.cache_config.block_size
    per_token = 2 * fmt.row_bytes(head_size)  # K + V bytes per token, head and layer
    # hybrid models (sliding and full layers, e.g. Gemma 3): vLLM's allocator shares one block
    # pool among layer groups, so blocks x block_size is not what one request can hold
    types = getattr(vllm_config.model_config.hf_text_config, "layer_types", None) or ()
    hybrid = len(set(types)) > 1
    unit = "token slots" if hybrid else "tokens"
    logger.info(
        "NVFP4 KV cache (vllm-nvfp4kv): %s %s, %.2fx the %s %s an FP8 cache holds in "
        "the same memory (%.2fx BF16); %d bytes per token per KV head; dequantization "
        "workspace %d rows x %d KV heads%s", f"{tokens:,}", unit, 2 * head_size / per_token,
        f"{tokens * per_token // (2 * head_size):,}", unit, 4 * head_size / per_token,
        per_token, ws_rows, kv_heads,
        "; hybrid model: the slots of one block pool shared by its layer groups, vLLM's "
        "'GPU KV cache size' line gives the tokens a request can use" if hybrid else "")


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
        cfg = get_current_vllm_config_or_none()
        self.config = opts = config.for_engine(cfg)
        pow2 = head_size & (head_size - 1) == 0
        if (opts.rotate_k == "1" or opts.rotate_v) and not pow2:
            raise ValueError(f"NVFP4 KV options rotate_k / rotate_v = 1 (NVFP4KV_ROTATE_K/V) "
                             f"need a power-of-two head_size, got {head_size}; unset them for "
                             "this model")
        # nvfp4_4over6 (vLLM >= 0.32) names the writer's rule; the page format is the same
        self.block_scales = compat.NVFP4_CACHE_DTYPES[kv_cache_dtype] or opts.block_scales
        self._online_center = False  # k_sub reserved (zeros), set at the first real batch
        # rotate_k=auto: K's rotation chosen at the first real batch (forward sees its queries)
        self._choose_rotation = opts.rotate_k == "auto" and pow2
        self._pending_rotation = None  # that batch's (key, value, slots), update -> forward
        # what the cache stores; K centering/smoothing join at the layer's first eager write
        self.space = CacheSpace(rotate_k=opts.rotate_k == "1" or (
            opts.rotate_k == "auto" and pow2), rotate_v=opts.rotate_v)
        self._space_ready = False
        self.decode_variant = DECODE_VARIANTS[opts.decode_variant]
        self._fused_k = False  # K's transform in the writer (decided at the first eager write)
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.window = sliding_window
        self.softcap = float(logits_soft_cap or 0.0)
        self.sinks = sinks
        self.fa_version = None
        self._outliers_checked = False
        # the workspace size, from the config in force while the model is built
        self.ws_capacity = workspace_capacity(cfg, sliding_window,
                                              opts.workspace_prefix_tokens) if cfg else 0
        self._model = str(getattr(cfg.model_config, "model", "?")) if cfg and \
            cfg.model_config else "?"

    def process_weights_after_loading(self, act_dtype: torch.dtype):
        if self.sinks is not None:
            self.sinks = self.sinks.float()

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize this step's K/V [>= T, Hkv, D] into the cache at slot_mapping [T]."""
        k_scale, v_scale = global_scales(layer)
        t = slot_mapping.shape[0]
        key, value = key[:t], value[:t]
        eager = not (key.is_cuda and torch.cuda.is_current_stream_capturing())
        if not self._space_ready:
            if eager:
                self._init_space(layer, key)
            else:  # captured before any eager write: the space stays as the graphs saw it
                self._space_ready = True
        if eager and not self._outliers_checked:
            self._first_real_batch(layer, key, value, slot_mapping)
        value = self.space.value(value)
        if not self._fused_k:  # else K - mu and its rotation happen in the writer
            key = self.space.key(key)
        # calibration may fix k/v_scale first (with _fused_k it is off and reads no K); at the
        # layer's first eager write it resolves and checks them
        prepare_write(layer, key, value, slot_mapping, self.config)
        if self._fused_k:
            write_cache(kv_cache, key, value, slot_mapping, k_scale, v_scale,
                        self.block_scales, k_sub=self.space.k_sub,
                        rotate_k=self.space.k_rotation())
            return
        write = write_cache if kv_cache.is_cuda else reference.write_cache
        write(kv_cache, key, value, slot_mapping, k_scale, v_scale, self.block_scales)

    def _init_space(self, layer, key) -> None:
        """At the layer's first eager write (before any CUDA graph capture): K centering and
        smoothing from the scales file; smoothing turns the rotation of K off."""
        self._space_ready = True
        cfg = self.config
        mu, s = k_transform(layer, key.device, cfg)
        name = getattr(layer, "layer_name", "?")
        for what, t in (("centering", mu), ("smoothing", s)):
            if t is not None and t.shape != (self.num_kv_heads, self.head_size):
                raise ValueError(f"scales file {cfg.scales_file}: K {what} of layer {name} has "
                                 f"shape {tuple(t.shape)}, expected ({self.num_kv_heads}, "
                                 f"{self.head_size})")
        if mu is not None and (self.sinks is not None or self.softcap):
            raise ValueError(f"scales file {cfg.scales_file}: layer {name} has attention sinks "
                             "or a logit soft-cap, which K centering would change; calibrate "
                             "without --center-k")
        if s is not None:  # rotating smoothed keys undoes the smoothing (README)
            if cfg.rotate_k == "1":
                raise ValueError("NVFP4 KV option rotate_k=1 (NVFP4KV_ROTATE_K) and a scales "
                                 "file with K smoothing exclude each other: unset rotate_k")
            self.space.rotate_k = False
        # centering keeps the rotation as configured: rotating K - mu is as exact as rotating
        # K, and the two together measured best (Qwen2.5 KL 0.0034 vs 0.0055 without,
        # evals/RESULTS.md)
        if mu is None and cfg.center_k != "0" and self.sinks is None \
                and not self.softcap:
            # reserved now, before any CUDA graph captures the subtraction; zeros until the
            # first real batch decides (_first_real_batch)
            mu = torch.zeros(self.num_kv_heads, self.head_size, device=key.device)
            self._online_center = True
        if mu is not None:
            self.space.set_center(mu, key.dtype)
        if s is not None:
            self.space.set_smoothing(s, self.num_heads, key.dtype)
        # online calibration sets the global scales from the rotated K: the rotation stays
        reads_k = cfg.calibrate in ("online", "collect")
        self._choose_rotation &= self.space.rotate_k and not reads_k
        if self._choose_rotation:
            self.space.reserve_rotation_choice(self.head_size, key.device, key.dtype)
        self._fused_k = (cfg.fuse_transforms and key.is_cuda and self.space.k_mul is None
                         and (self.space.k_sub is not None or self.space.rotate_k)
                         and self.head_size & (self.head_size - 1) == 0  # whole-row loads
                         and not reads_k)

    def _first_real_batch(self, layer, key, value, slot_mapping) -> None:
        """Once per layer, at its first batch of real tokens (eager: warm-up and capture
        batches have every slot -1): online K centering where it is on and K (smoothed and
        centered by a file, where it is) has outlier channels that 4-bit blocks of 16 cannot
        hold; then a warning if they remain (the model will lose accuracy badly)."""
        ratio = k_outlier_ratio(self.space.unrotated_key(key), slot_mapping)
        if ratio is None:  # dummy / warm-up batch (all slots padded)
            return
        self._outliers_checked = True
        name = getattr(layer, "layer_name", "?")
        if ratio > K_OUTLIER_RATIO:
            _K_OUTLIER_MODELS.add(self._model)
        # auto: model-wide, since layers below the outlier ratio gain as well (Qwen2.5: KL
        # 0.0033 centering every layer vs 0.0070 only those above it; evals/RESULTS.md)
        if self._online_center and (self.config.center_k == "1"
                                    or self._model in _K_OUTLIER_MODELS):
            self.space.k_sub.copy_(k_mid_range(key, slot_mapping))  # in place: graphs hold it
            before, ratio = ratio, k_outlier_ratio(self.space.unrotated_key(key), slot_mapping)
            log_once("center", "NVFP4 KV cache: K centering from the first real batch "
                     "(center_k=%s), e.g. layer %s: K outlier ratio %.0f -> %.0f",
                     self.config.center_k, name, before, ratio)
        if self._choose_rotation:  # decided in forward, with this batch's queries
            self._pending_rotation = (key, value, slot_mapping)
        if ratio > K_OUTLIER_RATIO:
            logger.warning(
                "NVFP4 KV cache: layer %s has K outlier channels (max/median channel amax "
                "%.0f > %.0f, e.g. a k_proj bias as in Qwen2): each 16-value block holding one "
                "rounds its other values to 0 and accuracy collapses (evals/RESULTS.md, "
                "Qwen2.5 fidelity). Calibrate K centering (python -m vllm_nvfp4kv.calibration "
                "--center-k, then the scales_file option; online centering is off with "
                "center_k=0, sinks or a soft-cap) or use --kv-cache-dtype fp8.",
                name, ratio, K_OUTLIER_RATIO)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: NvFp4Metadata | None,
                output: torch.Tensor, output_scale=None, output_block_scale=None,
                output_lse=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("NVFP4 KV backend: fused output quantization")
        if attn_metadata is None:  # profiling run: make the workspace count in the budget
            self._pending_rotation = None  # no queries to decide with: the rotation stays
            if self.ws_capacity:
                workspace_views(self.ws_capacity, self.num_kv_heads, self.head_size,
                                workspace_dtype(query.dtype, self.config.workspace_dtype),
                                query.device)
            return output.fill_(0)
        md = attn_metadata
        n = md.num_actual_tokens
        q = query[:n].view(-1, self.num_heads, self.head_size)
        if self._pending_rotation is not None:
            self._decide_rotation(layer, q, kv_cache)
        out = output[:n].view(-1, self.num_heads, self.head_size)
        k_scale, v_scale = global_scales(layer)
        nd = md.num_decode_tokens
        if md.num_decodes:  # q in the cache's space: q.k as the model's
            self._decode(self.space.query(q[:nd]), kv_cache, md, out[:nd], k_scale, v_scale)
            if self.space.rotate_v:
                out[:nd] = self.space.output(out[:nd])
        if md.num_prefills:
            ws_dtype = workspace_dtype(query.dtype, self.config.workspace_dtype)
            if self.fa_version is None and q.is_cuda:
                from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
                self.fa_version = get_flash_attn_version(head_size=self.head_size,
                                                         has_sinks=self.sinks is not None)
                if ws_dtype == torch.float8_e4m3fn and self.fa_version != 3:
                    raise ValueError(
                        "NVFP4 KV option workspace_dtype=fp8 (NVFP4KV_WORKSPACE_DTYPE) needs "
                        "FlashAttention 3 (Hopper); this GPU "
                        f"has FA{self.fa_version}: unset it (BF16 workspace)")
            ws_k, ws_v = workspace_views(md.prefill.ws_rows, self.num_kv_heads, self.head_size,
                                         ws_dtype, query.device)
            key = key[:n].view(-1, self.num_kv_heads, self.head_size)
            value = value[:n].view(-1, self.num_kv_heads, self.head_size)
            run_prefill(md.prefill, q, key, value, out, kv_cache, md.block_table, ws_k, ws_v,
                        k_scale, v_scale, self.scale, self.window, self.softcap, self.sinks,
                        self.fa_version, self.space)
        return output

    def _decide_rotation(self, layer, q, kv_cache) -> None:
        """At the layer's first real batch (its update stashed key, value, slots): keep K's
        rotation where it lowers the batch's q.k error through the cache; else switch to the
        identity in place (the matrix CUDA graphs hold) and rewrite the batch's K/V, which
        are all this layer's cache holds so far, before attention reads them."""
        key, value, slots = self._pending_rotation
        self._pending_rotation = None
        k_scale, v_scale = global_scales(layer)
        real = slots >= 0
        on = rotation_helps(q, self.space.unrotated_key(key[real]), k_scale,
                            self.block_scales)
        name = getattr(layer, "layer_name", "?")
        logger.debug("NVFP4 KV cache: layer %s %s the rotation of K", name,
                     "keeps" if on else "drops")
        if on:
            return
        log_once("rotation", "NVFP4 KV cache: K rotation chosen per layer from the first real "
                 "batch (rotate_k=auto); e.g. layer %s: off (it raised the q.k error)",
                 name)
        self.space.choose_rotation(False)
        write = write_cache if kv_cache.is_cuda else reference.write_cache
        write(kv_cache, self.space.key(key), self.space.value(value), slots, k_scale, v_scale,
              self.block_scales)

    def _decode(self, q, kv_cache, md, out, k_scale, v_scale):
        b = md.num_decodes
        if q.is_cuda:
            decode_attention(q, kv_cache, md.block_table[:b], md.seq_lens[:b], out, self.scale,
                             k_scale, v_scale, sliding_window=self.window,
                             softcap=self.softcap, sinks=self.sinks,
                             num_splits=md.decode_num_splits, **self.decode_variant)
        else:
            res = reference.paged_attention(q, kv_cache, md.block_table[:b],
                                            torch.arange(b + 1), md.seq_lens[:b], self.scale,
                                            k_scale, v_scale, self.window, self.softcap,
                                            self.sinks)
            out.copy_(res.to(out.dtype))
