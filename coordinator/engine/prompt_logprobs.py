"""Prompt logprobs arrive chunk by chunk (one per prefill chunk of a request that asks); vLLM takes
them whole, in the step that finishes the prompt (as its GPU runner gathers them)."""

from dataclasses import dataclass, field

import numpy as np

from metal_cluster.proto import pb


@dataclass
class _Partial:
    rows: int  # prompt length - 1: the last prompt position predicts the first output
    ids: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    ranks: np.ndarray | None = None


@dataclass
class PromptLogprobsCollector:
    partial: dict[str, _Partial] = field(default_factory=dict)

    def expect(self, req_id: str, num_prompt_tokens: int) -> None:
        self.partial[req_id] = _Partial(rows=max(num_prompt_tokens - 1, 0))

    def forget(self, req_id: str) -> None:
        self.partial.pop(req_id, None)

    def add(self, chunks) -> dict:
        """The stage's chunks of one step -> {req_id: LogprobsTensors} of the prompts they finish."""
        done = {}
        for chunk in chunks:
            part = self.partial.get(chunk.req_id)
            if part is None:
                continue  # reported already (a recomputation after preemption)
            self._store(part, chunk)
            if chunk.complete:
                del self.partial[chunk.req_id]
                # A one-token prompt scores nothing: vLLM's output already holds its None, and an
                # empty tensor would break the engine's output encoder (a zero stride).
                if part.rows:
                    done[chunk.req_id] = _tensors(part)
        return done

    @staticmethod
    def _store(part: _Partial, chunk: pb.PromptLogprobs) -> None:
        if part.ids is None:
            part.ids = np.zeros((part.rows, chunk.width), dtype=np.int32)
            part.logprobs = np.full((part.rows, chunk.width), -np.inf, dtype=np.float32)
            part.ranks = np.zeros(part.rows, dtype=np.int32)
        n = len(chunk.ranks)
        if not n:
            return
        rows = slice(chunk.start, chunk.start + n)
        part.ids[rows] = np.asarray(chunk.token_ids, dtype=np.int32).reshape(n, -1)
        part.logprobs[rows] = np.asarray(chunk.logprobs, dtype=np.float32).reshape(n, -1)
        part.ranks[rows] = chunk.ranks


def _tensors(part: _Partial):
    import torch
    from vllm.v1.outputs import LogprobsTensors

    return LogprobsTensors(torch.from_numpy(part.ids), torch.from_numpy(part.logprobs), torch.from_numpy(part.ranks))
