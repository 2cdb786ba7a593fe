"""Run one step of one stage: apply the step to the request table, pack the batch, run this stage's
layers over it with paged attention, and either hand the hidden states on or sample tokens.

A stage that is both first and last may keep the tokens it samples (`stage_keeps_tokens`): greedy
tokens then stay on the device (`DeviceTokens`) and the next step embeds them from there, so the
host can build step n+1 while the device still runs step n; only token ids ever reach the host.
"""

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from metal_cluster.proto import pb
from metal_cluster.stage_worker.step.batch import StepBatch, build_batch
from metal_cluster.stage_worker.step.blas_threads import BlasThreads
from metal_cluster.stage_worker.step.tracing.decode_chain import DecodeChain
from metal_cluster.stage_worker.model import classifier
from metal_cluster.stage_worker.step.speculative.draft import DraftModel
from metal_cluster.stage_worker.step.speculative.mtp import MTPDrafter
from metal_cluster.stage_worker.step.lora import LoRABank
from metal_cluster.stage_worker.kv.paged_kv import KVPool
from metal_cluster.stage_worker.step.request_table import PENDING, RequestTable, RequestState, StepError
from metal_cluster.stage_worker.step.sampler import (
    Sampled, SampleRow, draw_key, gather_logprobs, log_softmax, needs_history, sample,
)
from metal_cluster.stage_worker.model.shard import ModelShard

# Decode steps run the layers' pure parts through mx.compile (`tracing/compiled.py`,
# `tracing/decode_chain.py`); 0 turns that off.
COMPILE = os.environ.get("METAL_CLUSTER_COMPILE", "1") != "0"


@dataclass
class DeviceTokens:
    """One step's greedy tokens while they are still being computed."""

    req_ids: list[str]
    tokens: mx.array  # [len(req_ids)] int32, being evaluated
    slots: list[tuple[list[int], int]]  # (a request's history, index of its PENDING entry)
    values: list[int] | None = None

    def resolve(self) -> list[int]:
        """Wait for the tokens and write them into the histories (the first call only)."""
        if self.values is None:
            self.values = self.tokens.tolist()
            for (history, i), token in zip(self.slots, self.values):
                if i < len(history) and history[i] == PENDING:
                    history[i] = token
        return self.values


@dataclass
class StageOutput:
    step_id: int
    hidden: mx.array | None = None  # [total_q, hidden] for the next stage (non-last stages), evaluated
    sampled: dict[str, Sampled] = field(default_factory=dict)  # last stage only: each request's last token
    # Speculative decoding: the drafts each request accepted, which come before its `sampled` token.
    accepted: dict[str, list[Sampled]] = field(default_factory=dict)
    on_device: DeviceTokens | None = None  # kept tokens not read back yet: `resolve` reads them
    prompt_logprobs: list = field(default_factory=list)  # pb.PromptLogprobs of this step's prompt chunks
    pooled: dict[str, np.ndarray] = field(default_factory=dict)  # pooling requests whose prompt ended
    spec_drafts: list = field(default_factory=list)  # pb.SpecDraftTokens: the drafter's next drafts
    # The last stage's layers' output (before the final norm) when it drafts: MTP layers read it.
    last_hidden: mx.array | None = None

    def resolve(self) -> "StageOutput":
        if self.on_device is not None:
            self.sampled = {r: Sampled(token_id=t) for r, t in zip(self.on_device.req_ids, self.on_device.resolve())}
            self.on_device = None
        return self


class StageRunner:
    def __init__(self, shard: ModelShard, pool: KVPool, draft: DraftModel | MTPDrafter | None = None):
        self.shard = shard
        self.pool = pool
        self.draft = draft  # speculative decoding's draft model or MTP layers (the last stage only)
        self.table = RequestTable(pool.num_blocks, pool.layout.windows, pool.block_size, pool.layout.recurrent)
        self.lora = LoRABank(shard.layers, shard.start, shard.dtype, shard.compile_switch)
        self.chain = DecodeChain(shard.layers, shard.compile_switch)  # decode steps' compiled path
        self.recurrent = any(pool.is_state)  # a recurrent layer's decode split steps one token a request
        self.blas = BlasThreads()  # on the CPU: OpenBLAS's threads per step's rows
        self.pace_submits = True  # see `_submit`; off only to measure what it saves
        self.pace_second_half = True  # see `_submit`; off only to measure what it saves
        self._marks: list[mx.array] = []  # the last step's middle and last KV writes (`_submit`)
        self.handed_at: float | None = None  # when the last step's work went to MLX (the host's phases)
        self.sample_while_layers_run = True  # see `_run`; off only to measure what it saves

    def step(self, step: pb.StepRequest, hidden_in: mx.array | None = None) -> StageOutput:
        """prepare + run, waited for."""
        return self.run(step, self.prepare(step), hidden_in).resolve()

    def prepare(self, step: pb.StepRequest) -> StepBatch:
        """Bookkeeping and checks: everything a stage does before it needs hidden states."""
        if step.stage_keeps_tokens and not (self.shard.is_first and self.shard.is_last):
            raise StepError("only a stage that runs the whole model can keep its sampled tokens")
        if self.shard.is_last and not self.shard.classifies and any(n.classify for n in step.new_requests):
            raise StepError(f"a request asks for vLLM's classify task, but the checkpoint has no classification "
                            f"head ({classifier.HEAD}.weight)")
        self.table.apply(step)
        self.pool.copy_blocks([(c.src, c.dst) for c in step.block_copies])
        if self.draft is not None:
            self.draft.pool.copy_blocks([(c.src, c.dst) for c in step.block_copies])
        batch = build_batch(self.table, step.scheduled, self.pool.block_size, self.recurrent)
        batch.lora_slots = self._lora_slots(batch)
        return batch

    def _lora_slots(self, batch: StepBatch) -> np.ndarray | None:
        lora_ids = [self.table[r].lora_id for r in batch.req_ids]
        if not any(lora_ids):
            return None
        slots = self.lora.slots_for(set(lora_ids))
        per_request = [slots.get(i, 0) for i in lora_ids]
        return np.repeat(np.array(per_request, dtype=np.int64), batch.num_tokens)

    def run(self, step: pb.StepRequest, batch: StepBatch, hidden_in: mx.array | None = None,
            inputs_ready: Callable[[], None] | None = None) -> StageOutput:
        """Run the step's work. A stage that keeps its tokens only queues it: `StageOutput.resolve`
        waits for the tokens; every other stage has finished it when this returns. With a draft
        model or MTP layers the step ends with their drafts, made from the tokens chosen (so waited
        for; MTP layers also read the layers' output). `inputs_ready`, where given, is called once
        the layers' graph is built and before any of it goes to the device: `hidden_in` may be a
        receive not yet done, which it waits for."""
        out = self._run(step, batch, hidden_in, inputs_ready)
        if self.draft is not None and batch.req_ids:
            out.resolve()
            gained = {r: [a.token_id for a in out.accepted.get(r, ())] + [s.token_id] for r, s in out.sampled.items()}
            out.spec_drafts = self.draft.follow(self.table, step, gained, batch, out.last_hidden, compiles=COMPILE)
        return out

    def _run(self, step: pb.StepRequest, batch: StepBatch, hidden_in: mx.array | None = None,
             inputs_ready: Callable[[], None] | None = None) -> StageOutput:
        out = StageOutput(step_id=step.step_id)
        if not batch.req_ids:
            return out
        self.blas.for_step(batch.token_ids.shape[0])
        hidden = self._forward(batch, hidden_in)
        if inputs_ready is not None:
            inputs_ready()
        for req_id, n in zip(batch.req_ids, batch.num_tokens):
            self.table.advance(req_id, n)
        if not step.stage_keeps_tokens:
            # A stage in a pipeline finishes its step's work before it answers: work still queued
            # in MLX's threads when the process re-executes itself for a new plan can take it down.
            # The last stage hands the layers over and builds its sampling while the device runs
            # them; the tokens it reads back wait for all of it.
            self.handed_at = time.perf_counter()
            if self.shard.is_last and self.sample_while_layers_run:
                mx.async_eval(hidden, self.pool.arrays)
            else:
                mx.eval(hidden, self.pool.arrays)
        if not self.shard.is_last:
            out.hidden = hidden
            return out
        if self.draft is not None:
            out.last_hidden = hidden
        out.prompt_logprobs = self._prompt_logprobs(batch, hidden)
        if any(self.table[r].pooling for r in batch.sample_req_ids):
            out.pooled = self._pool(batch, hidden)
        if not batch.sample_req_ids:
            if step.stage_keeps_tokens:
                self._submit(hidden)  # a prompt chunk that samples nothing still writes its KV
            else:
                mx.eval(hidden, self.pool.arrays)
            return out
        every_row = len(batch.sample_req_ids) == len(batch.req_ids) == hidden.shape[0]  # a decode step, no drafts
        logits = self.shard.logits(hidden if every_row else hidden[batch.logits_rows])
        if any(needs_history(self.table[r].sampling) for r in batch.sample_req_ids):
            self._read_back_kept()  # penalties and bad words look at the real token history
        if any(batch.drafts):
            return self._verify(step, batch, logits, out)
        rows = self._sample_rows(batch.sample_req_ids, _grammar_rows(step))
        chosen = sample(logits, rows)
        if chosen.logprobs is None:
            # Only token ids leave the device, and a stage that keeps its tokens does not even wait
            # for those: the next step embeds them from where they are.
            out.on_device = on_device = DeviceTokens(batch.sample_req_ids, chosen.tokens, [])
            if not step.stage_keeps_tokens:
                return out.resolve()
            self.handed_at = time.perf_counter()
            self._submit(chosen.tokens)
            for row, req_id in enumerate(batch.sample_req_ids):
                on_device.slots.append(self._keep(self.table[req_id], PENDING, (on_device, row)))
            return out
        out.sampled = dict(zip(batch.sample_req_ids, chosen.to_host(rows)))
        if step.stage_keeps_tokens:
            for req_id, s in out.sampled.items():
                self._keep(self.table[req_id], s.token_id)
        return out

    def _submit(self, out: mx.array) -> None:
        """Hand a step's work to the device in two halves, each once the last step is done with its layers.

        MLX keeps a queued kernel's inputs alive until its work is done, and a KV write into a
        pool still held that way cannot update it in place: it copies the layer's whole pool
        first. A host ahead of the device reaches layer L of this step before the device is done
        with layer L of the last one: 16 such copies a 4-bit step on the H200, 43 us each at 2377
        blocks (bench/README.md); a Mac's pool of many GB would copy gigabytes a step. Waiting
        for the whole last step instead left the device idle while MLX took the next one in
        (1-1.5 ms a step). So the host hands this step over in two halves: its first half once
        the last step's middle KV write is done (the device still has the last step's second half
        to run), the rest once the last step's last KV write is done (the device still has the
        last step's head and this step's first half). A host that is quicker a layer than the
        device then never reaches a layer the device has not finished; a slower one never waits."""
        if self.pace_submits:
            keys = self.pool.keys
            marks = sorted({len(keys) // 2, len(keys) - 1}) if self.pace_second_half else [len(keys) // 2]
            last, self._marks = self._marks, []
            for i, a in enumerate(marks):
                if i < len(last):
                    # Waited for, then dropped before the part that writes its pool is queued: a
                    # reference held here would itself keep that pool from being updated in place.
                    mx.eval(last[i])  # queued already: this waits for it, and queues nothing
                    last[i] = None
                mx.async_eval(keys[a])
            self._marks = [keys[a] for a in marks]
        mx.async_eval(out)

    def _pool(self, batch: StepBatch, hidden: mx.array) -> dict[str, np.ndarray]:
        """vLLM's pooling runner: the final-norm hidden states of each pooling request whose prompt
        ends this step, pooled (LAST, MEAN, CLS), and for a classify request the classification
        head's logits over that; those requests sample nothing, so they leave the batch's sampling rows."""
        norm = self.shard.family.inner(self.shard.model).norm
        starts = np.cumsum([0, *batch.num_tokens]).tolist()
        row_of = {r: i for i, r in enumerate(batch.req_ids)}
        pooled, keep = {}, []
        for k, req_id in enumerate(batch.sample_req_ids):
            state = self.table[req_id]
            if not state.pooling:
                keep.append(k)
                continue
            i = row_of[req_id]
            first, end = starts[i], starts[i + 1]
            if state.pooling == "LAST":
                rows = hidden[end - 1 : end]
            elif state.num_computed_tokens != end - first:  # advanced already: the chunk must be the prompt
                raise StepError(f"request {req_id!r}: {state.pooling} pooling needs its whole prompt in one step")
            else:
                rows = hidden[first : first + 1] if state.pooling == "CLS" else hidden[first:end]
            pooled[req_id] = mx.mean(norm(rows).astype(mx.float32), axis=0)
            if state.classify:
                pooled[req_id] = classifier.classify(self.shard.model, pooled[req_id])
        mx.eval(list(pooled.values()))
        batch.sample_req_ids = [batch.sample_req_ids[k] for k in keep]
        batch.logits_rows = batch.logits_rows[mx.array(keep, dtype=mx.int32)] if keep else batch.logits_rows[:0]
        return {r: np.array(v) for r, v in pooled.items()}

    def _prompt_logprobs(self, batch: StepBatch, hidden: mx.array) -> list[pb.PromptLogprobs]:
        """vLLM's prompt logprobs, chunk by chunk: the logits of every prompt position, but only
        for the requests that ask."""
        if not batch.prompt_rows:
            return []
        positions = [p.first_row + i for p in batch.prompt_rows for i in range(len(p.targets))]
        targets = [t for p in batch.prompt_rows for t in p.targets]
        vocab = 0  # -1 asks for the whole vocabulary; with no rows this chunk, no width is needed
        if positions:
            logprobs = log_softmax(self.shard.logits(hidden[mx.array(positions)]).astype(mx.float32))
            vocab = logprobs.shape[-1]
            widest = max(vocab if p.num_logprobs < 0 else p.num_logprobs for p in batch.prompt_rows)
            scored = gather_logprobs(logprobs, mx.array(targets, dtype=mx.int32), widest)
            ids, lps, ranks = (np.array(a) for a in scored.arrays())
        out, row = [], 0
        for p in batch.prompt_rows:
            width = 1 + (vocab if p.num_logprobs < 0 else p.num_logprobs)
            n = len(p.targets)
            msg = pb.PromptLogprobs(req_id=p.req_id, start=p.start, width=width, complete=p.complete)
            if n:
                msg.token_ids.extend(ids[row:row + n, :width].ravel().tolist())
                msg.logprobs.extend(lps[row:row + n, :width].ravel().tolist())
                msg.ranks.extend(ranks[row:row + n].tolist())
            row += n
            if p.complete:
                self.table[p.req_id].prompt_logprobs_done = True
            out.append(msg)
        return out

    def _verify(self, step: pb.StepRequest, batch: StepBatch, logits: mx.array, out: StageOutput) -> StageOutput:
        """Speculative decoding: one row per scored position; a request keeps its drafts while each
        row's token is the draft it scores, then the first row's token that is not (or the bonus)."""
        self._read_back_kept()  # verification happens on the host, so nothing stays on the device
        rows = self._sample_rows(batch.sample_req_ids, _grammar_rows(step), batch.drafts)
        tokens = iter(sample(logits, rows).to_host(rows))
        for req_id, drafts in zip(batch.sample_req_ids, batch.drafts):
            scored = [next(tokens) for _ in range(1 + len(drafts))]
            n = 0
            while n < len(drafts) and scored[n].token_id == drafts[n]:
                n += 1
            out.accepted[req_id], out.sampled[req_id] = scored[:n], scored[n]
            if step.stage_keeps_tokens:
                for s in scored[: n + 1]:
                    self._keep(self.table[req_id], s.token_id)
        return out

    @staticmethod
    def _keep(state: RequestState, token: int, where=None) -> tuple[list[int], int]:
        state.token_ids.append(token)
        index = len(state.token_ids) - 1
        if where is not None:
            state.on_device = {i: w for i, w in state.on_device.items() if w[0].values is None}
            state.on_device[index] = where
        return state.token_ids, index

    def _read_back_kept(self) -> None:
        for state in self.table.requests.values():
            for on_device, _ in state.on_device.values():
                on_device.resolve()
            state.on_device.clear()

    def _token_ids(self, batch: StepBatch) -> mx.array:
        """The batch's token ids, with the kept tokens of earlier steps gathered on the device."""
        if not batch.pending:
            return batch.token_ids
        by_source: dict[int, tuple[DeviceTokens, list[int], list[int]]] = {}
        for position, req_id, index in batch.pending:
            source = self.table[req_id].on_device.get(index)
            if source is None:
                raise StepError(f"request {req_id!r}: token {index} was never sampled by this stage")
            on_device, row = source
            entry = by_source.setdefault(id(on_device), (on_device, [], []))
            entry[1].append(position)
            entry[2].append(row)
        if len(by_source) == 1:
            on_device, positions, rows = next(iter(by_source.values()))
            n = batch.token_ids.shape[0]
            if positions == rows == list(range(n)) and on_device.tokens.shape[0] == n:
                return on_device.tokens  # all of last step's tokens, in their order: nothing to scatter
        token_ids = batch.token_ids
        for on_device, positions, rows in by_source.values():
            token_ids[mx.array(positions)] = on_device.tokens[mx.array(rows)]
        return token_ids

    def _sample_rows(self, req_ids: list[str], grammar: dict[str, np.ndarray],
                     drafts: list[list[int]] | None = None) -> list[SampleRow]:
        """One row per scored position: a request with k drafts gets k + 1, row j as if its first j
        drafts were accepted (its output so far, its grammar row, its draw)."""
        rows = []
        for req_id, draft in zip(req_ids, drafts or [[]] * len(req_ids)):
            state = self.table[req_id]
            num_outputs = len(state.token_ids) - state.num_prompt_tokens
            masks = grammar.get(req_id)
            for j in range(len(draft) + 1):
                row = SampleRow(params=state.sampling, num_outputs=num_outputs + j,
                                draw=draw_key(state.sampling, num_outputs + j, state.rng),
                                allowed_mask=None if masks is None else masks[j],
                                draft=draft[j] if j < len(draft) else -1)
                if needs_history(state.sampling):
                    row.prompt_ids = tuple(state.token_ids[: state.num_prompt_tokens])
                    row.output_ids = (*state.output_ids, *draft[:j])
                rows.append(row)
        return rows

    def _forward(self, batch: StepBatch, hidden_in: mx.array | None) -> mx.array:
        if self.shard.is_first:
            h = self.shard.embed(self._token_ids(batch))
        else:
            if hidden_in is None or hidden_in.shape[0] != batch.token_ids.shape[0]:
                got = None if hidden_in is None else hidden_in.shape[0]
                raise StepError(f"step {batch.req_ids[:1]}: expected hidden states for {batch.token_ids.shape[0]} tokens, got {got}")
            h = hidden_in
        h = h.reshape(1, *h.shape)  # one packed row (a reshape is one node; h[None] and h[0] two)
        self.lora.activate(batch.lora_slots)  # read by the adapted modules while the graph is built
        # Verification steps (1 + k tokens a request) recur too, where no layer is recurrent.
        recurs = batch.is_decode or (not self.recurrent and batch.is_verification)
        try:
            h = self.chain.run(h, batch, self.pool, COMPILE and recurs, self.lora.step_inputs())
        finally:
            self.lora.activate(None)
        return h.reshape(h.shape[1:])


def _grammar_rows(step: pb.StepRequest) -> dict[str, np.ndarray]:
    """Per structured request its bitmask rows [rows per request, words]: row j masks the token
    after j drafts (one row without speculative decoding)."""
    if not step.grammar_req_ids:
        return {}
    per_request = max(step.grammar_rows_per_request, 1)
    mask = np.frombuffer(step.grammar_bitmask, dtype=np.int32).reshape(len(step.grammar_req_ids), per_request, -1)
    return dict(zip(step.grammar_req_ids, mask))


def to_response(out: StageOutput) -> pb.StepResponse:
    response = pb.StepResponse(step_id=out.step_id)
    for req_id, s in _in_order(out):
        token = pb.SampledToken(req_id=req_id, token_id=s.token_id, logprob=s.logprob, rank=s.rank)
        if s.top_ids is not None:
            token.top.SetInParent()  # logprobs were asked for, even with no top-k alternatives
            token.top.token_ids.extend(s.top_ids)
            token.top.logprobs.extend(s.top_logprobs)
        response.sampled.append(token)
    response.prompt_logprobs.extend(out.prompt_logprobs)
    for req_id, vector in out.pooled.items():
        response.pooled.add(req_id=req_id, data=vector.tolist())
    response.spec_drafts.extend(out.spec_drafts)
    return response


def _in_order(out: StageOutput):
    """(request, token) pairs as they go on the wire: a request's accepted drafts, then its last token."""
    for req_id, s in out.sampled.items():
        for accepted in out.accepted.get(req_id, ()):
            yield req_id, accepted
        yield req_id, s
