"""ClusterScheduler, a real vLLM scheduler, without processes: a lost step ends what has started
with the error it carries, a healing cluster holds new requests, and a new plan empties the prefix
cache and keeps block ids above its capacity out of use."""

import threading

import pytest
import torch

from metal_cluster.coordinator.cluster_control import CONTROL_KEY, ClusterControl
from metal_cluster.coordinator.cluster_scheduler import ClusterScheduler, loss_output
from metal_cluster.coordinator.vllm_platform import ACTIVATE_ENV

NUM_BLOCKS = 40
BLOCK = 16


@pytest.fixture
def scheduler(llama_model, monkeypatch):
    import vllm.platforms

    # Our platform, as in the engine process `serve` starts; resolved again for this test.
    monkeypatch.setenv(ACTIVATE_ENV, "1")
    monkeypatch.setattr(vllm.platforms, "_current_platform", None)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = EngineArgs(model=str(llama_model), max_model_len=256, enforce_eager=True, block_size=BLOCK,
                        enable_prefix_caching=True, max_num_batched_tokens=256).create_engine_config()
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    control = ClusterControl()
    config.additional_config[CONTROL_KEY] = control
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    cls = config.scheduler_config.get_scheduler_cls()
    # One stage: vLLM's async scheduling is on, so the platform picks the async variant.
    assert cls.__name__ == "AsyncClusterScheduler" and issubclass(cls, ClusterScheduler)
    sched = cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                block_size=BLOCK, log_stats=False)
    return sched, control


def request(req_id, prompt_len=40):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.utils.hashing import sha256
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(req_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=8), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def errors(outputs) -> dict:
    return {o.request_id: o for outs in outputs.values() for o in outs.outputs if o.error is not None}


def test_a_lost_step_ends_what_has_started(scheduler):
    from vllm.outputs import RequestError

    sched, control = scheduler
    for r in ("a", "b"):
        sched.add_request(request(r))
    first = sched.schedule()
    assert set(first.num_scheduled_tokens) == {"a", "b"}
    sched.add_request(request("waiting"))  # arrives after the step went out: not started
    failure = RequestError(code="stage_lost", message="a stage was lost: retry", retryable=True)
    outage = control.begin_outage("stage x died")
    ended = errors(sched.update_from_output(first, loss_output(first, failure, outage)))
    assert set(ended) == {"a", "b"} and all(o.error.message == "a stage was lost: retry" for o in ended.values())
    assert not sched.running and sched.requests.keys() == {"waiting"}  # held, not dropped
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1  # nothing leaked


def test_healing_holds_new_requests_and_a_smaller_plan_fences_blocks(scheduler):
    sched, control = scheduler
    sched.add_request(request("early"))
    sched.update_from_output(step := sched.schedule(), _tokens(step))
    control.begin_outage("stage x died")
    sched.add_request(request("held"))
    result = {}
    waiting = threading.Thread(target=lambda: result.update(step=sched.schedule()))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive()  # held while the cluster heals
    # "early" is still running: a step of the old plan will end it; the new plan waits for that.
    control.settle("serving", "re-planned", capacity_blocks=12)
    waiting.join(5)
    assert not waiting.is_alive() and result["step"].total_num_scheduled_tokens == 0
    from vllm.outputs import RequestError

    sched.update_from_output(step, loss_output(step, RequestError("stage_lost", "lost"), control.outage_id))
    assert "early" not in sched.requests
    step = sched.schedule()
    assert set(step.num_scheduled_tokens) == {"held"}
    for k in range(3):  # more requests than 12 blocks hold: none may use a fenced block id
        sched.add_request(request(f"more-{k}", prompt_len=60))
    step = sched.schedule()
    used = {b for new in step.scheduled_new_reqs for b in new.block_ids[0]}
    assert used and max(used) < 12
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() <= 12


def _tokens(step):
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(step.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7] for _ in ids])
