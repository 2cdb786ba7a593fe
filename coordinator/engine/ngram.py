"""Prompt-lookup drafts (vLLM's `ngram` speculative method): when the last n tokens of a request
occurred before in its history, guess that what followed them then follows them now.

vLLM's own proposer (v1/spec_decode/ngram_proposer.py) needs numba and runs inside vLLM's GPU
runner; this one is plain NumPy and runs in the coordinator's scheduler, right after a step's
tokens are appended, so a draft always extends the output it was made from (with pipeline
parallelism several steps are in flight, and a draft made anywhere else could miss a token).
Same rule as vLLM's: the longest n in [min_n, max_n] whose suffix matches earlier, its earliest
occurrence, up to k tokens after it.
"""

from dataclasses import dataclass

import numpy as np


def propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest matching suffix."""
    total = len(tokens)
    if k <= 0 or total <= min_n:
        return []
    # Ends of earlier n-grams that could match: positions whose token is the last token.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    matched = 0
    for n in range(1, min(max_n, total - 1) + 1):
        # An n-gram ending at e needs e >= n - 1 and the n - 1 tokens before it to match too.
        ends = ends[ends >= n - 1]
        if n > 1:
            ends = ends[tokens[ends - (n - 1)] == tokens[total - n]]
        if not len(ends):
            break
        matched, first = n, ends[0]
    if matched < min_n:
        return []
    start = first + 1
    return tokens[start:start + k].tolist()


@dataclass(frozen=True)
class NgramDrafter:
    min_n: int
    max_n: int
    k: int
    max_model_len: int

    @classmethod
    def from_config(cls, speculative_config, max_model_len: int) -> "NgramDrafter | None":
        if speculative_config is None or speculative_config.method != "ngram":
            return None
        return cls(speculative_config.prompt_lookup_min, speculative_config.prompt_lookup_max,
                   speculative_config.num_speculative_tokens, max_model_len)

    def drafts(self, request, output=None) -> list[int]:
        """The drafts for a running request's next step (see `room`)."""
        n = room(request, self.k, self.max_model_len)
        if n <= 0:
            return []
        return propose(np.asarray(request.all_token_ids, dtype=np.int64), self.min_n, self.max_n, n)


def room(request, k: int, max_model_len: int) -> int:
    """How many drafts a running request's next step may verify: none past its max_tokens (the
    step's own token comes on top) or the model's length."""
    return min(k, request.max_tokens - request.num_output_tokens - 1, max_model_len - request.num_tokens - 1)
