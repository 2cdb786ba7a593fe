"""vLLM's scheduler, aware that the stages under it can be lost and re-planned.

- A lost stage is a pause: the requests that were running are taken back as vLLM preempts them
  (blocks freed, computed tokens reset, prompt and output kept) and held. Output of the old plan
  still in flight is dropped (vLLM's stale-output drain), so no token is delivered twice.
- While the cluster heals, `schedule` schedules nothing but keeps returning (every HOLD_POLL_S), so
  that the engine still takes aborts: a client that goes away frees its hold at once.
- On a new plan the prefix cache is emptied (the new stages hold no KV), the block ids above the new
  stages' capacity are kept out of use, and the held requests go first (they are at the front of
  the waiting queue), recomputing their context where they stopped. A request the new plan cannot
  hold, or one held past the resume timeout, ends with a retryable error; so do all of them when
  no plan can serve.
"""

import time
from dataclasses import dataclass, field, fields

from vllm.outputs import RequestError
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from metal_cluster.coordinator.engine.cluster_control import CONTROL_KEY
from metal_cluster.coordinator.engine.model_drafts import ModelDrafter
from metal_cluster.coordinator.engine.ngram import NgramDrafter

HOLD_POLL_S = 0.05


@dataclass
class StageLossOutput(ModelRunnerOutput):
    """The answer to a step the pipeline could not run: no tokens, and why."""

    failure: RequestError | None = None
    outage_id: int = 0


@dataclass
class DraftedOutput(ModelRunnerOutput):
    """A step's output with the draft model's next drafts: request id -> (the history length
    they follow, the drafts)."""

    spec_drafts: dict[str, tuple[int, list[int]]] | None = None


@dataclass
class KeptBackOutput(DraftedOutput):
    """A step's output with requests that could not run in it (their LoRA adapter cannot be read):
    they produced nothing and end with their own error; the others in the step are untouched."""

    request_errors: dict[str, RequestError] = field(default_factory=dict)


def with_request_errors(output: ModelRunnerOutput, errors: dict[str, RequestError]) -> KeptBackOutput:
    return KeptBackOutput(**{f.name: getattr(output, f.name) for f in fields(ModelRunnerOutput)},
                          spec_drafts=getattr(output, "spec_drafts", None), request_errors=errors)


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
        self.last_outage = 0  # outage ids only grow; each one takes the running requests back once
        self.fenced = []  # blocks above the current plan's capacity
        self.held: dict[str, float] = {}  # request id -> when the outage took it back
        self.paused_for_drain = False
        spec = self.vllm_config.speculative_config
        self.drafter = (NgramDrafter.from_config(spec, self.max_model_len)
                        or ModelDrafter.from_config(spec, self.max_model_len))

    def schedule(self, *args, **kwargs):
        if self.control is not None:
            self._follow_drain()
            view = self.control.wait_settled(HOLD_POLL_S)
            if view.state == "healing":
                self._hold(view.outage_id)
                self._end_overdue()
                if self.held.keys() - self.requests.keys():
                    self._note_held()  # aborted by their clients meanwhile: no longer held
                return self._schedule_nothing(*args, **kwargs)
            if view.generation != self.generation:
                self._adopt_plan(view)
                if self.grammar_compile_error_reqs:
                    # Requests the new plan cannot take: ended by the output of this empty step,
                    # before any of them is scheduled on it.
                    return self._schedule_nothing(*args, **kwargs)
        return super().schedule(*args, **kwargs)

    def _schedule_nothing(self, *args, **kwargs):
        paused, self._pause_state = self._pause_state, PauseState.PAUSED_ALL
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self._pause_state = paused

    def update_from_output(self, scheduler_output, model_runner_output):
        failure = getattr(model_runner_output, "failure", None)
        if failure is not None:
            if failure.code == "stage_lost":
                # Held, not ended; this step's own output is stale now, and vLLM drops it.
                self._hold(model_runner_output.outage_id)
            else:  # no plan can serve: the requests this step carried end with the reason
                self._end(set(scheduler_output.num_scheduled_tokens), failure)
        self._fail(getattr(model_runner_output, "request_errors", None) or {})
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.drafter is not None and failure is None:
            self._draft(scheduler_output, model_runner_output)
        if self.control is not None and self.control.draining and not self.running:
            self.control.drained.set()
        return outputs

    def _draft(self, scheduler_output, model_runner_output) -> None:
        """The next drafts of the requests this output extended, set here, once the output has
        completed the history they follow (vLLM's executor hook, take_draft_token_ids, runs after
        steps that only queued work under pipeline parallelism, before the tokens the drafts follow
        are known): n-grams are made here, a draft model's came with the output."""
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING or request.is_prefill_chunk:
                continue
            drafts = self.drafter.drafts(request, model_runner_output)
            request.spec_token_ids = self.structured_output_manager.validate_tokens(request, drafts) if drafts else []

    # --- an outage: hold, resume or end ----------------------------------------------------------
    def _hold(self, outage_id: int) -> None:
        """Take back every running request of the plan that was lost, as vLLM preempts one."""
        if outage_id <= self.last_outage:
            return
        self.last_outage = outage_id
        now = time.monotonic()
        while self.running:
            request = self.running.pop()  # from the back: the waiting queue gets them in their order
            self._preempt_request(request, now, drop_stale_output=True)
            self.held[request.request_id] = now
        # Resumed requests must carry their whole history (all_token_ids) to the new stages.
        self.prev_step_scheduled_req_ids.clear()
        self._note_held()

    def _end_overdue(self) -> None:
        limit = self.control.resume_timeout_s
        now = time.monotonic()
        overdue = {r for r, since in self.held.items() if now - since > limit}
        if overdue:
            self._end(overdue, RequestError(
                code="stage_lost", retryable=True,
                message=f"this request was running when the cluster lost a stage and waited {limit:.0f}s "
                        f"(--resume-timeout) for the new plan: retry the request ({self.control.reason})"))

    def _end(self, req_ids: set[str], error: RequestError) -> None:
        lost = 0
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished() and req_id not in self.grammar_compile_error_reqs:
                # vLLM ends these with FINISHED_ERROR in update_from_output and hands the API server the error.
                self.grammar_compile_error_reqs[req_id] = error
                lost += req_id in self.held
            self.held.pop(req_id, None)
        self._note_held(lost=lost)

    def _fail(self, errors: dict[str, RequestError]) -> None:
        """Requests that did not run end with their error. vLLM hashed their full blocks into the
        prefix cache when it scheduled them; nothing was computed there, so the hashes go."""
        pool = self.kv_cache_manager.block_pool
        for req_id, error in errors.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            pool.evict_blocks({b for group in self.kv_cache_manager.get_block_ids(req_id) for b in group})
            self.grammar_compile_error_reqs.setdefault(req_id, error)

    def _note_held(self, resumed: int = 0, lost: int = 0) -> None:
        self.held = {r: t for r, t in self.held.items() if r in self.requests}  # aborted meanwhile: gone
        if self.control is not None:
            self.control.note_requests(len(self.held), resumed, lost)

    def _unfit(self, capacity_blocks: int | None) -> dict[str, RequestError]:
        """Unfinished requests whose whole length (prompt + max tokens) the new stages cannot hold."""
        if capacity_blocks is None:
            return {}
        usable = capacity_blocks - 1  # block 0 is vLLM's null block
        out = {}
        for request in self.requests.values():
            if request.is_finished():
                continue
            need = -(-(request.num_prompt_tokens + request.max_tokens) // self.block_size)
            if need > usable:
                out[request.request_id] = RequestError(
                    code="stage_lost", retryable=True,
                    message=f"the cluster lost a stage and its new plan holds {usable} KV blocks of "
                            f"{self.block_size} tokens; this request needs {need}: retry it with fewer "
                            "tokens (max_tokens), or once the cluster has its hosts back")
        return out

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
        # Whatever still runs (a rebalance's drain leaves nothing) starts over on the new stages.
        self.reset_prefix_cache(reset_running_requests=True)
        if view.capacity_blocks is not None and view.capacity_blocks < pool.num_gpu_blocks:
            self.fenced = pool.blocks[view.capacity_blocks:]
            for block in self.fenced:
                pool.free_block_queue.remove(block)
                block.ref_cnt += 1
        self.generation = view.generation
        self.last_outage = max(self.last_outage, view.outage_id)  # late outputs of that outage change nothing
        unfit = self._unfit(view.capacity_blocks)
        for req_id, error in unfit.items():
            self._end({req_id}, error)
        resumed = len(self.held)
        self.held = {}
        self._note_held(resumed=resumed)


class AsyncClusterScheduler(ClusterScheduler, AsyncScheduler):
    """ClusterScheduler over vLLM's AsyncScheduler: a running request's next token is scheduled
    while the step that samples it still runs (the stage fills it in on the device)."""
