"""What vLLM is told about the stages' KV caches: a spec per layer, the block size, and what memory
the pools have, so that vLLM's own block manager (hybrid groups included) counts the real blocks.

Layers are `model.layers.{i}.self_attn.attn` by global index; each stage's layers are one dict.
A recurrent layer (Gated DeltaNet) is a MambaSpec: a fixed-size state per block id. vLLM's hybrid
manager needs one page size for all groups, so the attention block size is raised until a
layer's K/V page holds a state page, and the state page is padded to it (vLLM's own executors do
this in `Platform.update_block_size_for_backend`, from torch layers we do not have).
"""

from metal_cluster.stage_worker.model.dtypes import from_name
from metal_cluster.stage_worker.kv.kv_layout import KVLayout, layer_groups
from metal_cluster.stage_worker.kv.paged_kv import bytes_per_block

# vLLM's name for the layout a stage's pool has: a layer's blocks after another's (`paged_kv.py`).
KV_LAYOUTS = ["LBNHC"]
# vLLM's smallest kernel block; the hybrid block size is a multiple of it.
BLOCK_ALIGNMENT = 16


def kv_cache_specs(caches, ranges, dtypes, block_size: int, cache_dtype: str, state_block_size: int = 0,
                   mamba_cache_mode: str = "none") -> list[dict]:
    """vLLM's KV cache spec of every layer, one dict per stage (vLLM groups them). state_block_size:
    the tokens one state block stands for (vLLM's mamba_block_size)."""
    return [{f"model.layers.{i}.self_attn.attn": _layer_spec(
        caches[i], dtype, block_size, cache_dtype, attention_page(caches, block_size, dtype),
        state_block_size, mamba_cache_mode) for i in range(a, b)} for (a, b), dtype in zip(ranges, dtypes)]


def _layer_spec(cache, dtype, block_size: int, cache_dtype: str, page: int, state_block_size: int,
                mamba_cache_mode: str):
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    if cache.state_shapes:  # the recurrent state in float32, as mlx-lm keeps it
        return MambaSpec(shapes=cache.state_shapes, dtypes=(dtype, torch.float32), block_size=state_block_size,
                         page_size_padded=page, mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                         mamba_cache_mode=mamba_cache_mode)
    common = dict(block_size=block_size, num_kv_heads=cache.kv_heads, head_size=cache.head_dim, dtype=dtype)
    if cache.shared_kv:  # one latent entry per token, no separate V (MLA)
        return MLAAttentionSpec(**common, cache_dtype_str=cache_dtype)
    if cache.sliding_window:  # vLLM's hybrid KV manager then frees the blocks behind the window
        return SlidingWindowSpec(**common, sliding_window=cache.sliding_window)
    return FullAttentionSpec(**common)


def attention_page(caches, block_size: int, dtype) -> int:
    """Bytes of one attention layer's block (the largest, if layers differ)."""
    return max((c.block_bytes(block_size, dtype.itemsize) for c in caches if not c.state_shapes), default=0)


def hybrid_block_size(caches, block_size: int) -> int:
    """The smallest block size, from `block_size` up in steps of BLOCK_ALIGNMENT, whose K/V page
    holds a recurrent layer's state page in any dtype a stage may run: the page is counted in
    2-byte K/V and the state in 4-byte entries, so one size serves CPU (float32) and GPU
    (bf16/fp16) stages alike. `block_size` for a model without recurrent layers."""
    states = [c.block_bytes(0, 4) for c in caches if c.state_shapes]
    per_token = min((c.block_bytes(1, 2) for c in caches if not c.state_shapes), default=0)
    if not states or not per_token:
        return block_size
    needed = -(-max(states) // per_token)
    return max(block_size, -(-needed // BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT)


def global_kv_groups(kv_cache_configs) -> list[list[int]]:
    """vLLM's KV cache groups over the whole model, as layer indices: each stage's config holds
    its own layers of every group; the stages' layers are in order. One group: [] (the default)."""
    per_stage = [layer_groups([g.layer_names for g in c.kv_cache_groups]) for c in kv_cache_configs]
    if max(len(groups) for groups in per_stage) <= 1:
        return []
    return [sum((groups[g] for groups in per_stage), []) for g in range(len(per_stage[0]))]


def vllm_groups(vllm_config, specs: list[dict]):
    """The KV cache groups vLLM will make of these specs, and the same as layer indices ([] for one
    group), before it makes them: the pools' cost per block id depends on them."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

    groups = get_global_kv_cache_groups(vllm_config, specs)
    return groups, (layer_groups([g.layer_names for g in groups]) if len(groups) > 1 else [])


def vllm_bytes_per_block(groups, spec: dict) -> int:
    """What vLLM counts a block id as on one stage: its largest group's pages there."""
    return max(sum(spec[name].page_size_bytes for name in g.layer_names if name in spec) for g in groups)


def pool_bytes_per_block(caches, ranges, dtype_names, block_size: int, kv_groups) -> list[int]:
    """What one block id costs each stage's pool, laid out for these groups: one array per layout
    slot, recurrent states beside K/V rather than over them as in vLLM's GPU runner. A stage's
    memory reaches vLLM scaled by vllm_bytes_per_block / this, so that vLLM counts the blocks the
    pool really holds (the same for models without recurrent layers)."""
    return [bytes_per_block(caches[a:b], block_size, from_name(d), KVLayout.of_stage(kv_groups, a, b, caches))
            for (a, b), d in zip(ranges, dtype_names)]
