"""Cluster routes on vLLM's API server (installed with vLLM's --middleware hook):

  GET  /                       a page linking the dashboard and the API
  GET  /dashboard              the cluster drawn (dashboard.html; needs the --api-key when one is set)
  GET  /metal-cluster/status   the nodes/stages snapshot the executor keeps
  POST /metal-cluster/drain    stop admitting new requests (503); running ones finish
  POST /metal-cluster/rebalance  re-plan over the stages plus {"peers": ["host:port", ...]}, after
                               running requests finish (up to "drain_timeout" seconds, default 30)
  GET  /metrics                vLLM's metrics plus per-stage cluster gauges

While the cluster cannot hold the model (stages lost, too few hosts left) new requests get a 503
that says why, at once, instead of waiting for a plan that is not coming.
"""

import hmac
import json
import os
from importlib import resources
from pathlib import Path

from starlette.responses import HTMLResponse, JSONResponse, Response

from metal_cluster.coordinator.cluster.cluster_state import RUN_DIR_ENV, SNAPSHOT, read_json

STATE_VALUES = {"serving": 1, "loaded": 2, "idle": 3, "down": 0}
# The server's --api-key values, one per line (set by serve.run before the app starts).
API_KEYS_ENV = "METAL_CLUSTER_API_KEYS"
# With --enable-lora: {"model": folder, "max_rank": --max-lora-rank}, for checking adapters loaded at run time.
LORA_CHECK_ENV = "METAL_CLUSTER_LORA_CHECK"
INDEX = """<!doctype html><meta charset="utf-8"><title>metal-cluster</title>
<p>metal-cluster: <a href="/dashboard">dashboard</a> · OpenAI API at <code>/v1</code>
(<a href="/v1/models">models</a>, <a href="/docs">docs</a>) · <a href="/metrics">metrics</a></p>"""


def _api_keys() -> list[str]:
    keys = [k for k in os.environ.get(API_KEYS_ENV, "").splitlines() if k]
    return keys + ([os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else [])


def _authorized(request) -> bool:
    """With --api-key set: `Authorization: Bearer KEY`, or `?key=KEY` for a browser's address bar."""
    keys = _api_keys()
    if not keys:
        return True
    header = request.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else request.query_params.get("key", "")
    return any(hmac.compare_digest(given.encode(), k.encode()) for k in keys)


def _dashboard(request):
    if not _authorized(request):
        return _error(401, "the dashboard needs the server's API key: open /dashboard?key=YOUR_KEY", "Unauthorized")
    page = resources.files("metal_cluster.coordinator.api").joinpath("dashboard.html").read_text(encoding="utf-8")
    return HTMLResponse(page)


def _snapshot() -> dict | None:
    run_dir = os.environ.get(RUN_DIR_ENV)
    return read_json(Path(run_dir) / SNAPSHOT) if run_dir else None


def _gauges(snapshot: dict) -> str:
    lines = [
        "# HELP metal_cluster_stage_kv_blocks_used KV blocks held by running requests on a stage.",
        "# TYPE metal_cluster_stage_kv_blocks_used gauge",
        "# HELP metal_cluster_stage_kv_blocks_total KV blocks a stage holds.",
        "# TYPE metal_cluster_stage_kv_blocks_total gauge",
        "# HELP metal_cluster_stage_step_seconds Time of the last step on a stage.",
        "# TYPE metal_cluster_stage_step_seconds gauge",
        "# HELP metal_cluster_stage_ring_bytes_sent_total Hidden-state bytes a stage sent to the next.",
        "# TYPE metal_cluster_stage_ring_bytes_sent_total counter",
        "# HELP metal_cluster_node_up 1 when a node answers heartbeats.",
        "# TYPE metal_cluster_node_up gauge",
        "# HELP metal_cluster_serving 1 when the cluster serves, 0 while it re-plans or cannot hold the model.",
        "# TYPE metal_cluster_serving gauge",
        f"metal_cluster_serving {int(snapshot.get('state', 'serving') == 'serving')}",
        "# HELP metal_cluster_stage_losses_total Stages lost (dead or silent past the stage timeout).",
        "# TYPE metal_cluster_stage_losses_total counter",
        f"metal_cluster_stage_losses_total {snapshot.get('stage_losses', 0)}",
        "# HELP metal_cluster_requests_held Requests that were running when a stage was lost, waiting for the new plan.",
        "# TYPE metal_cluster_requests_held gauge",
        f"metal_cluster_requests_held {snapshot.get('requests_held', 0)}",
        "# HELP metal_cluster_requests_resumed_total Requests resumed on a new plan where they stopped after a lost stage.",
        "# TYPE metal_cluster_requests_resumed_total counter",
        f"metal_cluster_requests_resumed_total {snapshot.get('requests_resumed', 0)}",
        "# HELP metal_cluster_requests_lost_total Requests ended with a retryable error by a lost stage (no room on "
        "the new plan, or past --resume-timeout).",
        "# TYPE metal_cluster_requests_lost_total counter",
        f"metal_cluster_requests_lost_total {snapshot.get('requests_lost', 0)}",
        "# HELP metal_cluster_replans_total New plans put in place after a loss or a rebalance.",
        "# TYPE metal_cluster_replans_total counter",
        f"metal_cluster_replans_total {snapshot.get('replans', 0)}",
    ]
    for k, stage in enumerate(snapshot.get("stages", [])):
        label = f'stage="{k}",node="{stage["node"]}",layers="{stage["layers"][0]}-{stage["layers"][1]}"'
        lines += [
            f"metal_cluster_stage_kv_blocks_used{{{label}}} {stage['kv_blocks_used']}",
            f"metal_cluster_stage_kv_blocks_total{{{label}}} {stage['kv_blocks_total']}",
            f"metal_cluster_stage_step_seconds{{{label}}} {stage['step_ms'] / 1000}",
            f"metal_cluster_stage_ring_bytes_sent_total{{{label}}} {stage['ring_bytes_sent']}",
        ]
    for node in snapshot.get("nodes", []):
        lines.append(f'metal_cluster_node_up{{node="{node["name"]}",address="{node["address"]}"}} '
                     f'{int(node["state"] != "down")}')
    return "\n".join(lines) + "\n"


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


async def cluster_routes(request, call_next):
    path, method = request.url.path, request.method
    state = request.app.state
    if path == "/dashboard" and method == "GET":
        return _dashboard(request)
    if path == "/" and method == "GET":
        return HTMLResponse(INDEX)
    if path == "/metal-cluster/status" and method == "GET":
        snapshot = _snapshot()
        if snapshot is None:
            return _error(503, "the cluster snapshot is not ready yet", "ServiceUnavailable")
        return JSONResponse({**snapshot, "draining": getattr(state, "metal_cluster_draining", False)})
    if path == "/metal-cluster/drain" and method == "POST":
        state.metal_cluster_draining = True
        return JSONResponse({"draining": True})
    if path == "/metal-cluster/rebalance" and method == "POST":
        return await _rebalance(request)
    if path == "/v1/load_lora_adapter" and method == "POST" and os.environ.get(LORA_CHECK_ENV):
        refused = await _check_lora_adapter(request)
        if refused is not None:
            return refused
    if method == "POST" and path.startswith("/v1/") and getattr(state, "metal_cluster_draining", False):
        return _error(503, "this server is shutting down and takes no new requests", "ServiceUnavailable")
    if (method == "POST" and path.startswith("/v1/")) or (method == "GET" and path == "/health"):
        snapshot = _snapshot()
        if snapshot and snapshot.get("state") == "unavailable":
            return _error(503, snapshot.get("reason") or "the cluster cannot serve the model now", "ServiceUnavailable")
    response = await call_next(request)
    if path == "/metrics" and method == "GET" and response.status_code == 200:
        body = b"".join([chunk async for chunk in response.body_iterator])
        snapshot = _snapshot()
        extra = _gauges(snapshot).encode() if snapshot else b""
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        return Response(body + extra, status_code=200, headers=headers)
    return response



async def _check_lora_adapter(request):
    """A 400 naming what is wrong with an adapter (a missing file, a rank over --max-lora-rank, a
    module the model lacks), where vLLM would answer the engine's exception as a 500."""
    import asyncio

    from metal_cluster.coordinator.engine.lora_adapters import LoRAAdapterError, read_adapter

    try:
        body = json.loads(await request.body() or b"{}")
        name, path = body.get("lora_name"), body.get("lora_path")
    except (json.JSONDecodeError, AttributeError):
        return None  # vLLM's own validation answers it
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        return None
    check = json.loads(os.environ[LORA_CHECK_ENV])
    try:
        await asyncio.to_thread(read_adapter, path, name, check["model"], check["max_rank"])
    except LoRAAdapterError as e:
        return _error(400, str(e), "BadRequestError")
    return None


async def _rebalance(request):
    try:
        body = json.loads(await request.body() or b"{}")
        peers, drain = body.get("peers", []), body.get("drain_timeout", 30)
    except (json.JSONDecodeError, AttributeError):
        peers = drain = None
    if (not isinstance(peers, list) or not all(isinstance(p, str) and ":" in p for p in peers)
            or not isinstance(drain, (int, float)) or drain < 0):
        return _error(400, 'the body must be {"peers": ["host:port", ...], "drain_timeout": seconds}',
                      "BadRequestError")
    answers = await request.app.state.engine_client.collective_rpc("rebalance", args=(peers, float(drain)))
    return JSONResponse({"rebalance": answers[0] if answers else "not supported by this engine", "peers": peers})
