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
