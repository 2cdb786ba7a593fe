"""Embeddings per second: `metal-cluster serve --runner pooling` at 16 concurrent requests vs a plain
mlx-lm loop (one forward pass per text, LAST pooling of the final-norm hidden states, L2 norm).

Same weights on both sides: SmolLM2-135M (the embedded default; its Q4_1 GGUF dequantized to float32
the way the stages do it on a CPU). The first vectors of both are compared, so the two really compute
the same thing.

  .venv/bin/python bench/embeddings.py [--concurrency 16] [--requests 128]
"""

import argparse
import concurrent.futures as cf
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from server_process import running_server  # noqa: E402

WORDS = ("cluster stage ring cache token batch layer prompt vector model memory host wire block step "
         "scheduler adapter kernel tensor queue").split()


def texts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(24, 48)))) for _ in range(n)]


def mlx_lm_loop(inputs: list[str]) -> tuple[float, np.ndarray]:
    import mlx.core as mx

    from mlx_lm.utils import load_tokenizer

    from metal_cluster.stage_worker.model.model_source import resolve_model
    from metal_cluster.stage_worker.model.shard import load_shard

    shard = load_shard(resolve_model(None))  # mlx-lm's own model class, weights as the stages read them
    tokenizer = load_tokenizer(resolve_model(None).folder)
    model = shard.model
    for layer in model.model.layers:  # the plain mlx-lm attention, not the stage's paged wrapper
        layer.self_attn = layer.self_attn.inner
    first = None
    began = time.perf_counter()
    for text in inputs:
        hidden = model.model(mx.array(tokenizer.encode(text))[None])[0, -1]
        vector = np.array(hidden.astype(mx.float32))
        vector /= np.linalg.norm(vector)
        first = vector if first is None else first
    return len(inputs) / (time.perf_counter() - began), first


def served(inputs: list[str], concurrency: int, work: Path) -> tuple[float, np.ndarray]:
    with running_server(None, "--runner", "pooling", "--convert", "embed", "--max-model-len", "512",
                        "--max-num-seqs", "32", log_path=work / "server.log", timeout=600) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
        model = client.models.list().data[0].id

        def one(text):
            return np.array(client.embeddings.create(model=model, input=text).data[0].embedding, dtype=np.float32)

        with cf.ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, inputs[:concurrency]))  # warm-up
            began = time.perf_counter()
            vectors = list(pool.map(one, inputs))
        return len(inputs) / (time.perf_counter() - began), vectors[0]


def main():
    from metal_cluster.coordinator.blas import find_openblas, openblas_env

    lib = find_openblas()
    if lib and lib not in os.environ.get("LD_PRELOAD", ""):  # the mlx-lm loop gets the server's BLAS
        os.execve(sys.executable, [sys.executable, *sys.argv], openblas_env())
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=128)
    args = parser.parse_args()
    inputs = texts(args.requests)
    work = Path(tempfile.mkdtemp(prefix="bench-embeddings-"))
    ours, ours_first = served(inputs, args.concurrency, work)
    loop, loop_first = mlx_lm_loop(inputs)
    print(f"machine: {platform.machine()} {platform.system()}; {args.requests} texts of 24-48 words")
    print("| | embeddings/s |")
    print("|---|---:|")
    print(f"| metal-cluster serve --runner pooling, {args.concurrency} concurrent | {ours:.1f} |")
    print(f"| plain mlx-lm loop | {loop:.1f} |")
    print(f"ratio: {ours / loop:.2f}x; first vector max |difference| {np.abs(ours_first - loop_first).max():.2e}")


if __name__ == "__main__":
    main()
