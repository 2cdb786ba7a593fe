"""ClusterScheduler, a real vLLM scheduler, without processes: a lost step takes back what has
started (held, then resumed on the new plan), a healing cluster holds new requests, a new plan
empties the prefix cache and keeps block ids above its capacity out of use, and a request the new
plan cannot hold, or one held too long, ends with a retryable error."""

import time

import pytest
import torch

from metal_cluster.coordinator.engine.cluster_control import CONTROL_KEY, ClusterControl
from metal_cluster.coordinator.engine.cluster_scheduler import ClusterScheduler, loss_output
from metal_cluster.coordinator.engine.step_translation import StepTranslator
from metal_cluster.coordinator.engine.vllm_platform import ACTIVATE_ENV

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


def test_a_lost_step_holds_what_has_started_and_the_new_plan_resumes_it(scheduler):
    from vllm.outputs import RequestError
    from vllm.v1.request import RequestStatus

    sched, control = scheduler
    for r in ("a", "b"):
        sched.add_request(request(r))
    first = sched.schedule()
    old_plan = StepTranslator()
    old_plan.to_step(first)
    sched.update_from_output(first, _tokens(first))  # both have a token out
    second = sched.schedule()
    assert set(second.num_scheduled_tokens) == {"a", "b"}
    sched.add_request(request("waiting"))  # arrives after the step went out: not started
    failure = RequestError(code="stage_lost", message="a stage was lost: retry", retryable=True)
    outage = control.begin_outage("stage x died")
    assert not errors(sched.update_from_output(second, loss_output(second, failure, outage)))
    # Taken back as vLLM preempts: no blocks, nothing computed, prompt and output kept.
    assert not sched.running and sched.requests.keys() == {"a", "b", "waiting"}
    for r in ("a", "b"):
        held = sched.requests[r]
        assert held.status == RequestStatus.PREEMPTED and held.num_computed_tokens == 0
        assert list(held.output_token_ids) == [7]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1  # nothing leaked
    assert control.requests_held == 2
    # While healing nothing is scheduled, and schedule returns (the engine keeps taking aborts).
    assert sched.schedule().total_num_scheduled_tokens == 0
    control.settle("serving", "re-planned", capacity_blocks=NUM_BLOCKS)
    step = sched.schedule()
    assert step.num_scheduled_tokens["a"] == 41  # first, recomputing prompt and output
    # What the new plan's stages are told (they have never seen these requests): prompt + output.
    sent = {r.req_id: r for r in StepTranslator(admitted=old_plan.admitted).to_step(step).new_requests}
    for r in ("a", "b"):
        assert list(sent[r].prompt_token_ids) == list(range(1, 41)) and list(sent[r].output_token_ids) == [7]
    assert control.requests_resumed == 2 and control.requests_held == 0 and control.requests_lost == 0


def test_healing_holds_new_requests_and_a_smaller_plan_fences_blocks(scheduler):
    sched, control = scheduler
    sched.add_request(request("early"))
    sched.update_from_output(step := sched.schedule(), _tokens(step))
    control.begin_outage("stage x died")
    sched.add_request(request("held"))
    began = time.monotonic()
    assert sched.schedule().total_num_scheduled_tokens == 0  # held while the cluster heals
    assert time.monotonic() - began < 1
    assert "early" in sched.requests and not sched.running
    control.settle("serving", "re-planned", capacity_blocks=12)
    step = sched.schedule()
    assert set(step.num_scheduled_tokens) == {"early", "held"}
    for k in range(3):  # more requests than 12 blocks hold: none may use a fenced block id
        sched.add_request(request(f"more-{k}", prompt_len=60))
    step = sched.schedule()
    used = {b for new in step.scheduled_new_reqs for b in new.block_ids[0]}
    assert used and max(used) < 12
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() <= 12


def test_a_request_the_smaller_plan_cannot_hold_ends_with_a_retryable_error(scheduler):
    from vllm.outputs import RequestError

    sched, control = scheduler
    sched.add_request(request("small", prompt_len=8))
    sched.add_request(request("large", prompt_len=40))  # 40 + 8 tokens: 3 blocks of 16
    step = sched.schedule()
    outage = control.begin_outage("stage x died")
    sched.update_from_output(step, loss_output(step, RequestError("stage_lost", "lost", retryable=True), outage))
    control.settle("serving", "re-planned", capacity_blocks=3)  # two usable blocks beside the null block
    step = sched.schedule()
    assert step.total_num_scheduled_tokens == 0
    ended = errors(sched.update_from_output(step, _tokens(step)))
    assert set(ended) == {"large"} and ended["large"].error.retryable
    assert "holds 2 KV blocks" in ended["large"].error.message and "needs 3" in ended["large"].error.message
    assert set(sched.schedule().num_scheduled_tokens) == {"small"}
    assert control.requests_resumed == 1 and control.requests_lost == 1


def test_a_request_held_past_the_resume_timeout_ends(scheduler):
    from vllm.outputs import RequestError

    sched, control = scheduler
    control.resume_timeout_s = 0.2
    sched.add_request(request("a"))
    step = sched.schedule()
    outage = control.begin_outage("stage x died")
    sched.update_from_output(step, loss_output(step, RequestError("stage_lost", "lost", retryable=True), outage))
    time.sleep(0.3)
    step = sched.schedule()
    ended = errors(sched.update_from_output(step, _tokens(step)))
    assert set(ended) == {"a"} and "--resume-timeout" in ended["a"].error.message and ended["a"].error.retryable
    assert not sched.requests and control.requests_lost == 1 and control.requests_held == 0


def _tokens(step):
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(step.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7] for _ in ids])
