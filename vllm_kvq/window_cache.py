"""The residual window's memory inside vLLM's own pool, for running sequences only.

Each attention layer with a residual window gets a companion layer, `<layer>.kvq_window`,
whose KV-cache spec claims a few blocks of the same pool per request for as long as it runs
(a CircularBufferSpec that claims `window_blocks` blocks instead of one). vLLM's block
manager sizes, admits, frees and counts these blocks like any other, so the window costs
memory only for the sequences that run, inside the KV budget vLLM sizes. Not prefix-cached:
a cache hit ends on a block boundary, where the window is empty.

The window's pages have the quantized pages' size (same block size, same bytes per token:
vLLM needs one page size for both groups); their bytes are read as window rows
[rows_per_block, 2, H, D] in 16 bits, or [rows_per_block, 2, H, D + 4] uint8 for an 8-bit
window (`_w8`: int8 codes and a float32 scale; csrc/kvq_layout.h window_value_row_bytes).
vllm_kvq.residual plans which rows each step reads and writes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl,
                                       AttentionMetadataBuilder, CommonAttentionMetadata,
                                       MultipleOf)
from vllm.v1.core.single_type_kv_cache_manager import CircularBufferManager
from vllm.v1.kv_cache_interface import CircularBufferSpec, KVCacheLayout
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from vllm_kvq.config import speculative_tokens
from vllm_kvq.formats import KVFormat
from vllm_kvq.residual import window_addresses

WINDOW_SUFFIX = ".kvq_window"


@dataclass(frozen=True, kw_only=True)
class KVQWindowSpec(CircularBufferSpec):
    """The quantized layer's page geometry (uint8, state_content_bytes per token per head),
    `window_blocks` blocks per running request."""
    window_blocks: int = 1

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        del vllm_config
        return self.window_blocks * self.page_size_bytes

    def max_num_blocks_per_req(self, vllm_config: VllmConfig, max_len: int) -> int:
        del vllm_config, max_len
        return self.window_blocks


class KVQWindowManager(CircularBufferManager):
    """Claims a request's window blocks on its first step; vLLM frees them with the request."""

    def _claim_ring_block(self, request_id: str, record_for_zeroing: bool = True):
        req_blocks = self.req_to_blocks[request_id]
        if req_blocks:
            return []
        new_blocks = self.block_pool.get_new_blocks(self.kv_cache_spec.window_blocks)
        req_blocks.extend(new_blocks)
        # not recorded for zeroing: the window's validity is kept in vllm_kvq.residual
        return new_blocks

    def get_num_blocks_to_allocate(self, request_id: str, *args, **kwargs) -> int:
        return 0 if self.req_to_blocks.get(request_id) else self.kv_cache_spec.window_blocks


def _register() -> None:
    # vLLM registers its built-in specs on first use, and only if the registry is empty:
    # fill it first so ours is added to it rather than standing alone.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(KVQWindowSpec, KVQWindowManager)


# at import: the engine core imports this module when it unpickles a worker's KVQWindowSpec
_register()


@dataclass
class KVQWindowMetadata:
    blocks: torch.Tensor  # int32 [S, window_blocks]: each request's window blocks
    # per step, the window plan of each quantized layer group (keyed by its metadata object)
    # as (block, row) addresses in this group's blocks, resolved once
    addresses: dict = field(default_factory=dict)

    def addresses_of(self, md, rows_per_block: int) -> tuple:
        got = self.addresses.get(id(md))
        if got is None:
            got = self.addresses[id(md)] = window_addresses(md, self.blocks, rows_per_block)
        return got


class KVQWindowBuilder(AttentionMetadataBuilder[KVQWindowMetadata]):
    def __init__(self, kv_cache_spec: KVQWindowSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVQWindowMetadata:
        cam = common_attn_metadata
        n = self.kv_cache_spec.window_blocks
        return KVQWindowMetadata(blocks=cam.block_table_tensor[:cam.num_reqs, :n])


class KVQWindowImpl(AttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        raise TypeError("the residual window's layer is storage, it computes nothing")


class KVQWindowBackend(AttentionBackend):
    """The window layer's backend: its page layout and its metadata (the window blocks)."""

    @staticmethod
    def get_name() -> str:
        return "KVQ_WINDOW"

    @staticmethod
    def get_impl_cls() -> type[KVQWindowImpl]:
        return KVQWindowImpl

    @staticmethod
    def get_builder_cls() -> type[KVQWindowBuilder]:
        return KVQWindowBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)


class KVQWindowLayer(nn.Module, AttentionLayerBase):
    """Storage of one quantized layer's window rows, registered beside it in vLLM's forward
    context so that the model runner gives it a KV-cache spec and a cache view."""

    def __init__(self, name: str, static_forward_context: dict, fmt: KVFormat,
                 num_kv_heads: int, head_size: int, window_dtype: torch.dtype) -> None:
        super().__init__()
        if name in static_forward_context:
            raise ValueError(f"vllm-kvq: duplicate layer name {name!r}")
        static_forward_context[name] = self
        self.layer_name = name
        self.fmt = fmt
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        self.window_dtype = window_dtype
        self.kv_cache = torch.tensor([])
        # [num_blocks, rows_per_block, 2, H, D] 16-bit, or [..., D + 4] uint8 (8-bit window)
        self.rows: torch.Tensor | None = None
        self.rows_per_block = 0

    def get_attn_backend(self) -> type[AttentionBackend]:
        return KVQWindowBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVQWindowSpec:
        # the block size is read now, as vLLM's own layers do: it may change after loading
        B, D = vllm_config.cache_config.block_size, self.head_size
        return KVQWindowSpec(block_size=B, num_kv_heads=self.num_kv_heads, head_size=D,
                             dtype=torch.uint8,
                             state_content_bytes=self.fmt.layout(D, B).token_bytes,
                             window_blocks=self.fmt.window_blocks_per_seq(
                                 D, B, lookback=speculative_tokens(vllm_config)))

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """kv_cache: this layer's view [num_blocks, H, B, C] (uint8) of the pool; each block's
        page is dense (LBHNC), and is read as window rows."""
        self.kv_cache = kv_cache
        nb, H, B, _ = kv_cache.shape
        if not kv_cache[0].is_contiguous():
            raise ValueError("vllm-kvq: a window block's page must be one dense span "
                             f"(got strides {kv_cache.stride()})")
        D = self.head_size
        rows = self.rows_per_block = self.fmt.window_rows_per_block(D, B)
        value_row = self.fmt.window_value_row_bytes(D)  # one (K or V, head) row, in bytes
        flat = torch.as_strided(kv_cache, (nb, rows * 2 * H * value_row),
                                (kv_cache.stride(0), 1))
        elem = self.window_dtype.itemsize
        self.rows = flat.view(self.window_dtype).view(nb, rows, 2, H, value_row // elem)
