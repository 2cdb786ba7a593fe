"""Time per output token, metal-cluster serve vs mlx_lm.server, measured by vLLM's own client.

Both servers are up at once, on the same weights (the embedded SmolLM2, its GGUF dequantized to
float32 on both sides), and `vllm bench serve` (random prompts through the chat API, greedy,
ignore_eos) runs against one, then the other, at each concurrency; both get OpenBLAS, and `serve`
its one-row GEMM forwarding in front of it (coordinator/gemv_forward.c), which mlx_lm.server gets
too with --mlx-lm-gemv-forward. The chat API, because mlx_lm.server refuses the completions request
vLLM's client sends ("logprobs": null).

  .venv/bin/python bench/vllm_bench_vs_mlx_lm.py [--concurrency 1 4] [--input-len 256] [--output-len 64]
      [--rounds 2] [--stages 2] [--serve-arg=--max-num-batched-tokens=1024] [--mlx-lm-gemv-forward]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from serve_vs_mlx_lm import mlx_lm_folder, start_mlx_lm  # noqa: E402
from server_process import running_server  # noqa: E402

from metal_cluster.coordinator.blas import openblas_env  # noqa: E402
from metal_cluster.stage_worker.model.model_source import resolve_model  # noqa: E402

METRICS = ("median_ttft_ms", "median_tpot_ms", "median_itl_ms", "output_throughput")


def vllm_bench(url: str, model: str, tokenizer: Path, concurrency: int, args, out: Path, seed: int = 0,
               num_prompts: int | None = None) -> dict:
    """One `vllm bench serve` run; its JSON result (written to `out`). No warm-up request: vLLM's
    would send the run's first prompt, a prefix-cache hit for it on both servers (main warms each
    server up with other prompts instead); `seed` picks the random prompts."""
    name = out.name
    cmd = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "openai-chat", "--base-url", url,
           "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", str(tokenizer),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len),
           "--num-prompts", str(num_prompts or args.prompts_per_slot * concurrency),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--seed", str(seed),
           "--num-warmups", "0", "--save-result", "--result-dir", str(out.parent), "--result-filename", name,
           "--disable-tqdm"]
    env = {**openblas_env(), "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=1800)
    return json.loads((out.parent / name).read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-slot", type=int, default=4, help="prompts per unit of concurrency")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure each server this many times per concurrency, alternating which goes first "
                        "(A B, B A, ...); the medians over rounds are reported")
    p.add_argument("--stages", type=int, default=1, help="our server's pipeline stages (-pp)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more argument for our server (repeat it), e.g. --serve-arg=--max-num-batched-tokens=1024")
    p.add_argument("--mlx-lm-gemv-forward", action="store_true",
                   help="run mlx_lm.server behind our one-row GEMM forwarding too (coordinator/gemv_forward.c), "
                        "not on OpenBLAS alone")
    args = p.parse_args()

    source = resolve_model(None)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-client-"))
    folder = mlx_lm_folder(source, work)
    results = {}
    mlx_proc, mlx_url = start_mlx_lm(folder, work / "mlx_lm.log", args.mlx_lm_gemv_forward)
    try:
        pp = ["-pp", str(args.stages)] if args.stages > 1 else []
        with running_server(None, "--max-model-len", "2048", "--max-num-seqs", "32", *pp, *args.serve_arg,
                            log_path=work / "ours.log", timeout=600) as ours_url:
            servers = {"metal-cluster": (ours_url, "SmolLM2-135M-Instruct"), "mlx_lm.server": (mlx_url, str(folder))}
            for name, (url, model) in servers.items():  # prompts no measured run sends
                vllm_bench(url, model, folder, 2, args, work / f"{name}-warm-up.json", seed=10_000, num_prompts=2)
            for c in args.concurrency:
                runs = {name: [] for name in servers}
                for k in range(args.rounds):
                    for name in (list(servers) if k % 2 == 0 else list(servers)[::-1]):
                        url, model = servers[name]
                        # A round's prompts are new to both servers: no prefix-cache hits across rounds.
                        r = vllm_bench(url, model, folder, c, args, work / f"{name}-c{c}-r{k}.json", seed=1 + k)
                        runs[name].append(r)
                        print(f"{name:14s} c={c:<3d} round {k + 1} " + "  ".join(f"{m} {r.get(m, 0):.1f}" for m in METRICS),
                              flush=True)
                for name, rs in runs.items():
                    results[f"{name}/c{c}"] = {m: statistics.median(r.get(m) or 0.0 for r in rs) for m in METRICS}
    finally:
        os.killpg(mlx_proc.pid, 9)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}")
    for c in args.concurrency:
        ours, theirs = results[f"metal-cluster/c{c}"], results[f"mlx_lm.server/c{c}"]
        print(f"c={c:<3d} TPOT ours/mlx_lm {ours['median_tpot_ms'] / theirs['median_tpot_ms']:.2f}x   "
              f"TTFT ours/mlx_lm {ours['median_ttft_ms'] / theirs['median_ttft_ms']:.2f}x   "
              f"output tok/s ours/mlx_lm {ours['output_throughput'] / theirs['output_throughput']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
