"""Token choice on the last stage, per request, in vLLM's order: grammar mask, raw logprobs,
penalties, then greedy or temperature / min-p / top-k / top-p sampling.

Rows are few (one per request finishing its known tokens) and the vocabulary is small, so this works
on NumPy copies of the logits; the heavy part, the lm_head matmul, already ran in MLX.
"""

from dataclasses import dataclass

import numpy as np

from metal_cluster.proto import pb

GREEDY_EPS = 1e-5


@dataclass
class SampleRow:
    params: pb.SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    rng: np.random.Generator
    allowed_mask: np.ndarray | None = None  # packed int32 grammar bitmask row


@dataclass
class Sampled:
    token_id: int
    logprob: float = 0.0
    rank: int = 0
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


def plain_greedy(row: SampleRow) -> bool:
    """Greedy with nothing that needs the whole logits row on the host (no grammar mask, logprobs or
    penalties): the argmax can run where the logits are, and only token ids cross to the host."""
    p = row.params
    return (p.temperature < GREEDY_EPS and row.allowed_mask is None and not p.HasField("logprobs")
            and p.repetition_penalty in (0.0, 1.0) and not p.frequency_penalty and not p.presence_penalty)


def sample_rows(logits: np.ndarray, rows: list[SampleRow]) -> list[Sampled]:
    return [_sample_one(logits[i].astype(np.float32, copy=True), row) for i, row in enumerate(rows)]


def _sample_one(logits: np.ndarray, row: SampleRow) -> Sampled:
    p = row.params
    if row.allowed_mask is not None:
        logits = _apply_bitmask(logits, row.allowed_mask)
    logprobs = _log_softmax(logits) if p.HasField("logprobs") else None
    logits = _apply_penalties(logits, p, row.prompt_ids, row.output_ids)
    if p.temperature < GREEDY_EPS:
        token = int(np.argmax(logits))
    else:
        token = _draw(logits / p.temperature, p, row.rng)
    return _with_logprobs(token, logprobs, p.logprobs)


def _apply_bitmask(logits, mask_row):
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[: logits.shape[0]]
    return np.where(bits.astype(bool), logits, -np.inf).astype(np.float32)


def _log_softmax(x):
    m = np.max(x)
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted)))


def _apply_penalties(logits, p, prompt_ids, output_ids):
    if p.repetition_penalty not in (0.0, 1.0):
        seen = np.unique(np.array(prompt_ids + output_ids, dtype=np.int64))
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and output_ids:
        counts = np.bincount(np.array(output_ids, dtype=np.int64), minlength=logits.shape[0])[: logits.shape[0]]
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


def _draw(logits, p, rng):
    probs = np.exp(logits - np.max(logits))
    probs /= probs.sum()
    if p.min_p > 0:
        probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
    if p.top_k > 0 and p.top_k < probs.shape[0]:
        kth = np.partition(probs, -p.top_k)[-p.top_k]
        probs = np.where(probs < kth, 0.0, probs)
    if 0 < p.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order]) / probs.sum()
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        cut = np.searchsorted(cumulative, p.top_p) + 1
        keep = np.zeros_like(probs, dtype=bool)
        keep[order[:cut]] = True
        probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    return int(rng.choice(probs.shape[0], p=probs))


def _with_logprobs(token, logprobs, k):
    if logprobs is None:
        return Sampled(token_id=token)
    chosen = float(logprobs[token])
    rank = int(np.sum(logprobs >= chosen))  # 1-based, ties count against the token (as vLLM)
    if k <= 0:
        return Sampled(token, chosen, rank, [], [])
    top = np.argsort(-logprobs, kind="stable")[:k]
    return Sampled(token, chosen, rank, [int(t) for t in top], [float(logprobs[t]) for t in top])
