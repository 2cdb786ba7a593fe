"""`metal-cluster status` and `metal-cluster down`: read the coordinator's cluster snapshot and
vLLM's metrics over HTTP; drain and stop."""

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from metal_cluster.coordinator.cluster import cluster_state


class StatusError(RuntimeError):
    """One line for the user: what is wrong and what to do."""


def find_url(url: str | None) -> str:
    if url:
        return url.rstrip("/").removesuffix("/v1")
    running = cluster_state.local_coordinators()
    if not running:
        raise StatusError("no metal-cluster coordinator is running here (start one with `metal-cluster serve`, "
                          "or pass --url / set METAL_CLUSTER_URL)")
    return running[0]["url"]


def _get(url: str, timeout=5) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except (urllib.error.URLError, OSError) as e:
        raise StatusError(f"no coordinator answers at {url}: {getattr(e, 'reason', e)}") from None


def _post(url: str, timeout=5, body: bytes = b"") -> bytes:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()
    except (urllib.error.URLError, OSError) as e:
        raise StatusError(f"no coordinator answers at {url}: {getattr(e, 'reason', e)}") from None


def _metric(text: str, name: str) -> float:
    """Sum of a metric's samples over all label sets (vLLM labels by model and engine)."""
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M))


def collect(url: str, previous: dict | None = None) -> dict:
    snapshot = json.loads(_get(f"{url}/metal-cluster/status"))
    metrics = _get(f"{url}/metrics").decode()
    now = time.monotonic()
    generated = _metric(metrics, "vllm:generation_tokens_total")
    ttft_sum = _metric(metrics, "vllm:time_to_first_token_seconds_sum")
    ttft_count = _metric(metrics, "vllm:time_to_first_token_seconds_count")
    rate = 0.0
    if previous and now > previous["_at"]:
        rate = (generated - previous["_generated"]) / (now - previous["_at"])
    return {
        "url": url,
        "model": snapshot.get("model"),
        "draining": snapshot.get("draining", False),
        "nodes": snapshot.get("nodes", []),
        "stages": snapshot.get("stages", []),
        "cluster": {k: snapshot.get(k) for k in ("state", "reason", "replans", "stage_losses", "requests_held",
                                                      "requests_resumed", "requests_lost", "events", "last_replan")},
        "requests": {
            "running": int(_metric(metrics, "vllm:num_requests_running")),
            "waiting": int(_metric(metrics, "vllm:num_requests_waiting")),
        },
        "output_tokens_per_s": rate,
        "mean_ttft_s": ttft_sum / ttft_count if ttft_count else None,
        "speculative": speculative(metrics),
        "_generated": generated,
        "_at": now,
    }


def speculative(metrics: str) -> dict | None:
    """Speculative decoding so far, from vLLM's counters: the share of drafted tokens accepted and
    the mean tokens a request gains per verifying step (accepted drafts plus the step's own token)."""
    drafts = _metric(metrics, "vllm:spec_decode_num_drafts_total")
    if "vllm:spec_decode_num_drafts_total" not in metrics:
        return None  # served without --speculative-config
    drafted = _metric(metrics, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    return {"draft_steps": int(drafts), "drafted_tokens": int(drafted), "accepted_tokens": int(accepted),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None}


def public(view: dict) -> dict:
    return {k: v for k, v in view.items() if not k.startswith("_")}


def render(view: dict) -> Group:
    nodes = Table(title=f"metal-cluster at {view['url']} — {view['model']}" + (" (draining)" if view["draining"] else ""))
    for col in ("node", "address", "device", "memory", "state", "heartbeat", "rtt"):
        nodes.add_column(col)
    now = time.time()
    for n in view["nodes"]:
        age = f"{now - n['last_heartbeat']:.0f}s ago" if n["last_heartbeat"] else "never"
        memory = f"{n['memory_used_bytes'] / 2**30:.1f}/{n['memory_total_bytes'] / 2**30:.1f} GiB"
        state = f"[red]{n['state']}[/red]" if n["state"] == "down" else n["state"]
        nodes.add_row(n["name"], n["address"], n["device"], memory, state, age, f"{n['rtt_ms']:.1f} ms")
    stages = Table(title="stages")
    for col in ("stage", "node", "layers", "KV blocks used/total", "KV dtype", "last step", "weights fetched"):
        stages.add_column(col)
    for k, s in enumerate(view["stages"]):
        stages.add_row(str(k), s["node"], f"[{s['layers'][0]}, {s['layers'][1]})",
                       f"{s['kv_blocks_used']}/{s['kv_blocks_total']}", s.get("kv_dtype") or "-", f"{s['step_ms']:.0f} ms",
                       _fetched(s))
    r = view["requests"]
    ttft = f"{view['mean_ttft_s']:.2f}s" if view["mean_ttft_s"] is not None else "-"
    summary = (f"requests: {r['running']} running, {r['waiting']} waiting   "
               f"output: {view['output_tokens_per_s']:.1f} tokens/s   mean TTFT: {ttft}")
    spec = view.get("speculative")
    if spec and spec["drafted_tokens"]:
        summary += (f"   speculative: {spec['acceptance_rate']:.0%} of {spec['drafted_tokens']} drafted tokens accepted, "
                    f"{spec['mean_accepted_length']:.2f} tokens per verifying step")
    return Group(nodes, stages, summary, *_cluster_lines(view.get("cluster") or {}),
                 f"dashboard: {view['url']}/dashboard")


def _fetched(stage: dict) -> str:
    got, done, total = (stage.get(k) or 0 for k in ("weights_fetched_bytes", "fetch_bytes_done", "fetch_bytes_total"))
    text = f"{got / 2**20:.1f} MiB" if got else "-"
    if done < total:  # still loading
        text += f" (loading {done / 2**20:.1f}/{total / 2**20:.1f} MiB)"
    return text


def _cluster_lines(cluster: dict) -> list[str]:
    state = cluster.get("state") or "serving"
    lines = [f"cluster: {state}" + (f" — {cluster['reason']}" if cluster.get("reason") else "")
             + f"   stage losses: {cluster.get('stage_losses') or 0}   re-plans: {cluster.get('replans') or 0}"
             + f"   requests resumed: {cluster.get('requests_resumed') or 0}   lost: {cluster.get('requests_lost') or 0}"
             + (f"   held: {cluster['requests_held']}" if cluster.get("requests_held") else "")]
    if cluster.get("last_replan"):
        parts = cluster["last_replan"]
        lines.append("last re-plan: " + ", ".join(f"{k} {v:.2f}s" for k, v in parts.items()))
    for event in (cluster.get("events") or [])[-5:]:
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(event['time']))}  {event['message']}")
    return lines


def show(url: str, as_json: bool, watch: bool) -> None:
    first = collect(url)
    time.sleep(1)  # a second sample gives the recent output rate
    view = collect(url, first)
    if as_json and not watch:
        print(json.dumps(public(view), indent=2))
        return
    console = Console()
    if not watch:
        console.print(render(view))
        return
    with Live(render(view), console=console, refresh_per_second=2) as live:
        try:
            while True:
                time.sleep(1)
                view = collect(url, view)
                live.update(render(view))
        except KeyboardInterrupt:
            pass


def bring_down(url: str, timeout: float, workers_too: bool) -> None:
    console = Console(stderr=True)
    view = collect(url)
    _post(f"{url}/metal-cluster/drain")
    console.print(f"draining {url}: {view['requests']['running']} running request(s), up to {timeout:.0f}s")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and collect(url)["requests"]["running"] > 0:
        time.sleep(0.5)
    if workers_too:
        _stop_remote_workers(view, console)
    coordinator = next((c for c in cluster_state.local_coordinators() if c["url"] == url), None)
    if coordinator is None:
        raise StatusError(f"{url} is drained, but it is not a coordinator of this machine: stop it where it runs")
    pids = [coordinator["pid"], *coordinator.get("worker_pids", [])]
    os.kill(coordinator["pid"], signal.SIGTERM)  # its running requests end with an error; its workers stop too
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(cluster_state.pid_alive(p) for p in pids):
        time.sleep(0.3)
    left = [p for p in pids if cluster_state.pid_alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    console.print(f"stopped {url}" + (f" (killed {len(left)} process(es) that did not stop)" if left else ""))


def rebalance(url: str, peers: list[str], timeout: float, drain_timeout: float = 30.0) -> None:
    """Ask the coordinator to re-plan over its stages plus `peers`, and follow it to the end."""
    console = Console(stderr=True, soft_wrap=True)
    before = _cluster(url).get("replans") or 0
    asked = time.time()
    body = json.dumps({"peers": peers, "drain_timeout": drain_timeout}).encode()
    answer = json.loads(_post(f"{url}/metal-cluster/rebalance", timeout=30, body=body))
    console.print(f"{url}: {answer['rebalance']}" + (f" with {', '.join(peers)}" if peers else ""))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1)
        cluster = _cluster(url)
        last_event = (cluster.get("events") or [{"time": 0}])[-1]["time"]
        if cluster.get("state") == "unavailable" and last_event > asked:
            raise StatusError(cluster.get("reason") or "the cluster cannot serve the model")
        if cluster.get("state") == "serving" and (cluster.get("replans") or 0) > before:
            console.print(cluster["events"][-1]["message"] if cluster.get("events") else "serving")
            return
    raise StatusError(f"the re-plan did not finish in {timeout:.0f}s; see `metal-cluster status`")


def _cluster(url: str) -> dict:
    """The coordinator's cluster state: serving, healing or unavailable, with counters and events."""
    return json.loads(_get(f"{url}/metal-cluster/status"))


def _stop_remote_workers(view, console):
    from metal_cluster.coordinator.cluster.stages import RemoteStage, StageCallError

    for node in view["nodes"]:
        if node["address"] == "local":
            continue
        try:
            stage = RemoteStage(node["address"])
        except StageCallError as e:  # no token here: nothing to prove this host is of the cluster
            console.print(f"worker {node['address']} did not stop: {e}")
            continue
        try:
            stage.shutdown()
            console.print(f"stopped worker {node['address']}")
        except StageCallError as e:
            console.print(f"worker {node['address']} did not stop: {e}")
        finally:
            stage.close()
