"""Weights over the model store vs a plain TCP stream, between two network namespaces (needs root).

Builds a random-weight llama checkpoint of a few hundred MB (tests/tiny_models.py; nothing is
downloaded), serves it from the coordinator's model store in one namespace and fetches all of it
into an empty cache in the other (manifest, pieces, a BLAKE3 of each, writes to disk): over the
store's plaintext port (the default) and over TLS (`up --weights-over-tls`); then sends
the same file's bytes over one plain TCP connection between the same two namespaces: received and
dropped, and received and written to a file; and over one TLS connection made with the cluster's
certificates (Python's ssl, what TLS alone costs). Beside each rate, the CPU seconds per GiB on the
receiving and the sending end: the link between namespaces is memory copies, so on a small shared
machine the rates follow the CPU left over, and the CPU cost is the steadier figure.
Run: `.venv/bin/python bench/model_transfer.py`.

`--first-up`: the first `metal-cluster up` of a multi-GB checkpoint made here (random llama
weights, `--layers`/`--hidden`), three hosts of network namespaces: the coordinator, which has the
model and runs a stage, and two workers that have no copy of it (an empty tmpfs over its folder).
Reports, per worker, the bytes it fetched, the bytes its cache holds, and its stage's share of the
checkpoint; the seconds until `up` serves; and the same for a second `up` (nothing to fetch).
Run: `.venv/bin/python bench/model_transfer.py --first-up --layers 12 --hidden 2048`; `--json PATH`
writes the figures.

`--gguf-stages`: each stage of a 3-stage plan of the embedded SmolLM2 Q4_1 GGUF fetched into an
empty cache of its own (in-process, loopback), and what each cache then holds: its files' bytes,
their blocks on disk, and what a size count that follows links sees (`du -L --apparent-size`).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import netns  # noqa: E402
import tiny_models  # noqa: E402

TLS = """
import ssl, tempfile
from metal_cluster.stage_worker.net import cluster_tls
def tls_context(server):
    me, folder = cluster_tls.identity("bench-token", "bench"), tempfile.mkdtemp()
    for name, value in (("cert", me.cert), ("key", me.key), ("ca", me.ca)):
        open(f"{folder}/{name}", "wb").write(value)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(f"{folder}/cert", f"{folder}/key")
    ctx.load_verify_locations(f"{folder}/ca")
    ctx.verify_mode, ctx.check_hostname = ssl.CERT_REQUIRED, False
    return ctx
"""
STORE = """
import sys, time
from metal_cluster.coordinator.cluster import model_store
from metal_cluster.stage_worker.model.model_source import resolve_model
s = model_store.start(resolve_model(sys.argv[1]), "bench", sys.argv[2], "bench-token", port=int(sys.argv[3]),
                      weights_over_tls=sys.argv[4] == "tls")
print(s.manifest.sha256, flush=True)
time.sleep(3600)
"""
FETCH = """
import sys, time, json
from pathlib import Path
from metal_cluster.stage_worker.transfer.fetch import fetch_stage
import mlx_lm.utils  # imported before the clock starts, as in a worker
t = time.perf_counter()
cpu = time.process_time()
got = fetch_stage(sys.argv[1], sys.argv[2], 0, int(sys.argv[3]), "bench-token", root=Path(sys.argv[4]))
print(json.dumps({"bytes": got.received, "s": time.perf_counter() - t, "cpu": time.process_time() - cpu,
                  "moving_s": got.seconds}))
"""
SEND = TLS + """
import socket, sys, time
srv = socket.create_server((sys.argv[1], 7791))
conn, _ = srv.accept()
cpu = time.process_time()
with open(sys.argv[2], "rb") as f:
    if sys.argv[3] == "tls":  # no sendfile through TLS: read and encrypt
        conn = tls_context(True).wrap_socket(conn, server_side=True)
        buf = memoryview(bytearray(1 << 20))
        while n := f.readinto(buf):
            conn.sendall(buf[:n])
    else:
        conn.sendfile(f)
conn.close()
print(time.process_time() - cpu, flush=True)
"""
RECV = TLS + """
import socket, sys, time, json
t = time.perf_counter()
s = socket.create_connection((sys.argv[1], 7791))
if sys.argv[3] == "tls":
    s = tls_context(False).wrap_socket(s)
cpu = time.process_time()
out = open(sys.argv[2], "wb") if sys.argv[2] != "-" else None
buf = memoryview(bytearray(1 << 20))
n = 0
while k := s.recv_into(buf):  # recv() would allocate a MiB for each 16 KiB TLS record
    n += k
    if out:
        out.write(buf[:k])
if out:
    out.close()
print(json.dumps({"bytes": n, "s": time.perf_counter() - t, "cpu": time.process_time() - cpu}))
"""


def tcp(ns_a, ip_a, ns_b, path: Path, sink: str, tls: bool = False) -> dict:
    how = "tls" if tls else "plain"
    sender = subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, "-c", SEND, ip_a, str(path), how],
                              stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        out = netns.run(ns_b, [sys.executable, "-c", RECV, ip_a, sink, how], timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return {**json.loads(out.stdout.strip().splitlines()[-1]), "sender_cpu": float(sender.communicate(timeout=30)[0])}
    finally:
        sender.kill()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:  # utime + stime of the process and its threads, in clock ticks
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def first_up(args) -> dict:
    """Two `up`s of one model over a coordinator and two workers that fetch their layers."""
    import re

    import test_up_netns as up_test

    work = Path(tempfile.mkdtemp(prefix="mc-bench-first-up-"))
    try:
        model = tiny_models.build_tiny_model("llama", work / "model", num_layers=args.layers,
                                             hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                             num_heads=16, num_kv_heads=4)
        size = (model / "model.safetensors").stat().st_size
        print(f"checkpoint: {size / 2**30:.2f} GiB, {args.layers} layers, float32", flush=True)
        out = {"checkpoint_bytes": size, "layers": args.layers, "hidden": args.hidden, "ups": []}
        with netns.lan(3, net=79) as [(ns_a, ip_a), (ns_b, ip_b), (ns_c, ip_c)]:
            for ns, ip in ((ns_b, ip_b), (ns_c, ip_c)):
                up_test.start_worker(ns, ip, work, hide=model)
            for k in range(2):
                log = work / f"up-{k}.log"
                began = time.monotonic()
                up = netns.popen(ns_a, [*up_test.PY, "up", str(model), "--interface", ip_a, "--host", ip_a,
                                        "--port", "8000", "--cluster-token", up_test.TOKEN,
                                        "--gpu-memory-utilization", "0.1", "--max-model-len", "512",
                                        "--max-num-batched-tokens", "64", "--served-model-name", "m", "--no-mdns",
                                        "--peers", f"{ip_b}:7760,{ip_c}:7760", "--discovery-timeout", "60"], log)
                up_test.wait_healthy(ns_a, f"http://{ip_a}:8000", up, log, timeout=1200)
                seconds = time.monotonic() - began
                row = {"up": k + 1, "seconds_until_serving": round(seconds, 1), "workers": []}
                for ip in (ip_b, ip_c):
                    (a, b), fetched = up_test.fetched(work / f"worker-{ip}.log")
                    share, _ = up_test.stage_share(model, a, b, num_layers=args.layers)
                    cache = work / f"cache-{ip}"
                    kept = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and not p.is_symlink())
                    disk = sum(p.stat().st_blocks * 512 for p in cache.rglob("*") if p.is_file() and not p.is_symlink())
                    secs = [float(x) for x in re.findall(r"fetched \d+ bytes for layers \S+ \S+ in ([\d.]+)s",
                                                          (work / f"worker-{ip}.log").read_text())]
                    row["workers"].append({"worker": ip, "layers": [a, b], "bytes_fetched": fetched,
                                           "cache_bytes": kept, "cache_disk_bytes": disk, "stage_tensor_bytes": share,
                                           "cache_over_share_of_checkpoint": round((kept - share) / size, 4),
                                           "fetch_seconds": secs[-1] if secs and fetched else 0.0})
                    print(f"up {k + 1}: worker {ip} layers [{a}, {b}): fetched {fetched / 2**20:.1f} MiB, cache "
                          f"{kept / 2**20:.1f} MiB (on disk {disk / 2**20:.1f}), its tensors {share / 2**20:.1f} MiB "
                          f"({share / size:.0%} of the checkpoint)", flush=True)
                print(f"up {k + 1}: serving after {seconds:.1f} s", flush=True)
                out["ups"].append(row)
                netns.kill_all(ns_a)
                up.wait(30)
        return out
    finally:
        if args.keep:
            print(f"kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def gguf_stage_caches() -> dict:
    work = Path(tempfile.mkdtemp(prefix="mc-bench-gguf-stages-"))
    os.environ["METAL_CLUSTER_CACHE"] = str(work / "coordinator")
    from metal_cluster.coordinator.cluster import model_store
    from metal_cluster.stage_worker.model.model_source import resolve_model
    from metal_cluster.stage_worker.transfer.fetch import fetch_stage

    def sizes(root: Path) -> dict:
        files = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
        return {"apparent": sum(p.stat().st_size for p in files), "disk": sum(p.stat().st_blocks * 512 for p in files),
                "apparent_links_followed": sum(p.stat().st_size for p in root.rglob("*") if p.is_file())}

    try:
        source = resolve_model(None)
        store = model_store.start(source, "smollm2", "127.0.0.1", "bench-token")
        n = source.config["num_hidden_layers"]
        rows = []
        try:
            for a, b in ((0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)):
                got = fetch_stage(store.address, store.manifest.sha256, a, b, "bench-token", root=work / f"w{a}")
                rows.append({"layers": [a, b], "fetched": got.received, **sizes(work / f"w{a}")})
                print(f"layers [{a}, {b}): {rows[-1]}", flush=True)
        finally:
            store.stop()
        return {"gguf_bytes": source.gguf.stat().st_size, "stages": rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--first-up", action="store_true", help="two `up`s over two fetching workers")
    parser.add_argument("--json", help="write the --first-up or --gguf-stages figures here")
    parser.add_argument("--keep", action="store_true", help="keep the --first-up folder (logs, caches)")
    parser.add_argument("--gguf-stages", action="store_true", help="the caches of a 3-stage SmolLM2 GGUF plan")
    args = parser.parse_args()
    if args.first_up or args.gguf_stages:
        figures = first_up(args) if args.first_up else gguf_stage_caches()
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
        return
    work = Path(tempfile.mkdtemp(prefix="mc-bench-transfer-"))
    try:
        model = tiny_models.build_tiny_model("llama", work / "model", num_layers=args.layers,
                                             hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                             num_heads=16, num_kv_heads=4)
        size = sum(p.stat().st_size for p in model.iterdir())
        print(f"checkpoint: {size / 2**20:.0f} MiB, {args.layers} layers", flush=True)
        stores = {"model store, plaintext port (fetch, verify, write)": ("bulk", 7790),
                  "model store over TLS (--weights-over-tls)": ("tls", 7792)}
        with netns.lan(2, net=78) as [(ns_a, ip_a), (ns_b, _)]:
            running = {}
            try:
                for name, (how, port) in stores.items():  # one by one: the first hashes, the second reads its cache
                    running[name] = subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, "-c", STORE,
                                                      str(model), ip_a, str(port), how], stdout=subprocess.PIPE,
                                                     text=True)  # `ip netns exec` execs: .pid is the store
                    manifest = running[name].stdout.readline().strip()  # once it is up
                rows = {name: [] for name in stores} | {"plain TCP, dropped": [], "plain TCP, written to a file": [],
                                                         "TLS stream, dropped": []}
                for k in range(args.runs):
                    for name, (_, port) in stores.items():
                        cache = work / f"cache-{k}"
                        store_cpu = cpu_seconds(running[name].pid)
                        out = netns.run(ns_b, [sys.executable, "-c", FETCH, f"{ip_a}:{port}", manifest, str(args.layers),
                                               str(cache)], timeout=600)
                        assert out.returncode == 0, out.stderr[-2000:]
                        rows[name].append({**json.loads(out.stdout.strip().splitlines()[-1]),
                                           "sender_cpu": cpu_seconds(running[name].pid) - store_cpu})
                        shutil.rmtree(cache)
                    rows["plain TCP, dropped"].append(tcp(ns_a, ip_a, ns_b, model / "model.safetensors", "-"))
                    sink = work / "sink"
                    rows["plain TCP, written to a file"].append(tcp(ns_a, ip_a, ns_b, model / "model.safetensors",
                                                                    str(sink)))
                    sink.unlink()
                    rows["TLS stream, dropped"].append(tcp(ns_a, ip_a, ns_b, model / "model.safetensors", "-", tls=True))
            finally:
                for p in running.values():
                    p.kill()
        best = {name: max(r["bytes"] / r["s"] for r in runs) for name, runs in rows.items()}
        for name, runs in rows.items():
            gib = runs[0]["bytes"] / 2**30
            recv, send = (min(r[k] for r in runs) / gib for k in ("cpu", "sender_cpu"))
            print(f"{name}: {best[name] / 2**20:.0f} MiB/s (best of {args.runs}); CPU s/GiB: "
                  f"receiver {recv:.2f}, sender {send:.2f}")
        for name in stores:
            # The whole fetch (TLS handshake, manifest, config, small files) and its bytes' part alone.
            moving = max(r["bytes"] / r["moving_s"] for r in rows[name])
            print(f"{name}: moving the bytes {moving / 2**20:.0f} MiB/s (best of {args.runs})")
            for what, rate in (("whole fetch", best[name]), ("moving the bytes", moving)):
                print(f"  {what} / plain TCP dropped: {rate / best['plain TCP, dropped']:.0%}; "
                      f"/ plain TCP written: {rate / best['plain TCP, written to a file']:.0%}; "
                      f"/ TLS stream: {rate / best['TLS stream, dropped']:.0%}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
