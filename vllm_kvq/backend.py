"""The vLLM attention backend that serves from a quantized KV cache.

One file, as vLLM's own backends: Backend (capabilities as class data), Metadata, Builder,
Impl. Registered as AttentionBackendEnum.CUSTOM by vllm_kvq.plugin; selected with
`--attention-backend CUSTOM --additional-config '{"kvq": {"method": "kivi2"}}'`.

- Page size: `customize_spec` turns the layer's spec into a uint8 page of C bytes per token
  per kv head, C taken from the format layout (csrc/kvq_layout.h), so vLLM's own block
  manager hands out more blocks at the same KV budget.
- Writes: quantize-on-write in `forward` (forward_includes_kv_cache_update), because the
  residual window needs the step's metadata. With a residual window, tokens are quantized
  in aligned chunks; the recent ones live in 16 bits in blocks of vLLM's own pool that a
  companion layer claims per running request (vllm_kvq.window_cache), planned step by step
  by vllm_kvq.residual.
- Reads: decodes and short chunks (vLLM orders them first, reorder_batch_threshold) in one
  paged-kernel call per layer (vllm_kvq.ops); long prefills after them through torch's
  flash attention over their pages dequantized once (vllm_kvq.prefill).
- nuq formats: each layer passes its own codebooks (the calibration file's levels for that
  layer index, taken from the layer name, e.g. model.layers.12.self_attn.attn -> 12).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl, AttentionLayer,
                                       AttentionMetadataBuilder, AttentionType,
                                       CommonAttentionMetadata, MultipleOf)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout, SlidingWindowSpec

from vllm_kvq import ops, prefill
from vllm_kvq.config import (KVQConfig, config_from_vllm, layer_index, model_levels,
                             speculative_tokens)
from vllm_kvq.formats import SUPPORTED_HEAD_SIZES
from vllm_kvq.residual import (ResidualWindows, StepPlan, plan_tensors, stage_and_write,
                               window_dtype)
from vllm_kvq.window_cache import WINDOW_SUFFIX, KVQWindowLayer, KVQWindowMetadata

# customize_spec runs with no current vLLM config: the impls and the builder record the
# engine's config here when they are built (one engine per process).
_ACTIVE: KVQConfig | None = None


def active_config(vllm_config: VllmConfig | None = None) -> KVQConfig:
    """The engine's kvq config (config_from_vllm parses it once per process)."""
    global _ACTIVE
    if vllm_config is not None:
        _ACTIVE = config_from_vllm(vllm_config)
    if _ACTIVE is None:
        _ACTIVE = config_from_vllm(get_current_vllm_config())
    return _ACTIVE


class KVQAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the layer looks itself up as AttentionBackendEnum[get_name()]

    @staticmethod
    def get_impl_cls() -> type["KVQAttentionImpl"]:
        return KVQAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["KVQMetadataBuilder"]:
        return KVQMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Each layer's cache is a dense [num_blocks, H, block_size, C] byte tensor.
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        fmt = active_config().fmt
        if spec.head_size_v != spec.head_size:
            raise ValueError(f"vllm-kvq needs equal K and V head sizes, got "
                             f"{spec.head_size} and {spec.head_size_v}")
        # vLLM first probes a sliding-window layer with block_size=1 for its bytes per token
        # (model_executor/layers/attention/attention.py): answer for the usual 128
        B = spec.block_size if spec.block_size % 16 == 0 else 128
        layout = fmt.layout(spec.head_size, B)
        # keeps the spec's class (full or sliding window): vLLM's manager for it recycles
        # the blocks that leave a sliding window
        return dataclasses.replace(spec, dtype=torch.uint8,
                                   state_content_bytes=layout.token_bytes)


@dataclass
class KVQMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor   # int32 [S+1]
    seq_lens: torch.Tensor          # int32 [S]
    block_table: torch.Tensor       # int32 [S, max_blocks]
    slot_mapping: torch.Tensor      # int64 [T]
    # the residual window's bookkeeping (None when R == 1) and, once the step's first layer
    # made it from the window group's blocks, its plan
    windows: ResidualWindows | None = None
    plan: StepPlan | None = None
    # the plan's index lists as tensors (built once per step, shared by all layers)
    staging_start_loc: torch.Tensor | None = None
    staging_pos0: torch.Tensor | None = None
    pool_gather: tuple[torch.Tensor, ...] | None = None
    new_gather: tuple[torch.Tensor, ...] | None = None
    final_rows: torch.Tensor | None = None
    final_slots: torch.Tensor | None = None
    keep: tuple[torch.Tensor, ...] | None = None
    # decodes / short chunks first (reorder_batch_threshold), long prefills after them on
    # the flash path (vllm_kvq.prefill); None: the paged kernel for the whole batch
    split: prefill.Split | None = None
    # a sequence of this step takes the flash path (set by the builder; split made with it)
    flash: bool = False

    def plan_window(self, window: KVQWindowMetadata, device) -> None:
        """This step's window plan. Made by the first layer that runs the step: it needs each
        request's window blocks, which the window group's builder holds."""
        qsl = self.query_start_loc.tolist()
        seq_lens = self.seq_lens.tolist()
        plan = self.windows.plan(seq_lens, qsl, self.block_table.tolist(),
                                 window.blocks.tolist())
        self.plan = plan
        for name, value in plan_tensors(plan, device).items():
            setattr(self, name, value)
        if self.flash:
            self.split = prefill.plan(qsl, seq_lens, plan.staging_start, plan.staging_pos0)


class KVQMetadataBuilder(AttentionMetadataBuilder[KVQMetadata]):
    # vLLM puts sequences with at most this many query tokens first in the batch; the
    # longer ones after them go to the flash prefill path (vllm_kvq.prefill)
    reorder_batch_threshold: int = prefill.PREFILL_MIN_QUERY - 1

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.config = active_config(vllm_config)
        self.device = device
        fmt, B = self.config.fmt, kv_cache_spec.block_size
        self.windows = (ResidualWindows(fmt.residual_chunk, B, fmt.window_rows_per_block(
            kv_cache_spec.head_size, B), speculative_tokens(vllm_config))
            if fmt.residual_tokens else None)
        # Chunks of >= PREFILL_MIN_QUERY queries take the flash path (vllm_kvq.prefill) on the
        # CPU unless KVQ_FLASH_PREFILL=0; decodes and short chunks stay on the paged kernel,
        # and so do all of a sliding-window layer's (the kernel masks per row).
        self.flash = (device.type == "cpu" and prefill.FLASH_PREFILL
                      and not isinstance(kv_cache_spec, SlidingWindowSpec))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVQMetadata:
        cam = common_attn_metadata
        S = cam.num_reqs
        md = KVQMetadata(num_actual_tokens=cam.num_actual_tokens,
                         query_start_loc=cam.query_start_loc[:S + 1],
                         seq_lens=cam.seq_lens[:S],
                         block_table=cam.block_table_tensor[:S],
                         slot_mapping=cam.slot_mapping, windows=self.windows,
                         flash=self.flash and cam.max_query_len >= prefill.PREFILL_MIN_QUERY)
        if md.flash and self.windows is None:  # with a window: made with its plan
            md.split = prefill.plan(cam.query_start_loc_cpu[:S + 1].tolist(),
                                    cam.seq_lens[:S].tolist())
        return md


class KVQAttentionImpl(AttentionImpl[KVQMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **unsupported) -> None:
        vllm_config = get_current_vllm_config()
        self.config = active_config(vllm_config)
        self.fmt = self.config.fmt
        problems = {
            "alibi_slopes": alibi_slopes is not None,
            f"attn_type={attn_type}": attn_type != AttentionType.DECODER,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name is not None,
            f"kv_cache_dtype={kv_cache_dtype}": kv_cache_dtype != "auto",
            **{k: v is not None for k, v in unsupported.items()},
        }
        bad = [k for k, v in problems.items() if v]
        if bad:
            raise NotImplementedError(
                f"vllm-kvq's backend does not support {', '.join(bad)} (decoder-only "
                f"full or sliding-window attention, logit soft-capping or not, with "
                f"kv_cache_dtype=auto; choose the format with --additional-config "
                f"kvq.method)")
        self.sliding_window = ops.sliding_window_for(self.fmt, sliding_window)
        self.logits_soft_cap = ops.soft_cap_for(logits_soft_cap)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self.static_forward_context = vllm_config.compilation_config.static_forward_context
        self.window: KVQWindowLayer | None = None  # the residual window's storage layer
        self.all_levels = model_levels(self.config, vllm_config)
        self.ops: ops.LayerOps | None = None  # this layer's kernels, bound on its first step

    def _bind(self, layer: AttentionLayer, device) -> ops.LayerOps:
        """Resolve this layer's kernels once: codebooks (by layer index), static scales."""
        kl = vl = None
        if self.all_levels:
            idx = layer_index(layer.layer_name)
            if idx >= len(self.all_levels):
                raise ValueError(f"vllm-kvq: layer {layer.layer_name!r} has index {idx}, "
                                 f"the calibration covers {len(self.all_levels)} layers")
            kl, vl = self.all_levels[idx]
        return ops.LayerOps(self.fmt, self.num_kv_heads, self.head_size, device,
                            k_scale=self.config.k_scale, v_scale=self.config.v_scale,
                            k_levels=kl, v_levels=vl, sliding_window=self.sliding_window,
                            logits_soft_cap=self.logits_soft_cap)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Register the residual window's storage layer beside this one, before vLLM asks the
        model's layers for their KV-cache specs (after loading)."""
        if not self.fmt.residual_tokens or self.window is not None:
            return
        ctx = self.static_forward_context
        name = next(n for n, layer in ctx.items() if getattr(layer, "impl", None) is self)
        self.window = KVQWindowLayer(name + WINDOW_SUFFIX, ctx, self.fmt, self.num_kv_heads,
                                     self.head_size,
                                     window_dtype(act_dtype, self.fmt.window_bits))

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: KVQMetadata,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("vllm-kvq does not fuse output quantization")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        md = attn_metadata
        lops = self.ops
        if lops is None:
            lops = self.ops = self._bind(layer, query.device)
        n = md.num_actual_tokens
        k, v = key[:n], value[:n]
        if md.windows is None:
            lops.write(k, v, kv_cache, md.slot_mapping[:n])
            lops.attend(query[:n], kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
                        self.scale, output[:n], split=md.split)
        else:
            window = get_forward_context().attn_metadata[self.window.layer_name]
            if md.plan is None:
                md.plan_window(window, query.device)
            # a rotated format's window keeps its rows rotated: the step's tokens are
            # rotated once here, not the whole window every step
            k, v = lops.rotate_rows(k, v)
            st_k, st_v = stage_and_write(md, k, v, self.window.rows,
                                         window.addresses_of(md, self.window.rows_per_block),
                                         lambda sk, sv, slots: lops.write(
                                             sk, sv, kv_cache, slots, rotated=True))
            lops.attend(query[:n], kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
                        self.scale, output[:n], st_k, st_v, md.staging_start_loc,
                        md.staging_pos0, split=md.split, staging_rotated=True)
        return output
