"""Time to detect a lost stage and time to recover, on 3 local stages, SmolLM2, under streaming load.

For each fault (SIGKILL of a stage process; SIGSTOP of one, which stays frozen) the script keeps 8
greedy streams running, hits the middle stage, and measures from the signal:

  detect    until the coordinator marks the outage (its first cluster event)
  re-plan   the re-plan's own phases, as `status` reports them (probe, restart or standby take-over,
            place, load, start)
  serving   until the re-plan is in place (the "re-planned" event): serving again
  resumed   until the first token of a paused stream arrives from the new plan (first token again)
  answer    until a greedy request sent right after the fault has its first token, and its last

and checks that every stream ended whole with the text of the same server's unfaulted run (the 8
prompts run once before the first fault). Medians, p50 and p99 over `--repeat` faults each.

  .venv/bin/python bench/faults.py [--repeat 5] [--cases SIGKILL,SIGSTOP] [--json out.json]
"""

import argparse
import concurrent.futures as cf
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from server_process import running_server  # noqa: E402

from metal_cluster.coordinator.cluster import cluster_state  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TOKENS = 160  # per stream: still running when the stage is hit, short enough to finish after the pause
ARGS = ["--max-model-len", "1024", "--max-num-batched-tokens", "256", "--max-num-seqs", "16", "-pp", "3"]
PROMPTS = [f"Story {i}: once upon a time" for i in range(8)]
KEYS = ["detect", "probe", "restart", "place", "load", "start", "serving", "resumed", "answer first token",
        "answer"]


def status(url):
    out = subprocess.run([sys.executable, "-m", "metal_cluster.coordinator", "status", "--json", "--url", url],
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)["cluster"]


def stream(client, prompt, first):
    """(arrival time of every chunk, text, finish reason or the error)."""
    times, text = [], []
    try:
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            times.append(time.time())
            text.append(chunk.choices[0].text)
            first.set()
        return times, "".join(text), chunk.choices[0].finish_reason
    except openai.APIError as e:
        return times, "".join(text), f"error: {e}"


def unfaulted(client) -> list[str]:
    with cf.ThreadPoolExecutor(8) as pool:
        return [r.choices[0].text for r in pool.map(
            lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=TOKENS, temperature=0,
                                                extra_body={"ignore_eos": True}), PROMPTS)]


def one_fault(fault: str, stage_timeout: float | None, work: Path, n: int, reference: list) -> dict:
    extra = ["--stage-timeout", str(stage_timeout)] if stage_timeout else []
    with running_server(None, *ARGS, *extra, log_path=work / f"{fault}-{n}.log", timeout=600) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
        if not reference:
            reference.extend(unfaulted(client))
        victim = cluster_state.local_coordinators()[0]["worker_pids"][1]
        first = threading.Event()
        with cf.ThreadPoolExecutor(9) as pool:
            streams = [pool.submit(stream, client, p, first) for p in PROMPTS]
            first.wait(120)
            time.sleep(1.0)
            load_at_hit = os.getloadavg()[0]
            hit = time.time()
            os.kill(victim, getattr(signal, fault))
            answer_first = None
            for _ in client.completions.create(model=MODEL, prompt="After the fault", max_tokens=4, temperature=0,
                                               stream=True):
                answer_first = answer_first or time.time()
            answered = time.time()
            results = [f.result() for f in streams]
        if fault == "SIGSTOP":
            os.kill(victim, signal.SIGKILL)
        cluster = status(url)
    events = cluster["events"]
    outage = next(e["time"] for e in events if e["time"] >= hit)
    replanned = next(e for e in events if "re-planned" in e["message"])
    resumed = min(t for times, _, _ in results for t in times if t > replanned["time"])
    parts = cluster.get("last_replan") or {}
    print(f"  {fault} #{n}: {replanned['message']}", file=sys.stderr, flush=True)
    whole = 0
    for k, ((_, text, finish), want) in enumerate(zip(results, reference)):
        if finish == "length" and text == want:
            whole += 1
        else:
            print(f"  stream {k}: {finish}; text equal to the unfaulted run: {text == want}", file=sys.stderr)
    return {"detect": outage - hit, **{k: parts.get(k, float("nan")) for k in ("probe", "restart", "place", "load",
                                                                                "start")},
            "serving": replanned["time"] - hit, "resumed": resumed - hit,
            "answer first token": answer_first - hit, "answer": answered - hit, "whole": whole,
            "load average": load_at_hit}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--log-dir", help="keep the servers' logs here (default: a temporary folder)")
    parser.add_argument("--cases", default="SIGKILL,SIGSTOP",
                        help="fault[:stage-timeout],... (no timeout: the server's default)")
    parser.add_argument("--json", help="write every run's figures here")
    args = parser.parse_args()
    cases = [(c.split(":")[0], float(c.split(":")[1]) if ":" in c else None) for c in args.cases.split(",")]
    header = (f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
              f"{time.strftime('%Y-%m-%d %H:%M')}; load average {os.getloadavg()[0]:.1f}; 3 local stages, {MODEL}, "
              f"8 greedy streams of {TOKENS} tokens")
    print(header, flush=True)
    out = {"header": header, "cases": {}}
    reference: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.log_dir:
            tmp = args.log_dir
            Path(tmp).mkdir(parents=True, exist_ok=True)
        for fault, timeout in cases:
            runs = []
            for n in range(args.repeat):
                runs.append(one_fault(fault, timeout, Path(tmp), n, reference))
                print("  " + ", ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()), flush=True)
            out["cases"][f"{fault}:{timeout or 'default'}"] = runs
            print(f"\n{fault}, stage timeout {timeout or 'default'}: {len(runs)} faults, load average at the hit "
                  f"{min(r['load average'] for r in runs):.1f}-{max(r['load average'] for r in runs):.1f}; "
                  f"streams whole and equal to the unfaulted run: {'/'.join(str(r['whole']) for r in runs)} of 8")
            print("| seconds from the signal | p50 | p99 | max |")
            print("|---|---:|---:|---:|")
            for key in KEYS:
                values = [r[key] for r in runs]
                print(f"| {key} | {np.percentile(values, 50):.2f} | {np.percentile(values, 99):.2f} "
                      f"| {max(values):.2f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
