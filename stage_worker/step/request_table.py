"""What a stage knows about each running request, kept in step with vLLM's scheduler.

Every stage applies the same StepRequest, so every stage holds the same table: token history (stage 0
embeds from it, the last stage penalises with it), block table, and how many tokens are in KV.
"""

from dataclasses import dataclass, field

import numpy as np

from metal_cluster.proto import pb


# A history entry whose token was sampled by this stage but is still on the device (see runner.py).
PENDING = -1


class StepError(ValueError):
    """A StepRequest this stage cannot apply; the message names the request and the problem."""


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_tables: list[list[int]]  # one per KV cache group (one for most models)
    num_computed_tokens: int
    sampling: pb.SamplingParams = field(default_factory=pb.SamplingParams)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    # history index -> (the step's device tokens, row): where a PENDING entry's token is
    on_device: dict = field(default_factory=dict)
    # per KV cache group: the leading blocks dropped as behind a sliding window
    forgotten: list[int] = field(default_factory=list)
    prompt_logprobs_done: bool = False  # reported once: a recomputation after preemption does not redo them
    lora_id: int = 0  # the LoRA adapter it runs with (0: the base model)
    pooling: str = ""  # a pooling request's pooling type (LAST, MEAN, CLS); empty: it generates
    classify: bool = False  # a pooling request of vLLM's classify task: the classification head's logits
    # A draft model's KV (speculative/draft.py): positions it holds for this history, then the tokens it wrote
    # at the positions after those (its own drafts), valid while the history agrees with them.
    draft_kv: int = 0
    draft_written: list[int] = field(default_factory=list)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def group_tables(msg) -> list[list[int]]:
    """A NewRequest's or CachedRequest's block ids per KV cache group."""
    return [list(msg.block_ids), *(list(g.ids) for g in msg.group_block_ids)]


class RequestTable:
    def __init__(self, num_blocks: int, windows: tuple[int | None, ...] = (None,), block_size: int = 0,
                 recurrent: tuple[bool, ...] | None = None):
        """windows: per KV cache group, its layers' sliding window (None: full attention);
        recurrent: per group, whether its layers keep a state per block instead of K/V."""
        self.num_blocks = num_blocks
        self.windows = windows
        self.recurrent = recurrent or (False,) * len(windows)
        self.block_size = block_size
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
                block_tables=group_tables(new),
                forgotten=[0] * self.num_groups,
                num_computed_tokens=new.num_computed_tokens,
                sampling=new.sampling,
                lora_id=new.lora_id,
                pooling=new.pooling,
                classify=new.classify,
                draft_kv=new.num_computed_tokens,  # a prefix-cache hit: the draft wrote those blocks too
                # A seeded request's draws are keyed by seed and position (sampler.draw_key), so one
                # resumed on a new plan with its outputs draws what it would have.
                rng=np.random.default_rng(new.sampling.seed if new.sampling.HasField("seed") else None),
            )
        for cached in step.cached_requests:
            self._update(cached)
        if any(self.windows):
            for sched in step.scheduled:
                self._forget_behind_window(self.requests[sched.req_id])

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def _forget_behind_window(self, state: RequestState) -> None:
        """What vLLM's sliding-window manager frees: blocks no query from here on can see. It
        tells no one, and may hand them to another request; the table drops them too, so that
        blocks_in_use counts what the stage really holds."""
        for g, (table, window) in enumerate(zip(state.block_tables, self.windows)):
            if window:
                behind = min(len(table), max(0, state.num_computed_tokens - window + 1) // self.block_size)
                table[state.forgotten[g] : behind] = [0] * max(0, behind - state.forgotten[g])
                state.forgotten[g] = max(state.forgotten[g], behind)

    def blocks_in_use(self) -> int:
        """Distinct KV blocks the running requests hold (shared prefix blocks count once)."""
        # Called from health checks while a step may be changing the table: retry a torn read.
        for _ in range(3):
            try:
                return len({b for r in list(self.requests.values()) for t in r.block_tables for b in t if b != 0})
            except RuntimeError:
                continue
        return 0

    def advance(self, req_id: str, num_tokens: int) -> None:
        self.requests[req_id].num_computed_tokens += num_tokens

    def _update(self, cached: pb.CachedRequest) -> None:
        state = self.requests[cached.req_id]
        tables = group_tables(cached)
        if cached.resumed:
            # Preempted and back: its blocks were freed, so the block tables start over.
            state.block_tables = tables
            state.forgotten = [0] * self.num_groups
        else:
            for table, added in zip(state.block_tables, tables):
                table.extend(added)
        if cached.all_token_ids:  # the scheduler resynchronises the whole history
            state.token_ids = list(cached.all_token_ids)
            state.on_device = {}
        state.token_ids.extend(cached.new_token_ids)
        state.num_computed_tokens = cached.num_computed_tokens
        if cached.resumed or cached.all_token_ids:  # new blocks, or a history the draft never saw
            state.draft_kv, state.draft_written = cached.num_computed_tokens, []

    def _validate(self, step: pb.StepRequest) -> None:
        finished = set(step.finished_req_ids)
        known = set(self.requests) - finished
        for new in step.new_requests:
            if not new.prompt_token_ids:
                raise StepError(f"request {new.req_id!r} has an empty prompt")
            self._check_groups(new.req_id, new, required=True)
            known.add(new.req_id)
        for cached in step.cached_requests:
            if cached.req_id not in known:
                self[cached.req_id]
            self._check_groups(cached.req_id, cached, required=cached.resumed)
        for sched in step.scheduled:
            if sched.req_id not in known:
                raise StepError(f"unknown request {sched.req_id!r} scheduled: it was never sent as a new request or is finished")
            if sched.num_tokens < 0:
                raise StepError(f"request {sched.req_id!r}: negative num_tokens {sched.num_tokens}")
        for copy in step.block_copies:
            self._check_blocks("block copy", [copy.src, copy.dst])

    def _check_groups(self, req_id: str, msg, required: bool) -> None:
        """One block table per KV cache group (a cached request may leave all of them out)."""
        tables = group_tables(msg)
        given = len(tables) if (msg.group_block_ids or required) else self.num_groups
        if given != self.num_groups:
            raise StepError(f"request {req_id!r}: {given} block tables for a stage with {self.num_groups} "
                            "KV cache group(s)")
        for table in tables:
            self._check_blocks(req_id, table)

    def _check_blocks(self, req_id: str, block_ids) -> None:
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise StepError(f"request {req_id!r}: block id {b} out of range [0, {self.num_blocks})")
