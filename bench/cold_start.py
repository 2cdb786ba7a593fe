"""Time from `up` to the first token when the workers have no copy of the model and an empty cache,
then again with their caches filled (the second `up` moves no weight bytes). Three hosts made of
network namespaces (needs root): the coordinator with the model and a stage of its own, two workers
that see an empty folder where the model is. The checkpoint is random llama weights of a few hundred
MB (tests/tiny_models.py; nothing is downloaded). Run: `.venv/bin/python bench/cold_start.py`.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import netns  # noqa: E402
import tiny_models  # noqa: E402

PY = [sys.executable, "-m", "metal_cluster.coordinator"]
TOKEN = "bench-token"
FIRST = """
import sys, time, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="x", timeout=600, max_retries=0)
while True:
    try:
        c.models.list()
        break
    except openai.APIConnectionError:
        time.sleep(0.2)
r = c.completions.create(model="m", prompt=[1, 2, 3], max_tokens=1, temperature=0)
print(time.time(), flush=True)
"""


def worker(ns, ip, model, cache, log):
    cmd = ["sh", "-c", f'mount -t tmpfs none "{model}" && exec "$@"', "sh", *PY, "worker", "--host", ip,
           "--port", "7760", "--ring-port", "7761", "--cluster-token", TOKEN, "--no-advertise"]
    return netns.popen(ns, cmd, log, env={**os.environ, "METAL_CLUSTER_CACHE": str(cache)})


def up_to_first_token(ns_a, ip_a, peers, model, log) -> float:
    began = time.time()
    netns.popen(ns_a, [*PY, "up", str(model), "--interface", ip_a, "--host", ip_a, "--port", "8000",
                       "--cluster-token", TOKEN, "--no-mdns", "--peers", peers, "--discovery-timeout", "60", "--gpu-memory-utilization", "0.05",
                       "--max-model-len", "512", "--max-num-batched-tokens", "64", "--served-model-name", "m"], log)
    out = netns.run(ns_a, [sys.executable, "-c", FIRST, f"http://{ip_a}:8000/v1"], timeout=900)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:] + Path(log).read_text()[-3000:])
    return float(out.stdout.split()[-1]) - began


def fetched(log: Path) -> tuple[int, float]:
    """Bytes this worker fetched for its last assignment, and the seconds the fetches took."""
    text = log.read_text()
    if "assigned layers" not in text:
        raise SystemExit(f"{log} has no assignment:\n{text[-3000:]}")
    lines = re.findall(r"fetched (\d+) bytes .* in ([\d.]+)s", text[text.rindex("assigned layers"):])
    return sum(int(n) for n, _ in lines), sum(float(s) for _, s in lines)


def main():
    work = Path(tempfile.mkdtemp(prefix="mc-bench-cold-"))
    try:
        model = tiny_models.build_tiny_model("llama", work / "model", num_layers=6, hidden_size=1024,
                                             intermediate_size=2816, num_heads=16, num_kv_heads=4)
        size = sum(p.stat().st_size for p in model.iterdir())
        print(f"checkpoint: {size / 2**20:.0f} MiB", flush=True)
        with netns.lan(3, net=79) as [(ns_a, ip_a), (ns_b, ip_b), (ns_c, ip_c)]:
            for ns, ip in ((ns_b, ip_b), (ns_c, ip_c)):
                worker(ns, ip, model, work / f"cache-{ip}", work / f"worker-{ip}.log")
            peers = f"{ip_b}:7760,{ip_c}:7760"
            # The coordinator's manifest is hashed on the first run only: warm it, so both runs compare fetches.
            subprocess.run([sys.executable, "-c", "import sys; from metal_cluster.coordinator.cluster import model_store; "
                            "from metal_cluster.stage_worker.transfer.manifest import build; "
                            "from metal_cluster.stage_worker.model.model_source import resolve_model; "
                            "build(resolve_model(sys.argv[1]), 'm')", str(model)], check=True)
            cold = up_to_first_token(ns_a, ip_a, peers, model, work / "up-1.log")
            moved = {ip: fetched(work / f"worker-{ip}.log") for ip in (ip_b, ip_c)}
            netns.kill_all(ns_a)
            warm = up_to_first_token(ns_a, ip_a, peers, model, work / "up-2.log")
            moved_again = {ip: fetched(work / f"worker-{ip}.log") for ip in (ip_b, ip_c)}
        print(json.dumps({"cold_s": round(cold, 1), "warm_s": round(warm, 1),
                          "fetched_cold_MiB_s": {k: [round(b / 2**20, 1), s] for k, (b, s) in moved.items()},
                          "fetched_warm_MiB_s": {k: [round(b / 2**20, 1), s] for k, (b, s) in moved_again.items()}}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
