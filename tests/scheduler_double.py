"""A small stand-in for vLLM's scheduler, for driving a StageRunner in tests without vLLM.

It speaks the same StepRequest protocol the cluster executor will: it allocates block ids, chunks
prefills, ships the tokens sampled last step as new_token_ids, and can share prefix blocks and
preempt/resume requests, which is what the runner must honour.
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

    @property
    def history(self):
        return self.prompt + self.output

    @property
    def done(self):
        return len(self.output) >= self.max_tokens


class SchedulerDouble:
    def __init__(self, step_fn, num_blocks: int, block_size: int, chunk_size: int | None = None, max_batch_tokens: int = 1 << 30):
        self.step_fn = step_fn  # StepRequest -> dict[req_id, token]
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block
        self.chunk_size = chunk_size
        self.max_batch_tokens = max_batch_tokens
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
        step = pb.StepRequest(version=PROTO_VERSION, step_id=self.step_id)
        self.step_id += 1
        step.finished_req_ids.extend(self.finished)
        self.finished = []
        budget = self.max_batch_tokens
        for req in list(self.reqs.values()):
            if req.done or budget == 0:
                continue
            n = min(len(req.history) - req.num_computed, budget)
            if self.chunk_size:
                n = min(n, self.chunk_size)
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
                    new_token_ids=req.unsent))
                req.unsent = []
            step.scheduled.append(pb.ScheduledTokens(req_id=req.req_id, num_tokens=n))
            budget -= n
        sampled = self.step_fn(step)
        for sched in step.scheduled:
            req = self.reqs[sched.req_id]
            req.num_computed += sched.num_tokens
            if sched.req_id in sampled:
                req.output.append(sampled[sched.req_id])
                req.unsent.append(sampled[sched.req_id])
                if req.done:
                    self.finished.append(req.req_id)
                    self.free.extend(b for b in req.block_ids if b not in self._shared())
        return step, sampled

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if all(r.done for r in self.reqs.values()):
                if self.finished:
                    self.step()  # schedules nothing: only tells the stage what finished
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

