"""Time to detect a lost stage and time to recover, on 3 local stages, SmolLM2, under streaming load.

For each fault (SIGKILL of a stage process; SIGSTOP of one, with a 3 s and the default 15 s stage
timeout) the script keeps 8 streams running, hits the middle stage, and measures from the signal:

  detect    until the coordinator marks the outage (its first cluster event)
  recover   until the re-plan is in place (the "re-planned" event): serving again
  resumed   until the first token of a paused stream arrives from the new plan
  answer    until a request sent right after the fault is answered by the new plan

and counts the streams that ended whole (all 8 should: a lost stage is a pause).

  .venv/bin/python bench/faults.py [--repeat 2]
"""

import argparse
import concurrent.futures as cf
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from server_process import running_server  # noqa: E402

from metal_cluster.coordinator.cluster import cluster_state  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TOKENS = 200  # per stream: still running when the stage is hit, short enough to finish after the pause
ARGS = ["--max-model-len", "1024", "--max-num-batched-tokens", "256", "--max-num-seqs", "16", "-pp", "3"]


def status(url):
    out = subprocess.run([sys.executable, "-m", "metal_cluster.coordinator", "status", "--json", "--url", url],
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)["cluster"]


def stream(client, i, first):
    """(arrival time of every chunk, whether the stream ended whole)."""
    times = []
    try:
        for chunk in client.completions.create(model=MODEL, prompt=f"Story {i}: once upon a time", max_tokens=TOKENS,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True}):
            times.append(time.time())
            first.set()
        if chunk.choices[0].finish_reason != "length":
            print(f"  stream {i}: ended with finish_reason {chunk.choices[0].finish_reason!r}", file=sys.stderr)
        return times, chunk.choices[0].finish_reason == "length"
    except openai.APIError as e:
        print(f"  stream {i}: {e}", file=sys.stderr, flush=True)
        return times, False


def one_fault(fault: str, stage_timeout: float, work: Path) -> dict:
    with running_server(None, *ARGS, "--stage-timeout", str(stage_timeout), log_path=work / f"{fault}.log",
                        timeout=600) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
        victim = cluster_state.local_coordinators()[0]["worker_pids"][1]
        first = threading.Event()
        with cf.ThreadPoolExecutor(9) as pool:
            streams = [pool.submit(stream, client, i, first) for i in range(8)]
            first.wait(120)
            time.sleep(1.0)
            hit = time.time()
            os.kill(victim, getattr(signal, fault))
            client.completions.create(model=MODEL, prompt="After the fault", max_tokens=4, temperature=0)
            answered = time.time()
            results = [f.result() for f in streams]
        if fault == "SIGSTOP":
            os.kill(victim, signal.SIGKILL)
        events = status(url)["events"]
    outage = next(e["time"] for e in events if e["time"] >= hit)
    replanned = next(e for e in events if "re-planned" in e["message"])
    resumed = min(t for times, _ in results for t in times if t > replanned["time"])
    print(f"  {fault}: {replanned['message']}", file=sys.stderr, flush=True)
    return {"detect": outage - hit, "recover": replanned["time"] - hit, "resumed": resumed - hit,
            "answer": answered - hit, "whole": sum(whole for _, whole in results)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--log-dir", help="keep the servers' logs here (default: a temporary folder)")
    parser.add_argument("--cases", default="SIGKILL:15,SIGSTOP:3,SIGSTOP:15", help="fault:stage-timeout,...")
    args = parser.parse_args()
    cases = [(c.split(":")[0], float(c.split(":")[1])) for c in args.cases.split(",")]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
          f"{time.strftime('%Y-%m-%d')}; 3 local stages, {MODEL}, 8 streams")
    print("| fault | stage timeout | detect (s) | serving again (s) | first resumed token (s) | first answer (s) "
          "| streams whole |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        if args.log_dir:
            tmp = args.log_dir
            Path(tmp).mkdir(parents=True, exist_ok=True)
        for fault, timeout in cases:
            runs = [one_fault(fault, timeout, Path(tmp)) for _ in range(args.repeat)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            whole = "/".join(str(r["whole"]) for r in runs)
            print(f"| {fault} | {timeout:.0f} s | {med['detect']:.2f} | {med['recover']:.2f} | {med['resumed']:.2f} "
                  f"| {med['answer']:.2f} | {whole} of 8 |", flush=True)


if __name__ == "__main__":
    main()
