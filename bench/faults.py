"""Time to detect a lost stage and time to recover, on 3 local stages, SmolLM2, under streaming load.

For each fault (SIGKILL of a stage process; SIGSTOP of one, with a 3 s and the default 15 s stage
timeout) the script keeps 8 streams running, hits the middle stage, and measures from the signal:

  detect    until the coordinator marks the outage (its first cluster event)
  errors    until the last in-flight stream has ended (all of them end with an error or their answer)
  recover   until the re-plan is in place (the "re-planned" event)
  answer    until a request sent right after the fault is answered by the new plan

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

from metal_cluster.coordinator import cluster_state  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
ARGS = ["--max-model-len", "1024", "--max-num-batched-tokens", "256", "--max-num-seqs", "16", "-pp", "3"]


def status(url):
    out = subprocess.run([sys.executable, "-m", "metal_cluster.coordinator", "status", "--json", "--url", url],
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)["cluster"]


def stream(client, i, first):
    try:
        for chunk in client.completions.create(model=MODEL, prompt=f"Story {i}: once upon a time", max_tokens=600,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True}):
            first.set()
    except openai.APIError:
        pass
    return time.time()


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
            ended = max(f.result() for f in streams)
            client.completions.create(model=MODEL, prompt="After the fault", max_tokens=4, temperature=0)
            answered = time.time()
        if fault == "SIGSTOP":
            os.kill(victim, signal.SIGKILL)
        events = status(url)["events"]
    outage = next(e["time"] for e in events if e["time"] >= hit)
    replanned = next(e for e in events if "re-planned" in e["message"])
    print(f"  {fault}: {replanned['message']}", file=sys.stderr, flush=True)
    return {"detect": outage - hit, "errors": ended - hit, "recover": replanned["time"] - hit,
            "answer": answered - hit}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    cases = [("SIGKILL", 15.0), ("SIGSTOP", 3.0), ("SIGSTOP", 15.0)]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
          f"{time.strftime('%Y-%m-%d')}; 3 local stages, {MODEL}, 8 streams")
    print("| fault | stage timeout | detect (s) | all streams ended (s) | re-planned (s) | first answer (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for fault, timeout in cases:
            runs = [one_fault(fault, timeout, Path(tmp)) for _ in range(args.repeat)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"| {fault} | {timeout:.0f} s | {med['detect']:.2f} | {med['errors']:.2f} | {med['recover']:.2f} "
                  f"| {med['answer']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
