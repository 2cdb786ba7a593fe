"""What a stage knows about each running request, kept in step with vLLM's scheduler.

Every stage applies the same StepRequest, so every stage holds the same table: token history (stage 0
embeds from it, the last stage penalises with it), block table, and how many tokens are in KV.
"""

from dataclasses import dataclass, field

import numpy as np

from metal_cluster.proto import pb
from metal_cluster.stage_worker.sampler import GREEDY_EPS


# A history entry whose token was sampled by this stage but is still on the device (see runner.py).
PENDING = -1


class StepError(ValueError):
    """A StepRequest this stage cannot apply; the message names the request and the problem."""


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: pb.SamplingParams = field(default_factory=pb.SamplingParams)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    # history index -> (the step's device tokens, row): where a PENDING entry's token is
    on_device: dict = field(default_factory=dict)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def _rng(new: pb.NewRequest) -> np.random.Generator:
    """A seeded request draws the same tokens wherever and whenever it runs. One resumed on a new
    plan replays the draws of the tokens it had produced: a sampled token costs one uniform draw
    (sampler._draw), a greedy one none."""
    sampling = new.sampling
    rng = np.random.default_rng(sampling.seed if sampling.HasField("seed") else None)
    if sampling.HasField("seed") and sampling.temperature >= GREEDY_EPS and new.output_token_ids:
        rng.random(len(new.output_token_ids))
    return rng


class RequestTable:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.requests: dict[str, RequestState] = {}

    def __len__(self):
        return len(self.requests)

    def __getitem__(self, req_id: str) -> RequestState:
        try:
            return self.requests[req_id]
        except KeyError:
            raise StepError(f"unknown request {req_id!r}: it was never sent as a new request or is finished") from None

    def apply(self, step: pb.StepRequest) -> None:
        """Apply a step's bookkeeping (not its compute). Checks everything before changing anything."""
        self._validate(step)
        for req_id in step.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in step.new_requests:
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=[*new.prompt_token_ids, *new.output_token_ids],
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=new.sampling,
                rng=_rng(new),
            )
        for cached in step.cached_requests:
            self._update(cached)

    def blocks_in_use(self) -> int:
        """Distinct KV blocks the running requests hold (shared prefix blocks count once)."""
        # Called from health checks while a step may be changing the table: retry a torn read.
        for _ in range(3):
            try:
                return len({b for r in list(self.requests.values()) for b in r.block_ids if b != 0})
            except RuntimeError:
                continue
        return 0

    def advance(self, req_id: str, num_tokens: int) -> None:
        self.requests[req_id].num_computed_tokens += num_tokens

    def _update(self, cached: pb.CachedRequest) -> None:
        state = self.requests[cached.req_id]
        if cached.resumed:
            # Preempted and back: its blocks were freed, so the block table starts over.
            state.block_ids = list(cached.block_ids)
        else:
            state.block_ids.extend(cached.block_ids)
        if cached.all_token_ids:  # the scheduler resynchronises the whole history
            state.token_ids = list(cached.all_token_ids)
            state.on_device = {}
        state.token_ids.extend(cached.new_token_ids)
        state.num_computed_tokens = cached.num_computed_tokens

    def _validate(self, step: pb.StepRequest) -> None:
        finished = set(step.finished_req_ids)
        known = set(self.requests) - finished
        for new in step.new_requests:
            if not new.prompt_token_ids:
                raise StepError(f"request {new.req_id!r} has an empty prompt")
            self._check_blocks(new.req_id, new.block_ids)
            known.add(new.req_id)
        for cached in step.cached_requests:
            if cached.req_id not in known:
                self[cached.req_id]
            self._check_blocks(cached.req_id, cached.block_ids)
        for sched in step.scheduled:
            if sched.req_id not in known:
                raise StepError(f"unknown request {sched.req_id!r} scheduled: it was never sent as a new request or is finished")
            if sched.num_tokens < 0:
                raise StepError(f"request {sched.req_id!r}: negative num_tokens {sched.num_tokens}")
        for copy in step.block_copies:
            self._check_blocks("block copy", [copy.src, copy.dst])

    def _check_blocks(self, req_id: str, block_ids) -> None:
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise StepError(f"request {req_id!r}: block id {b} out of range [0, {self.num_blocks})")
