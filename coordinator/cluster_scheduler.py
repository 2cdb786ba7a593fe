"""vLLM's scheduler, aware that the stages under it can be lost and re-planned.

- A step that comes back as a `StageLossOutput` ends its requests with the error it carries, and, the
  first time an outage is seen, every running request too: their KV lived on the old stages.
- While the cluster heals, `schedule` waits: requests that have not started are held, not dropped.
- On a new plan the prefix cache is emptied (the new stages hold no KV) and, if the new stages hold
  fewer blocks than vLLM counts, the block ids above their capacity are kept out of use.
"""

from dataclasses import dataclass

import time

from vllm.outputs import RequestError
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from metal_cluster.coordinator.cluster_control import CONTROL_KEY


@dataclass
class StageLossOutput(ModelRunnerOutput):
    """The answer to a step the pipeline could not run: no tokens, and why."""

    failure: RequestError | None = None
    outage_id: int = 0


def loss_output(scheduler_output, failure: RequestError, outage_id: int) -> StageLossOutput:
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return StageLossOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                           sampled_token_ids=[[] for _ in req_ids], failure=failure, outage_id=outage_id)


class ClusterScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.vllm_config.additional_config
        self.control = config.get(CONTROL_KEY) if isinstance(config, dict) else None
        self.generation = self.control.generation if self.control else 0
        self.last_outage = 0  # outage ids only grow
        self.fenced = []  # blocks above the current plan's capacity
        self.deferred_since = None
        self.paused_for_drain = False

    def schedule(self, *args, **kwargs):
        if self.control is not None:
            self._follow_drain()
            view = self.control.wait_settled()
            if view.generation != self.generation:
                if self.running and not self._deferred_too_long():
                    # Steps of the old plan are still to come back; they end these requests.
                    return self._schedule_nothing(*args, **kwargs)
                self._adopt_plan(view)
        return super().schedule(*args, **kwargs)

    def _deferred_too_long(self) -> bool:
        self.deferred_since = self.deferred_since or time.monotonic()
        return time.monotonic() - self.deferred_since > 10

    def _schedule_nothing(self, *args, **kwargs):
        paused, self._pause_state = self._pause_state, PauseState.PAUSED_ALL
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self._pause_state = paused

    def update_from_output(self, scheduler_output, model_runner_output):
        failure = getattr(model_runner_output, "failure", None)
        if failure is not None:
            ended = set(scheduler_output.num_scheduled_tokens)
            if model_runner_output.outage_id > self.last_outage:
                self.last_outage = model_runner_output.outage_id
                # Everything that has started holds KV on the lost stages: running, or preempted.
                ended |= {r.request_id for r in self.running}
                ended |= {r.request_id for r in self.waiting if r.status == RequestStatus.PREEMPTED}
            for req_id in ended:
                request = self.requests.get(req_id)
                if request is not None and not request.is_finished():
                    # vLLM ends these with FINISHED_ERROR and hands the error to the API server.
                    self.grammar_compile_error_reqs[req_id] = failure
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.control is not None and self.control.draining and not self.running:
            self.control.drained.set()
        return outputs

    def _follow_drain(self) -> None:
        """While draining, only running requests go on (vLLM's PAUSED_NEW); once none runs, wait
        here (holding the new ones) until the re-plan takes over."""
        if self.control.draining:
            if not self.paused_for_drain:
                self._pause_state, self.paused_for_drain = PauseState.PAUSED_NEW, True
            if not self.running:
                self.control.drained.set()
                self.control.wait_drain_over()
        if self.paused_for_drain and not self.control.draining:
            self._pause_state, self.paused_for_drain = PauseState.UNPAUSED, False

    def get_num_unfinished_requests(self) -> int:
        if not self.paused_for_drain:
            return super().get_num_unfinished_requests()
        # Count the held requests too: an engine with nothing to do stops asking `schedule`, and
        # only `schedule` can take them up again after the re-plan.
        paused, self._pause_state = self._pause_state, PauseState.UNPAUSED
        try:
            return super().get_num_unfinished_requests()
        finally:
            self._pause_state = paused

    def _adopt_plan(self, view) -> None:
        pool = self.kv_cache_manager.block_pool
        pool.free_blocks(self.fenced)
        self.fenced = []
        # Whatever still runs (it should have ended with the outage) starts over on the new stages.
        self.reset_prefix_cache(reset_running_requests=True)
        if view.capacity_blocks is not None and view.capacity_blocks < pool.num_gpu_blocks:
            self.fenced = pool.blocks[view.capacity_blocks:]
            for block in self.fenced:
                pool.free_block_queue.remove(block)
                block.ref_cnt += 1
        self.generation = view.generation
        self.deferred_since = None


class AsyncClusterScheduler(ClusterScheduler, AsyncScheduler):
    """ClusterScheduler over vLLM's AsyncScheduler: a running request's next token is scheduled
    while the step that samples it still runs (the stage fills it in on the device)."""
