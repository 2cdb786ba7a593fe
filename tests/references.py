"""The oracle every serving path is held to: mlx-lm's own greedy generation of the same weights."""

import functools

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.utils import load_tokenizer

from metal_cluster.stage_worker.model import gguf
from metal_cluster.stage_worker.model.model_source import resolve_model


def mlx_lm_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's generate_step with its default (argmax) sampler; it does not stop at EOS."""
    return [int(token) for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def mlx_lm_masked_greedy(model, prompt: list[int], max_tokens: int, allowed: list[int]) -> tuple[list[int], list[float]]:
    """Greedy over `allowed` only (vLLM's allowed_token_ids), and each chosen token's raw logprob
    (vLLM's default: the log-softmax before any processor)."""
    tokens, logprobs = list(prompt), []
    for _ in range(max_tokens):
        logits = model(mx.array(tokens)[None])[0, -1].astype(mx.float32)
        token = max(allowed, key=lambda t: logits[t].item())
        tokens.append(token)
        logprobs.append((logits[token] - mx.logsumexp(logits)).item())
    return tokens[len(prompt):], logprobs


@functools.lru_cache(maxsize=1)
def smollm2_reference():
    """(source, mlx-lm Llama with the GGUF's weights dequantized as we do, tokenizer) of the default model."""
    source = resolve_model(None)
    tensors, _ = gguf.read_gguf(source.gguf)
    model = llama.Model(llama.ModelArgs.from_dict(source.config))
    model.load_weights(list(gguf.gguf_weights(tensors, source.config).items()))
    return source, model, load_tokenizer(source.folder)


def mtp_reference(folder):
    """(mlx-lm's model of the target, the checkpoint's first MTP layer as plain mlx-lm modules):
    the oracle of speculative decoding's `mtp` drafts. mlx-lm's strict load refuses the MTP
    tensors it does not drop, so the target loads without them."""
    from mlx_lm.utils import load_model

    from metal_cluster.stage_worker.families import family_of

    source = resolve_model(folder)
    model, _ = load_model(source.folder, strict=False)
    return model, family_of(source.config, folder).load_mtp(source, source.config)[0]


def mtp_greedy_drafts(model, layer, history: list[int], k: int, recycles_norm: bool = True,
                      allowed: list[int] | None = None) -> list[int]:
    """vLLM's MTP drafts (DeepSeekMTP, Glm4MoeMTP) after `history`, over the whole history at once
    with a causal mask (no paged KV): row p reads the target's final-norm hidden state at p and the
    embedding of token p + 1 (zero at position 0); the last row's argmax is the first draft, and each
    further draft is one more row, reading the draft before and the previous row's output (after
    shared_head's norm for DeepSeek: `recycles_norm`). `allowed`: drafts among these tokens only,
    as the drafter picks them for a request with allowed_token_ids."""
    hidden = model.model(mx.array([history]))[0]
    embeds = layer.embed_tokens(mx.array(history[1:]))
    embeds[0] = 0

    def row(e, h):
        return layer.eh_proj(mx.concatenate([layer.enorm(e), layer.hnorm(h)], axis=-1))

    x, drafts = row(embeds, hidden[:-1]), []
    for _ in range(k):
        n = x.shape[0]
        out = layer.block(x[None], mx.tril(mx.ones((n, n), dtype=mx.bool_)), None)[0][-1:]
        logits = layer.shared_head.head(layer.shared_head.norm(out))[0]
        drafts.append(int(mx.argmax(logits)) if allowed is None else max(allowed, key=lambda t: logits[t].item()))
        recycled = layer.shared_head.norm(out) if recycles_norm else out
        x = mx.concatenate([x, row(layer.embed_tokens(mx.array(drafts[-1:])), recycled)])
    return drafts


def mtp_accepted_positions(model, layer, prompt: list[int], n: int, k: int, allowed: list[int]) -> set[int]:
    """The output positions whose token a greedy request with MTP drafts (k per step, among
    `allowed`) takes from an accepted draft: vLLM's schedule for one request, whose drafts depend on
    its history alone (each step's room: k, or what max_tokens leaves after the step's own token)."""
    target = mlx_lm_masked_greedy(model, prompt, n, allowed)[0]
    out, accepted = target[:1], set()
    while len(out) < n:
        drafts = mtp_greedy_drafts(model, layer, prompt + out, k, allowed=allowed)[:min(k, n - len(out) - 1)]
        m = 0
        while m < len(drafts) and drafts[m] == target[len(out) + m]:
            m += 1
        accepted |= set(range(len(out), len(out) + m))
        out = target[:len(out) + m + 1]
    return accepted
