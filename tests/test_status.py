"""`metal-cluster status`, `down` and the dashboard against a real 2-stage cluster."""

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from metal_cluster.coordinator.cluster import cluster_state
from server_process import running_server

CLI = [sys.executable, "-m", "metal_cluster.coordinator"]
API_KEY = "test-key"
ARGS = ["--gpu-memory-utilization", "0.05", "--max-model-len", "512", "--max-num-batched-tokens", "64",
        "--served-model-name", "m", "-pp", "2", "--api-key", API_KEY]


def cli(*args, timeout=120):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def status_json():
    result = cli("status", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("METAL_CLUSTER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("METAL_CLUSTER_URL", raising=False)
    return tmp_path


def test_status_with_no_cluster_is_one_line(own_cache):
    result = cli("status")
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "no metal-cluster coordinator" in result.stderr


def test_status_during_traffic_then_down(llama_model, own_cache):
    with running_server(llama_model, *ARGS, log_path=own_cache / "server.log") as url:
        coordinator = cluster_state.local_coordinators()[0]
        assert coordinator["url"] == url and len(coordinator["worker_pids"]) == 2
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, timeout=120, max_retries=0)

        def long_request(i):
            return client.completions.create(model="m", prompt=f"story {i}", max_tokens=400, temperature=0,
                                              extra_body={"ignore_eos": True})

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(long_request, i) for i in range(3)]
            deadline = time.monotonic() + 60
            while True:
                view = status_json()
                if view["requests"]["running"] == 3 and all(s["kv_blocks_used"] > 0 for s in view["stages"]):
                    break
                assert time.monotonic() < deadline, view
                time.sleep(0.5)
            assert [s["layers"] for s in view["stages"]] == [[0, 2], [2, 4]]
            assert all(s["kv_blocks_total"] > 0 for s in view["stages"])
            assert [n["state"] for n in view["nodes"]] == ["serving", "serving"]
            assert view["requests"]["waiting"] == 0
            assert f"dashboard: {url}/dashboard" in cli("status").stdout
            check_dashboard(url, own_cache, client)
            for f in futures:
                f.result(timeout=300)
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert 'metal_cluster_stage_kv_blocks_total{stage="1"' in metrics and "vllm:num_requests_running" in metrics
        assert status_json()["requests"]["running"] == 0

        result = cli("down", "--timeout", "20", timeout=180)
        assert result.returncode == 0, result.stderr
        pids = [coordinator["pid"], *coordinator["worker_pids"]]
        assert not [p for p in pids if cluster_state.pid_alive(p)]
        assert cli("status").returncode != 0


def check_dashboard(url, out_dir, client):
    """The page in headless Chromium while requests run: two stages with their layer ranges, a
    tokens/s figure that moves; a screenshot beside the server log. Without the API key: 401."""
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{url}/dashboard", timeout=10)
    assert refused.value.code == 401 and b"?key=" in refused.value.read()
    with urllib.request.urlopen(f"{url}/", timeout=10) as r:
        assert b'href="/dashboard"' in r.read()
    chromium = shutil.which("chromium")
    if chromium is None:
        assert not os.environ.get("METAL_CLUSTER_TEST_INSTALL"), "CI installs chromium (.ci/run)"
        pytest.skip("no chromium here (apt-get install --no-install-recommends chromium)")
    import threading

    from headless import browser

    stop = threading.Event()

    def traffic():  # requests keep running for as long as the page is watched
        while not stop.is_set():
            client.completions.create(model="m", prompt="more", max_tokens=48, temperature=0,
                                      extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(2) as pool, \
            browser(f"{url}/dashboard?key={API_KEY}", out_dir / "chromium-profile") as page:
        load = [pool.submit(traffic) for _ in range(2)]
        try:
            deadline = time.monotonic() + 90
            while True:  # one poll a second; tok/s is the change between two polls
                history = [float(v) for v in (page.evaluate(
                    "document.getElementById('toks')?.dataset.history || ''") or "").split()]
                if len(history) >= 4 and len(set(history[1:])) >= 2 and max(history) > 0:
                    break  # it moves while requests run
                assert time.monotonic() < deadline, (history, page.evaluate("document.body.innerText"))
                time.sleep(0.5)
            stages = page.evaluate("[...document.querySelectorAll('#stages g.stage')].map(g => "
                                   "[g.dataset.start, g.dataset.end, g.querySelector('text.layers').textContent])")
            assert stages == [["0", "2", "stage 0: layers 0–2"], ["2", "4", "stage 1: layers 2–4"]], stages
            shot = out_dir / "dashboard.png"
            page.screenshot(shot)
        finally:
            stop.set()
        for f in load:
            f.result(timeout=120)
    assert shot.stat().st_size > 10_000
    print(f"dashboard screenshot: {shot}")


def test_status_shows_a_dead_worker(llama_model, own_cache):
    # A stage timeout long enough for the dead worker to stay in the plan while `status` looks.
    with running_server(llama_model, *ARGS, "--stage-timeout", "60", log_path=own_cache / "server.log"):
        coordinator = cluster_state.local_coordinators()[0]
        os.kill(coordinator["worker_pids"][1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            states = [n["state"] for n in status_json()["nodes"]]
            if states == ["serving", "down"]:
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.5)
        human = cli("status")
        assert human.returncode == 0 and "down" in human.stdout
