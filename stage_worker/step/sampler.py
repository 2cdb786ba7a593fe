"""Token choice on the last stage, in vLLM's order (vllm/v1/sample/sampler.py): grammar mask, raw
logprobs, allowed token ids, bad words, min_tokens, logit bias, penalties, then greedy or
temperature / min-p / top-k / top-p sampling.

Everything runs in MLX on the device, one op per step for the whole batch: the host only builds small
index arrays (which tokens a request bans or biases) and reads back token ids and the logprobs a
request asked for. A stage that keeps its tokens can leave them on the device altogether.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from metal_cluster.proto import pb

GREEDY_EPS = 1e-5
_GOLDEN = 0x9E3779B97F4A7C15  # spreads (seed, position) over 64 bits for the draw's key
_MASK64 = (1 << 64) - 1


@dataclass
class SampleRow:
    params: pb.SamplingParams
    num_outputs: int  # tokens the request has generated so far
    draw: int  # 64-bit key of this row's random draw (seeded requests: fixed by seed and position)
    allowed_mask: np.ndarray | None = None  # packed int32 grammar bitmask row
    # The token history, only where `needs_history` (copying it every step costs the host time).
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    # Speculative decoding: the draft token this row verifies (-1: none). A sampled row then keeps
    # the draft with probability p(draft), else draws from p without it (vLLM's rejection rule for
    # drafts of probability 1), so the token still follows p; a greedy row takes the argmax as ever.
    draft: int = -1


@dataclass
class Sampled:
    token_id: int
    logprob: float = 0.0
    rank: int = 0
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


@dataclass
class DeviceSample:
    """One step's choice, still on the device: `tokens` [rows]; the logprob arrays only when asked."""

    tokens: mx.array
    logprobs: "DeviceLogprobs | None" = None

    def to_host(self, rows: list[SampleRow]) -> list[Sampled]:
        tokens = self.tokens.tolist()
        if self.logprobs is None:
            return [Sampled(t) for t in tokens]
        ids, lps, ranks = (np.array(a) for a in self.logprobs.arrays())
        out = []
        for i, (row, token) in enumerate(zip(rows, tokens)):
            p = row.params
            if not wants_logprobs(p):
                out.append(Sampled(token))
                continue
            n = len(p.logprob_token_ids) if p.logprob_token_ids else _width(p.logprobs, lps.shape[1] - 1)
            out.append(Sampled(token, float(lps[i, 0]), int(ranks[i]), ids[i, 1:1 + n].tolist(),
                               lps[i, 1:1 + n].tolist()))
        return out


@dataclass
class DeviceLogprobs:
    """[rows, 1 + k]: the scored token first, then the top k (or the named ids); its rank."""

    token_ids: mx.array
    logprobs: mx.array
    ranks: mx.array

    def arrays(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.token_ids, self.logprobs, self.ranks


def wants_logprobs(p: pb.SamplingParams) -> bool:
    return p.HasField("logprobs") or bool(p.logprob_token_ids)


def needs_history(p: pb.SamplingParams) -> bool:
    """The row needs the real token history on the host (not just its length)."""
    return bool(p.bad_words) or _has_penalties(p)


def draw_key(p: pb.SamplingParams, num_outputs: int, rng: np.random.Generator) -> int:
    """A seeded request draws the same tokens wherever and whenever it runs: its key depends only on
    the seed and how many tokens it has already."""
    if p.HasField("seed"):
        return ((p.seed & _MASK64) * _GOLDEN + num_outputs) & _MASK64
    return int(rng.integers(0, 2**63))


def sample(logits: mx.array, rows: list[SampleRow]) -> DeviceSample:
    """logits [rows, vocab] (any dtype) -> the chosen tokens, lazily on the device."""
    logits = logits.astype(mx.float32)
    if any(r.allowed_mask is not None for r in rows):
        logits = _apply_bitmask(logits, rows)
    raw = log_softmax(logits) if any(wants_logprobs(r.params) for r in rows) else None
    logits = _apply_processors(logits, rows)
    logits = _apply_penalties(logits, rows)
    tokens = _choose(logits, rows)
    if raw is None:
        return DeviceSample(tokens)
    return DeviceSample(tokens, _sample_logprobs(raw, tokens, rows))


def log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def gather_logprobs(logprobs: mx.array, token_ids: mx.array, k: int) -> DeviceLogprobs:
    """vLLM's gather_logprobs: each row's scored token, its rank (1-based, ties against it) and the
    top k, best first."""
    chosen = mx.take_along_axis(logprobs, token_ids[:, None], axis=-1)
    ranks = (logprobs >= chosen).sum(axis=-1).astype(mx.int32)
    ids, values = token_ids[:, None], chosen
    if k > 0:
        top = _top_k_ids(logprobs, k)
        ids = mx.concatenate([ids, top], axis=-1)
        values = mx.concatenate([values, mx.take_along_axis(logprobs, top, axis=-1)], axis=-1)
    return DeviceLogprobs(ids.astype(mx.int32), values, ranks)


def _width(k: int, vocab: int) -> int:
    return vocab if k < 0 else k


def _top_k_ids(logprobs: mx.array, k: int) -> mx.array:
    vocab = logprobs.shape[-1]
    k = min(k, vocab)
    if k == vocab:
        return mx.argsort(-logprobs, axis=-1)
    part = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    order = mx.argsort(-mx.take_along_axis(logprobs, part, axis=-1), axis=-1)
    return mx.take_along_axis(part, order, axis=-1)


def _sample_logprobs(raw: mx.array, tokens: mx.array, rows: list[SampleRow]) -> DeviceLogprobs:
    vocab = raw.shape[-1]
    named = [list(r.params.logprob_token_ids) for r in rows]
    k = max([_width(r.params.logprobs, vocab) for r, n in zip(rows, named)
             if r.params.HasField("logprobs") and not n] or [0])
    out = gather_logprobs(raw, tokens, k)
    width = max(len(n) for n in named)
    if not width:
        return out
    # Rows that name their ids get those (vLLM's logprob_token_ids); -inf pads the shorter lists.
    ids = np.zeros((len(rows), width), dtype=np.int32)
    valid = np.zeros((len(rows), width), dtype=bool)
    for i, n in enumerate(named):
        ids[i, : len(n)], valid[i, : len(n)] = n, True
    ids = mx.array(ids)
    values = mx.where(mx.array(valid), mx.take_along_axis(raw, ids, axis=-1), -mx.inf)
    has = mx.array(np.array([bool(n) for n in named]))[:, None]
    pad = max(0, width - k)
    top_ids = mx.pad(out.token_ids[:, 1:], [(0, 0), (0, pad)])
    top_values = mx.pad(out.logprobs[:, 1:], [(0, 0), (0, pad)], constant_values=-mx.inf)
    if k > width:
        ids = mx.pad(ids, [(0, 0), (0, k - width)])
        values = mx.pad(values, [(0, 0), (0, k - width)], constant_values=-mx.inf)
    token_ids = mx.concatenate([out.token_ids[:, :1], mx.where(has, ids, top_ids)], axis=-1)
    logprobs = mx.concatenate([out.logprobs[:, :1], mx.where(has, values, top_values)], axis=-1)
    return DeviceLogprobs(token_ids, logprobs, out.ranks)


def _apply_bitmask(logits: mx.array, rows: list[SampleRow]) -> mx.array:
    vocab = logits.shape[-1]
    words = next(r.allowed_mask for r in rows if r.allowed_mask is not None).shape[0]
    packed = np.full((len(rows), words), -1, dtype=np.int32)  # all bits set: no constraint
    for i, r in enumerate(rows):
        if r.allowed_mask is not None:
            packed[i] = r.allowed_mask
    shifts = mx.arange(32, dtype=mx.uint32)
    bits = (mx.array(packed.view(np.uint32))[:, :, None] >> shifts) & 1
    allowed = bits.reshape(len(rows), -1)[:, :vocab].astype(mx.bool_)
    return mx.where(allowed, logits, -mx.inf)


def _apply_processors(logits: mx.array, rows: list[SampleRow]) -> mx.array:
    rows_allowed = [(i, t) for i, r in enumerate(rows) for t in r.params.allowed_token_ids]
    if rows_allowed:
        limited = [i for i, r in enumerate(rows) if r.params.allowed_token_ids]
        logits = mx.where(_mask(logits.shape, rows_allowed) | ~_row_mask(len(rows), limited)[:, None],
                          logits, -mx.inf)
    banned = [(i, t) for i, r in enumerate(rows) for t in _bad_word_bans(r)]
    if banned:
        logits = mx.where(_mask(logits.shape, banned), -mx.inf, logits)
    logits = _apply_min_tokens(logits, rows)
    biased = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias.items()]
    if biased:
        r, t, b = zip(*biased)
        delta = mx.zeros(logits.shape, dtype=mx.float32).at[mx.array(r), mx.array(t)].add(
            mx.array(b, dtype=mx.float32))
        logits = logits + delta
    return logits


def _bad_word_bans(row: SampleRow) -> list[int]:
    """vLLM's bad words: a word's last token is banned when the tokens before it end the output."""
    out = row.output_ids
    bans = []
    for word in row.params.bad_words:
        ids = tuple(word.token_ids)
        prefix = ids[:-1]
        if len(prefix) > len(out):
            continue
        if not prefix or tuple(out[len(out) - len(prefix):]) == prefix:
            bans.append(ids[-1])
    return bans


def _apply_min_tokens(logits: mx.array, rows: list[SampleRow]) -> mx.array:
    early = [i for i, r in enumerate(rows) if r.num_outputs < r.params.min_tokens and r.params.stop_token_ids]
    if not early:
        return logits
    stops = _mask(logits.shape, [(i, t) for i in early for t in rows[i].params.stop_token_ids])
    masked = mx.where(stops, -mx.inf, logits)
    structured = [i for i in early if rows[i].params.structured]
    if not structured:
        return masked
    # vLLM gives way to a grammar that allows nothing but a stop token: better to stop than to fail.
    nothing_left = mx.all(mx.isinf(masked) & (masked < 0), axis=-1, keepdims=True)
    restore = nothing_left & _row_mask(len(rows), structured)[:, None] & stops
    return mx.where(restore, logits, masked)


def _has_penalties(p: pb.SamplingParams) -> bool:
    return p.repetition_penalty not in (0.0, 1.0) or bool(p.frequency_penalty) or bool(p.presence_penalty)


def _apply_penalties(logits: mx.array, rows: list[SampleRow]) -> mx.array:
    """vLLM's apply_all_penalties: repetition over prompt and output, then frequency and presence
    over the output."""
    penalised = [i for i, r in enumerate(rows) if _has_penalties(r.params)]
    if not penalised:
        return logits
    shape = logits.shape
    rep = np.ones(len(rows), dtype=np.float32)
    freq = np.zeros(len(rows), dtype=np.float32)
    pres = np.zeros(len(rows), dtype=np.float32)
    seen, outputs = [], []
    for i in penalised:
        p = rows[i].params
        rep[i] = p.repetition_penalty or 1.0
        freq[i], pres[i] = p.frequency_penalty, p.presence_penalty
        seen += [(i, t) for t in rows[i].prompt_ids]
        outputs += [(i, t) for t in rows[i].output_ids]
    counts = _counts(shape, outputs)
    occurred = _mask(shape, seen) | (counts > 0)
    rep = mx.array(rep)[:, None]
    logits = mx.where(occurred, mx.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - mx.array(freq)[:, None] * counts - mx.array(pres)[:, None] * (counts > 0)


def _choose(logits: mx.array, rows: list[SampleRow]) -> mx.array:
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    temps = np.array([r.params.temperature for r in rows], dtype=np.float32)
    random = temps >= GREEDY_EPS
    if not random.any():
        return greedy
    x = logits / mx.array(np.where(random, temps, 1.0))[:, None]
    min_p = np.array([r.params.min_p if random[i] else 0.0 for i, r in enumerate(rows)], dtype=np.float32)
    if min_p.any():
        probs = mx.softmax(x, axis=-1)
        x = mx.where(probs < probs.max(axis=-1, keepdims=True) * mx.array(min_p)[:, None], -mx.inf, x)
    x = _top_k_top_p(x, rows, random)
    keys = mx.array(np.array([[r.draw >> 32, r.draw & 0xFFFFFFFF] for r in rows], dtype=np.uint32))
    noise = mx.vmap(lambda key: mx.random.gumbel((x.shape[-1],), key=key))(keys)
    drafts = np.array([r.draft for r in rows], dtype=np.int32)
    verifying = random & (drafts >= 0)
    if verifying.any():
        x = _verify_drafts(x, rows, drafts, verifying)
    drawn = mx.argmax(x + noise, axis=-1).astype(mx.int32)  # Gumbel-max: a draw from softmax(x)
    return mx.where(mx.array(random), drawn, greedy)


def _verify_drafts(x: mx.array, rows: list[SampleRow], drafts: np.ndarray, verifying: np.ndarray) -> mx.array:
    """Rows that verify a draft: keep it with probability p(draft) (x becomes the draft alone), else
    leave it out (x without it), so the Gumbel draw after this picks from the residual."""
    index = mx.array(np.maximum(drafts, 0))[:, None]
    p_draft = mx.take_along_axis(mx.softmax(x, axis=-1), index, axis=-1)[:, 0]
    # The acceptance draw has its own key: the draw's key with its top bit flipped.
    keys = mx.array(np.array([[(r.draw >> 32) ^ 0x80000000, r.draw & 0xFFFFFFFF] for r in rows], dtype=np.uint32))
    u = mx.vmap(lambda key: mx.random.uniform(shape=(), key=key))(keys)
    accept = (u < p_draft) & mx.array(verifying)
    reject = ~(u < p_draft) & mx.array(verifying)
    is_draft = mx.arange(x.shape[-1])[None, :] == index
    x = mx.where(reject[:, None] & is_draft, -mx.inf, x)
    return mx.where(accept[:, None] & ~is_draft, -mx.inf, x)


def _top_k_top_p(x: mx.array, rows: list[SampleRow], random: np.ndarray) -> mx.array:
    """vLLM's apply_top_k_top_p: keep the k largest (ties kept), then the smallest set of largest
    tokens whose mass exceeds p (at least one)."""
    vocab = x.shape[-1]
    k = np.array([r.params.top_k if random[i] and 0 < r.params.top_k < vocab else vocab
                  for i, r in enumerate(rows)], dtype=np.int32)
    p = np.array([r.params.top_p if random[i] and 0 < r.params.top_p < 1 else 1.0
                  for i, r in enumerate(rows)], dtype=np.float32)
    if (k == vocab).all() and (p == 1.0).all():
        return x
    order = mx.argsort(x, axis=-1)  # ascending, as vLLM sorts
    ordered = mx.take_along_axis(x, order, axis=-1)
    kth = mx.take_along_axis(ordered, mx.array(vocab - k)[:, None], axis=-1)
    ordered = mx.where(ordered < kth, -mx.inf, ordered)
    cumulative = mx.cumsum(mx.softmax(ordered, axis=-1), axis=-1)
    drop = cumulative <= (1 - mx.array(p))[:, None]
    drop = mx.concatenate([drop[:, :-1], mx.zeros((len(rows), 1), dtype=mx.bool_)], axis=-1)
    ordered = mx.where(drop, -mx.inf, ordered)
    inverse = mx.argsort(order, axis=-1)
    return mx.take_along_axis(ordered, inverse, axis=-1)


def _mask(shape, pairs) -> mx.array:
    r, t = zip(*pairs)
    return mx.zeros(shape, dtype=mx.int32).at[mx.array(r), mx.array(t)].add(1) > 0


def _counts(shape, pairs) -> mx.array:
    if not pairs:
        return mx.zeros(shape, dtype=mx.float32)
    r, t = zip(*pairs)
    return mx.zeros(shape, dtype=mx.float32).at[mx.array(r), mx.array(t)].add(1.0)


def _row_mask(n: int, rows: list[int]) -> mx.array:
    m = np.zeros(n, dtype=bool)
    m[rows] = True
    return mx.array(m)
