"""Sliding-window layers hold only their window: vLLM's own scheduler and hybrid KV cache manager,
given the specs the executor gives it, drive three in-process stages of a tiny Gemma 3 (2 sliding :
1 global, window 8) cut through its sliding/global pattern. Greedy output equals mlx-lm's while each
request's sliding-group block tables keep only the blocks their window spans, however long the
context grows; with chunked prefill, packed requests and a prefix-cache hit."""

import mlx.core as mx
import pytest
import torch
from mlx_lm.utils import load

import tiny_models
from references import mlx_lm_greedy

from metal_cluster.coordinator.engine.cluster_control import CONTROL_KEY, ClusterControl
from metal_cluster.coordinator.engine.step_translation import StepTranslator, to_runner_output
from metal_cluster.coordinator.engine.vllm_platform import ACTIVATE_ENV
from metal_cluster.stage_worker.kv.kv_layout import KVLayout
from metal_cluster.stage_worker.model.model_source import resolve_model
from metal_cluster.stage_worker.kv.paged_kv import KVPool, bytes_per_block
from metal_cluster.stage_worker.step.runner import StageRunner, to_response
from metal_cluster.stage_worker.model.shard import load_shard

BLOCK = 8
WINDOW = 8
NUM_BLOCKS = 96
RANGES = [(0, 2), (2, 4), (4, 6)]  # layers 2 and 5 are global: every stage mixes or lacks them
MAX_TOKENS = 48
CHUNK = 16  # max_num_batched_tokens: prompts arrive in chunks


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tiny_models.build_tiny_model("gemma3_text", tmp_path_factory.mktemp("gemma3-sliding"), num_layers=6,
                                          sliding_window=WINDOW)
    model, tokenizer = load(str(folder))
    return folder, model, tokenizer


@pytest.fixture
def cluster(gemma, monkeypatch):
    """vLLM's scheduler over the KV cache groups vLLM makes of our specs, and one StageRunner per
    range with the pool layout each stage builds from those groups."""
    import vllm.platforms

    # Our platform, as in the engine process `serve` starts: resolved before vLLM's config modules
    # are imported (they keep the platform they find at import).
    monkeypatch.setenv(ACTIVATE_ENV, "1")
    monkeypatch.setattr(vllm.platforms, "_current_platform", None)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    from metal_cluster.coordinator.engine.kv_specs import KV_LAYOUTS, global_kv_groups, kv_cache_specs

    folder = gemma[0]
    config = EngineArgs(model=str(folder), max_model_len=256, enforce_eager=True, block_size=BLOCK,
                        enable_prefix_caching=True, max_num_batched_tokens=CHUNK, async_scheduling=False,
                        num_gpu_blocks_override=NUM_BLOCKS).create_engine_config()
    config.additional_config[CONTROL_KEY] = ClusterControl()
    source = resolve_model(folder)
    shards = [load_shard(source, a, b) for a, b in RANGES]
    caches = [c for shard in shards for c in shard.caches]
    specs = kv_cache_specs(caches, RANGES, [torch.float32] * len(RANGES), BLOCK, "auto")
    resolve_kv_cache_layout(config, [KV_LAYOUTS] * len(RANGES), [s for stage in specs for s in stage.values()])
    kv_configs = get_kv_cache_configs(config, specs, [2**30] * len(RANGES), get_global_kv_cache_groups(config, specs))
    groups = global_kv_groups(kv_configs)
    scheduler_kv = generate_scheduler_kv_cache_config(kv_configs)
    config.cache_config.num_gpu_blocks = scheduler_kv.num_blocks
    sched = config.scheduler_config.get_scheduler_cls()(
        vllm_config=config, kv_cache_config=scheduler_kv, structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK, log_stats=False)
    runners = [StageRunner(shard, KVPool.allocate(shard.caches, scheduler_kv.num_blocks, BLOCK, mx.float32,
                                                  KVLayout.of_stage(groups, a, b, caches)))
               for shard, (a, b) in zip(shards, RANGES)]
    return sched, runners, groups


def _request(req_id, prompt, max_tokens):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def _run(sched, runners, requests, watch):
    """Schedule, run the stage chain, feed the answer back, until every request is done."""
    translator = StepTranslator(stage_keeps_tokens=False)
    for r in requests:
        sched.add_request(r)
    tokens = {r.request_id: [] for r in requests}
    cached_at_start = {}
    while sched.has_unfinished_requests():
        so = sched.schedule()
        cached_at_start.update({new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs})
        step = translator.to_step(so)
        hidden = None
        for runner in runners:
            out = runner.step(step, hidden)
            hidden = out.hidden
        response = to_response(out)
        translator.record(response)
        for s in response.sampled:
            tokens[s.req_id].append(s.token_id)
        watch(runners[0].table)
        sched.update_from_output(so, to_runner_output(so, response))
    return tokens, cached_at_start


def test_sliding_layers_hold_only_their_window(gemma, cluster):
    folder, model, tokenizer = gemma
    sched, runners, groups = cluster
    # vLLM's grouping of 2 global + 4 sliding layers: one global group and two sliding ones.
    assert sorted(groups) == [[0, 3], [1, 4], [2, 5]], groups
    full = groups.index([2, 5])
    # The blocks a window and one prefill chunk of max_num_batched_tokens can span.
    window_blocks = -(-(WINDOW - 1 + CHUNK) // BLOCK) + 1
    held = {}  # (who, "full" / "sliding") -> the most live blocks one request held in such a group
    longest = [0]

    def watch(table):
        for req_id, state in table.requests.items():
            views = {"vllm": sched.kv_cache_manager.get_block_ids(req_id), "stage": state.block_tables}
            for who, tables in views.items():
                for g, blocks in enumerate(tables):
                    key = (who, "full" if g == full else "sliding")
                    held[key] = max(held.get(key, 0), sum(b != 0 for b in blocks))
            longest[0] = max(longest[0], state.num_computed_tokens)

    prompts = [tokenizer.encode(p) for p in ("a tiny model with a sliding window of eight tokens",
                                             "one", "global layers read everything, sliding ones do not")]
    first, _ = _run(sched, runners, [_request(f"r{i}", p, MAX_TOKENS) for i, p in enumerate(prompts)], watch)
    assert first == {f"r{i}": mlx_lm_greedy(model, p, MAX_TOKENS) for i, p in enumerate(prompts)}
    assert longest[0] > 6 * WINDOW
    for who in ("vllm", "stage"):
        assert held[who, "full"] >= longest[0] // BLOCK, held  # the global layers keep everything
        # ... and the sliding ones what their window spans, however long the context.
        assert 0 < held[who, "sliding"] <= window_blocks, held

    # A prefix-cache hit: the global group's cached blocks, the sliding groups' last window.
    longer = prompts[0] + prompts[2]
    again, cached = _run(sched, runners, [_request("hit", longer, 12)], watch)
    assert cached["hit"] >= BLOCK, cached
    assert again["hit"] == mlx_lm_greedy(model, longer, 12)


def test_a_stage_pool_costs_its_largest_group_not_every_layer(gemma, cluster):
    """Each stage here has one layer of each of two groups: they share one array, so a block costs
    one layer's K and V where every layer in its own array would cost two."""
    _, runners, groups = cluster
    for runner, (a, b) in zip(runners, RANGES):
        own = bytes_per_block(runner.shard.caches, BLOCK, mx.float32)
        shared = bytes_per_block(runner.shard.caches, BLOCK, mx.float32, KVLayout.of_stage(groups, a, b))
        assert shared * 2 == own
        assert runner.pool.nbytes == shared * runner.pool.num_blocks
