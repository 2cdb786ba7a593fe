"""A small stand-in for vLLM's scheduler, for driving a StageRunner in tests without vLLM.

It speaks the same StepRequest protocol the cluster executor will: it allocates block ids, chunks
prefills, ships the tokens sampled last step as new_token_ids, and can share prefix blocks and
preempt/resume requests, which is what the runner must honour.

With `ahead=True` it behaves like vLLM's async scheduler over a single stage: the stage keeps its
sampled tokens (`stage_keeps_tokens`), `step_fn` returns a function that answers the step, and each
`step()` launches the next step before it reads the previous one's answer, counting one
placeholder token for every request the step in flight samples.
"""

from dataclasses import dataclass, field

from metal_cluster.proto import PROTO_VERSION, pb


@dataclass
class Req:
    req_id: str
    prompt: list[int]
    max_tokens: int
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)  # sampled, not yet shipped to the stage
    sent: bool = False
    resumed: bool = False
    placeholders: int = 0  # sampled by the step in flight, not known yet (ahead mode)

    @property
    def history(self):
        return self.prompt + self.output

    @property
    def done(self):
        return len(self.output) >= self.max_tokens


class SchedulerDouble:
    def __init__(self, step_fn, num_blocks: int, block_size: int, chunk_size: int | None = None,
                 max_batch_tokens: int = 1 << 30, ahead: bool = False):
        self.step_fn = step_fn  # StepRequest -> dict[req_id, token] (ahead: -> () -> dict[req_id, token])
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block
        self.chunk_size = chunk_size
        self.max_batch_tokens = max_batch_tokens
        self.ahead = ahead
        self.in_flight = None  # ahead mode: (step, answer) launched, not read back yet
        self.reqs: dict[str, Req] = {}
        self.finished: list[str] = []
        self.step_id = 0

    def add(self, req_id, prompt, max_tokens, shared_blocks=(), num_computed=0):
        req = Req(req_id, list(prompt), max_tokens, block_ids=list(shared_blocks), num_computed=num_computed)
        self.reqs[req_id] = req
        return req

    def preempt(self, req_id):
        req = self.reqs[req_id]
        self.free.extend(req.block_ids)
        req.block_ids, req.num_computed, req.resumed = [], 0, True

    def step(self):
        """One step: (the step whose answer was read, its sampled tokens)."""
        step = self.schedule()
        if not self.ahead:
            sampled = self.step_fn(step)
            self.complete(step, sampled)
            return step, sampled
        launched = None
        if step.scheduled or step.finished_req_ids:
            launched = (step, self.step_fn(step))
        else:
            self.step_id -= 1  # never sent: a stage runs step ids strictly in order
        done, self.in_flight = self.in_flight, launched
        if done is None:
            return step, {}
        sampled = done[1]()
        self.complete(done[0], sampled)
        return done[0], sampled

    def schedule(self) -> pb.StepRequest:
        step = pb.StepRequest(version=PROTO_VERSION, step_id=self.step_id, stage_keeps_tokens=self.ahead)
        self.step_id += 1
        step.finished_req_ids.extend(self.finished)
        self.finished = []
        budget = self.max_batch_tokens
        for req in list(self.reqs.values()):
            if len(req.output) + req.placeholders >= req.max_tokens or budget == 0:
                continue
            known = len(req.prompt) + len(req.output) + req.placeholders  # no copy of the history per step
            n = min(known - req.num_computed, budget)
            if self.chunk_size:
                n = min(n, self.chunk_size)
            if n <= 0:
                continue
            new_blocks = self._allocate(req, req.num_computed + n)
            if not req.sent:
                step.new_requests.append(pb.NewRequest(
                    req_id=req.req_id, prompt_token_ids=req.history, block_ids=req.block_ids,
                    num_computed_tokens=req.num_computed))
                req.sent = True
                req.unsent = []
            elif req.resumed:
                step.cached_requests.append(pb.CachedRequest(
                    req_id=req.req_id, resumed=True, block_ids=req.block_ids,
                    num_computed_tokens=req.num_computed, all_token_ids=req.history))
                req.resumed = False
                req.unsent = []
            else:
                step.cached_requests.append(pb.CachedRequest(
                    req_id=req.req_id, block_ids=new_blocks, num_computed_tokens=req.num_computed,
                    new_token_ids=[] if self.ahead else req.unsent))
                req.unsent = []
            step.scheduled.append(pb.ScheduledTokens(req_id=req.req_id, num_tokens=n))
            budget -= n
            req.num_computed += n
            if self.ahead and req.num_computed == known:
                req.placeholders += 1
        return step

    def complete(self, step: pb.StepRequest, sampled: dict) -> None:
        for sched in step.scheduled:
            req = self.reqs[sched.req_id]
            if sched.req_id in sampled:
                req.placeholders = max(0, req.placeholders - 1)
                req.output.append(sampled[sched.req_id])
                req.unsent.append(sampled[sched.req_id])
                if req.done:
                    self.finished.append(req.req_id)
                    self.free.extend(b for b in req.block_ids if b not in self._shared())

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if all(r.done for r in self.reqs.values()) and self.in_flight is None:
                if self.finished:
                    self.step()  # schedules nothing: only tells the stage what finished
                    if self.in_flight is not None:
                        self.step()
                return {r.req_id: r.output for r in self.reqs.values()}
            self.step()
        raise AssertionError("requests did not finish")

    def _allocate(self, req, num_tokens):
        need = -(-num_tokens // self.block_size) - len(req.block_ids)
        new = [self.free.pop() for _ in range(max(0, need))]
        req.block_ids.extend(new)
        return new

    def _shared(self):
        live = [r for r in self.reqs.values() if not r.done]
        return {b for r in live for b in r.block_ids}
