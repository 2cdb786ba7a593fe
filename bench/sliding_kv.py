"""What Gemma 3's sliding-window layers save in KV: the bytes one request of a given context holds
over all stages, with vLLM's hybrid KV cache (sliding layers keep their window) against every layer
keeping everything (what a stage held before). The grouping is vLLM's own, of the specs the executor
gives it (`kv_specs.kv_cache_specs`); each stage's pool layout is `KVLayout.of_stage`, as a stage
builds it. Only the layer pattern matters for the ratio, so the model is a tiny random one with
Gemma-3-27B's pattern (62 layers, 5 sliding : 1 global, window 1024); the absolute figures use
Gemma-3-27B's K/V width (16 KV heads x 128, bfloat16). No GPU, no weights downloaded.
Run: `.venv/bin/python bench/sliding_kv.py`.
"""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ["METAL_CLUSTER_VLLM"] = "1"  # our vLLM platform, before vLLM's config modules load

import torch  # noqa: E402

import tiny_models  # noqa: E402

LAYERS, WINDOW, PATTERN = 62, 1024, 6
BLOCK = 16
PAGE_BYTES_PER_TOKEN = 2 * 16 * 128 * 2  # K and V, 16 KV heads x 128, bfloat16: per layer
CONTEXTS = (4096, 32768, 131072)


def groups_for(folder: Path, ranges):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    from metal_cluster.coordinator.engine.kv_specs import KV_LAYOUTS, global_kv_groups, kv_cache_specs
    from metal_cluster.stage_worker.families import family_of
    from metal_cluster.stage_worker.model.model_source import resolve_model

    config = EngineArgs(model=str(folder), max_model_len=max(CONTEXTS), block_size=BLOCK,
                        enforce_eager=True).create_engine_config()
    source = resolve_model(folder)
    caches = family_of(source.config, folder).layer_caches(source.config)
    specs = kv_cache_specs(caches, ranges, [torch.bfloat16] * len(ranges), BLOCK, "auto")
    resolve_kv_cache_layout(config, [KV_LAYOUTS] * len(ranges), [s for stage in specs for s in stage.values()])
    configs = get_kv_cache_configs(config, specs, [2**40] * len(ranges), get_global_kv_cache_groups(config, specs))
    return caches, global_kv_groups(configs)


def request_bytes(caches, groups, ranges, context: int) -> tuple[int, int]:
    """(hybrid, every layer full): KV bytes one `context`-token request holds over all stages."""
    from metal_cluster.stage_worker.kv.kv_layout import KVLayout
    from metal_cluster.stage_worker.kv.paged_kv import blocks_held

    blocks = -(-context // BLOCK)
    held = [blocks_held(caches[g[0]], context, BLOCK) for g in groups]
    hybrid = full = 0
    for a, b in ranges:
        arrays = KVLayout.of_stage(groups, a, b, caches).num_arrays
        hybrid += sum(held) * arrays * BLOCK * PAGE_BYTES_PER_TOKEN  # a block id costs every array a row
        full += blocks * (b - a) * BLOCK * PAGE_BYTES_PER_TOKEN
    return hybrid, full


def main() -> None:
    from metal_cluster.coordinator.cluster.stages import even_split

    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_models.build_tiny_model(
            "gemma3_text", Path(tmp) / "gemma3-27b-pattern", num_layers=LAYERS, sliding_window=WINDOW,
            config_overrides={"sliding_window_pattern": PATTERN, "max_position_embeddings": max(CONTEXTS),
                              "layer_types": ["full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention"
                                              for i in range(LAYERS)]})
        print(f"| stages | context | KV per request, every layer full | with sliding windows | ratio |")
        print("|---:|---:|---:|---:|---:|")
        for stages in (1, 2, 4):
            ranges = even_split(LAYERS, stages)
            caches, groups = groups_for(folder, ranges)
            for context in CONTEXTS:
                hybrid, full = request_bytes(caches, groups, ranges, context)
                print(f"| {stages} | {context} | {full / 2**30:.2f} GiB | {hybrid / 2**30:.2f} GiB | "
                      f"{hybrid / full:.2f} |")


if __name__ == "__main__":
    main()
