#!/usr/bin/env python3
"""End to end on the GPU machine: `metal-cluster serve` vs `mlx_lm.server`, one client, one run.

One random-weight Qwen3-8B-shaped bf16 folder (bench/gpu_serving.py's builders, under --work-dir,
reused while its marker matches), with a tokenizer that decodes every id of the model's vocab (so
each sampled token streams as text) and a chat template. Both servers start on it at once, each
alone in its own process group, and stay up; then, per concurrency, the client runs against one,
then the other: random prompts of --input-len tokens through the chat API, streaming, greedy,
--output-len tokens each (vLLM's ignore_eos; mlx-lm has none, so output tokens are counted).

The client is vLLM's own `vllm bench serve` (random dataset, openai-chat backend); --client openai
uses this script's loop over the official `openai` client instead, and it takes over by itself if
`vllm bench serve` fails. Measured: TTFT (median, p90), time per output token (median), output
tokens/s over the run. A table at the end; every number into --json (rewritten after each run).

On the GPU machine (see bench/gpu_machine.sh: MLX CUDA, vLLM and its deps in /tmp/site):
    python3 bench/gpu_e2e.py --prepare-only       (the model folder, ~16 GB in /tmp/gpu-serving)
    python3 bench/gpu_e2e.py [--concurrency 1 8 32] (numbers into $OUT/gpu_e2e.json)
Here, the whole path on a tiny shape (MLX's CPU backend, a few minutes):
    .venv/bin/python bench/gpu_e2e.py --tiny
"""

import argparse
import concurrent.futures as cf
import contextlib
import datetime
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_serving  # noqa: E402  (model folders; imports mlx and the tests' tiny tokenizer)
from server_process import free_port, running_server  # noqa: E402
from tiny_models import CHAT_TEMPLATE, build_tokenizer  # noqa: E402

from metal_cluster.coordinator import blas  # noqa: E402

SERVERS = ("metal-cluster", "mlx_lm.server")
METRICS = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "output_throughput", "mean_output_tokens")


# --- model folder ------------------------------------------------------------------------------

def model_folder(work_dir: Path, tiny: bool) -> Path:
    config = gpu_serving.SHAPES["qwen3-8b"][1 if tiny else 0]
    folder = gpu_serving.ensure_folders(work_dir, config, ["bf16"], tiny)["bf16"]
    write_tokenizer(folder, config["vocab_size"])
    gpu_serving.free()  # the servers get the device's memory
    return folder


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """The tests' byte-level BPE with its vocab filled up to the model's: a random-weight model samples
    ids all over its vocab, and an id the tokenizer cannot decode would stream no text (no TTFT, no
    tokens counted). The fillers decode to " w<id>"; no merge makes them, so prompts never contain them."""
    spec = json.loads(build_tokenizer().to_str())
    vocab = spec["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in spec["added_tokens"]}
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"\u0120w{i}"] = i  # "Ġ" is the byte-level form of a space
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 40960, "chat_template": CHAT_TEMPLATE}))
    (folder / "special_tokens_map.json").write_text(json.dumps(special))


# --- servers -----------------------------------------------------------------------------------

def start_mlx_lm(folder: Path, log_path: Path, decode_concurrency: int) -> tuple[subprocess.Popen, str]:
    """mlx_lm.server in its own session (so it goes down with all it started); not waited for here."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(folder), "--port", str(port), "--temp", "0",
           "--decode-concurrency", str(decode_concurrency), "--prompt-concurrency", "8"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=blas.openblas_env(),
                                start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlx_lm.server exited with {proc.returncode}; see {log_path}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        time.sleep(0.5)
    raise TimeoutError(f"mlx_lm.server not healthy after {timeout:.0f}s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


# --- client: vLLM's `vllm bench serve` ---------------------------------------------------------

def vllm_bench(url: str, model: str, folder: Path, concurrency: int, args, out: Path) -> dict:
    """One `vllm bench serve` run (as a module: installed with --target there is no `vllm` script)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai-chat",
           "--base-url", url, "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", str(folder),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
           "--num-prompts", str(args.prompts_per_slot * concurrency), "--max-concurrency", str(concurrency),
           "--ignore-eos", "--temperature", "0", "--seed", "0", "--num-warmups", str(concurrency),
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm"]
    env = {**blas.openblas_env(), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.run_timeout)
    if done.returncode:
        raise RuntimeError(f"vllm bench serve exited with {done.returncode}; see {log}")
    r = json.loads(out.read_text())
    completed = r.get("completed") or 0
    return dict(median_ttft_ms=r.get("median_ttft_ms"), p90_ttft_ms=r.get("p90_ttft_ms"),
                median_tpot_ms=r.get("median_tpot_ms"), median_itl_ms=r.get("median_itl_ms"),
                output_throughput=r.get("output_throughput"), requests=completed,
                mean_output_tokens=(r.get("total_output_tokens") or 0) / completed if completed else None,
                duration_s=r.get("duration"), client="vllm bench serve")


# --- client: our loop over the official openai client ------------------------------------------

def prompts(folder: Path, n: int, length: int, seed: int) -> list[str]:
    """Texts of about `length` tokens: random ids of the trained part of the vocab, decoded, re-encoded
    and cut (the chat template adds its own few tokens around them)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    trained = len(build_tokenizer().get_vocab())
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = tok.decode([rng.randrange(3, trained) for _ in range(length)])
        out.append(tok.decode(tok.encode(text).ids[:length]))
    return out


def one_request(client, model: str, text: str, max_tokens: int, extra: dict) -> dict:
    t0 = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            chunks += 1
    latency = time.perf_counter() - t0
    n = usage.completion_tokens if usage else chunks
    return dict(ttft=ttft if ttft is not None else latency, latency=latency, tokens=n,
                prompt_tokens=usage.prompt_tokens if usage else None)


def openai_bench(url: str, model: str, folder: Path, concurrency: int, args, out: Path, ignore_eos: bool) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=args.run_timeout)
    extra = {"ignore_eos": True} if ignore_eos else {}
    with cf.ThreadPoolExecutor(concurrency) as pool:  # warm-up: this batch size's shapes once, untimed
        list(pool.map(lambda t: one_request(client, model, t, 8, extra), prompts(folder, concurrency, args.input_len, 1)))
        texts = prompts(folder, args.prompts_per_slot * concurrency, args.input_len, 2)
        t0 = time.perf_counter()
        rows = list(pool.map(lambda t: one_request(client, model, t, args.output_len, extra), texts))
        wall = time.perf_counter() - t0
    out.write_text(json.dumps(rows, indent=1))
    ttfts = sorted(r["ttft"] for r in rows)
    tpots = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in rows if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in rows)
    return dict(median_ttft_ms=1000 * statistics.median(ttfts),
                p90_ttft_ms=1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
                median_tpot_ms=1000 * statistics.median(tpots) if tpots else None, output_throughput=tokens / wall,
                requests=len(rows), mean_output_tokens=tokens / len(rows),
                mean_prompt_tokens=statistics.mean(r["prompt_tokens"] or 0 for r in rows), duration_s=wall,
                client="openai loop")


def measure(name: str, url: str, model: str, folder: Path, c: int, args, work: Path, state: dict) -> dict:
    out = work / f"{name}-c{c}.json"
    if args.client == "vllm" and not state.get("vllm_failed"):
        try:
            return vllm_bench(url, model, folder, c, args, out)
        except Exception as e:  # the openai loop measures the same things; say which ran
            state["vllm_failed"] = f"{type(e).__name__}: {e}"
            print(f"vllm bench serve failed ({state['vllm_failed']}): the openai loop measures from here on",
                  flush=True)
    return openai_bench(url, model, folder, c, args, out, ignore_eos=name == "metal-cluster")


# --- report ------------------------------------------------------------------------------------

def table(results: dict, concurrency: list[int]) -> str:
    lines = ["| concurrency | server | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p50 (ms) | output tok/s | out tokens/req |",
             "|---:|---|---:|---:|---:|---:|---:|"]

    def f(x):
        return "—" if x is None else (f"{x:.1f}" if x < 1000 else f"{x:.0f}")

    for c in concurrency:
        for name in SERVERS:
            r = results["runs"].get(f"{name}/c{c}")
            if r and "error" not in r:
                lines.append(f"| {c} | {name} | " + " | ".join(f(r.get(m)) for m in METRICS) + " |")
            elif r:
                lines.append(f"| {c} | {name} | failed: {r['error']} |||||")
    return "\n".join(lines)


def ratios(results: dict, concurrency: list[int]) -> list[str]:
    out = []
    for c in concurrency:
        ours, theirs = results["runs"].get(f"metal-cluster/c{c}", {}), results["runs"].get(f"mlx_lm.server/c{c}", {})
        if all(r.get(k) for r in (ours, theirs) for k in ("median_ttft_ms", "median_tpot_ms", "output_throughput")):
            out.append(f"c={c}: TTFT mlx_lm/ours {theirs['median_ttft_ms'] / ours['median_ttft_ms']:.2f}x, "
                       f"TPOT mlx_lm/ours {theirs['median_tpot_ms'] / ours['median_tpot_ms']:.2f}x, "
                       f"output tok/s ours/mlx_lm {ours['output_throughput'] / theirs['output_throughput']:.2f}x "
                       "(>1: ours better)")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny shape and workload: the whole path on the CPU")
    p.add_argument("--concurrency", type=int, nargs="+", help="default 1 8 32 (--tiny: 1 8)")
    p.add_argument("--input-len", type=int, help="prompt tokens (default 1024; --tiny 64)")
    p.add_argument("--output-len", type=int, help="output tokens per request (default 128; --tiny 16)")
    p.add_argument("--max-num-batched-tokens", type=int, help="passed to serve (default: vLLM's, 8192 on a GPU)")
    p.add_argument("--prompts-per-slot", type=int, default=4, help="requests per unit of concurrency")
    p.add_argument("--client", choices=("vllm", "openai"), default="vllm")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/gpu-serving"), help="model folders (reused)")
    p.add_argument("--memory-utilization", type=float, default=0.4,
                   help="serve's --gpu-memory-utilization; mlx_lm.server shares the device with it")
    p.add_argument("--start-timeout", type=float, default=480, help="seconds each server may take to start")
    p.add_argument("--run-timeout", type=float, default=600, help="seconds one measurement may take")
    p.add_argument("--json", type=Path, help="every number, rewritten after each run (default $OUT/gpu_e2e.json)")
    p.add_argument("--prepare-only", action="store_true",
                   help="write the model folder and stop (a device call of its own; later runs reuse it)")
    args = p.parse_args()
    args.concurrency = args.concurrency or ([1, 8] if args.tiny else [1, 8, 32])
    args.input_len = args.input_len or (64 if args.tiny else 1024)
    args.output_len = args.output_len or (16 if args.tiny else 128)
    if args.json is None and os.environ.get("OUT"):
        args.json = Path(os.environ["OUT"]) / "gpu_e2e.json"
    if args.tiny:
        args.work_dir = args.work_dir.with_name(args.work_dir.name + "-tiny")

    import mlx.core as mx

    results = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   device=gpu_serving.device_info(), versions=gpu_serving.versions(),
                   args={k: str(v) for k, v in vars(args).items()}, runs={})
    with contextlib.suppress(Exception):  # without importing vLLM here (seconds, and torch with it)
        import importlib.metadata

        results["versions"].update({d: importlib.metadata.version(d) for d in ("vllm", "torch", "transformers")})
    print(f"device {results['device']['mlx_device']}, mlx {mx.__version__}", flush=True)

    def save():
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2))

    t0 = time.perf_counter()
    folder = model_folder(args.work_dir, args.tiny)
    results["folder"] = str(folder)
    results["folder_s"] = time.perf_counter() - t0
    if args.prepare_only:
        print(f"model folder {folder} ready ({results['folder_s']:.0f}s)")
        return
    logs = args.json.parent if args.json else Path(tempfile.mkdtemp(prefix="gpu-e2e-"))
    work = logs / "runs"  # each run's raw results and the client's log
    work.mkdir(parents=True, exist_ok=True)
    max_len = args.input_len + args.output_len + 64
    extra = ["--gpu-memory-utilization", str(args.memory_utilization), "--max-model-len", str(max_len),
             "--max-num-seqs", str(max(32, *args.concurrency))]
    if args.max_num_batched_tokens:
        extra += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    state: dict = {}
    print(f"model folder {folder} ({results['folder_s']:.0f}s); starting both servers (logs in {logs})", flush=True)
    t0 = time.perf_counter()
    mlx_proc, mlx_url = start_mlx_lm(folder, logs / "mlx_lm_server.log", max(args.concurrency))
    try:
        with running_server(folder, *extra, log_path=logs / "metal_cluster_serve.log",
                            timeout=args.start_timeout) as ours_url:
            results["ours_start_s"] = time.perf_counter() - t0
            wait_healthy(mlx_proc, mlx_url, args.start_timeout, logs / "mlx_lm_server.log")
            results["both_up_s"] = time.perf_counter() - t0
            print(f"both up after {results['both_up_s']:.0f}s (ours {results['ours_start_s']:.0f}s)", flush=True)
            servers = {"metal-cluster": (ours_url, folder.name), "mlx_lm.server": (mlx_url, str(folder))}
            for c in args.concurrency:
                for name, (url, model) in servers.items():
                    started = time.perf_counter()
                    try:
                        r = measure(name, url, model, folder, c, args, work, state)
                    except Exception as e:  # keep the other runs' numbers
                        traceback.print_exc()
                        r = dict(error=f"{type(e).__name__}: {e}")
                    r["run_s"] = time.perf_counter() - started
                    results["runs"][f"{name}/c{c}"] = r
                    if state.get("vllm_failed"):
                        results["vllm_bench_failed"] = state["vllm_failed"]
                    save()
                    print(f"{name:14s} c={c:<3d} " + "  ".join(
                        f"{m} {r[m]:.1f}" for m in METRICS if isinstance(r.get(m), (int, float))) +
                        f"  ({r['run_s']:.0f}s, {r.get('client', r.get('error'))})", flush=True)
    finally:
        stop(mlx_proc)
    print()
    print(table(results, args.concurrency))
    for line in ratios(results, args.concurrency):
        print(f"- {line}")
    print(f"- machine: {platform.machine()}, {os.cpu_count()} cores, {results['device']}")
    if mx.default_device().type == mx.DeviceType.cpu:
        print("- CPU: a smoke test of the path only (the stage computes in float32 there, mlx-lm in bf16)")
    save()
    if args.json:
        print(f"\nraw numbers: {args.json}")


if __name__ == "__main__":
    main()
