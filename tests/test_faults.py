"""Faults on a real 3-stage cluster of local worker processes: a stage killed (SIGKILL) or frozen
(SIGSTOP) during 8 streams. Every stream pauses and resumes on the re-planned cluster where it stopped,
token-exact; the requests sent meanwhile are held and answered by it too; `status` and /metrics show
the new plan and the resumed requests; no KV block is left behind. Then: all stages lost (a clear 503), and a
worker brought back by `metal-cluster rebalance`."""

import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from mlx_lm.utils import load

from metal_cluster.coordinator.cluster import cluster_state
from references import mlx_lm_greedy
from server_process import free_port, running_server

CLI = [sys.executable, "-m", "metal_cluster.coordinator"]
TOKEN = "faults-test-token"
ARGS = ["--gpu-memory-utilization", "0.05", "--max-model-len", "512", "--max-num-batched-tokens", "64",
        "--max-num-seqs", "16", "--served-model-name", "m"]  # the default stage timeout (0.75 s)
PROMPTS = ["Hello world, this is a test", "The quick brown fox", "Numbers 12345 and 67890", "A",
           "Tea or coffee?", "Pipeline stages overlap", "Short", "One more prompt here"]
LONG = 400  # tokens per stream: long enough to be running when the stage goes
RESUMED = 256  # tokens per stream that goes through a lost stage


@pytest.fixture(scope="module")
def references(llama_model):
    """The prompts, what mlx-lm's greedy generation gives for each (the run no stage is lost in), and
    the tokenizer's decoding."""
    ref_model, tokenizer = load(str(llama_model))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731 (as vLLM's text)
    return prompts, [mlx_lm_greedy(ref_model, ids, RESUMED) for ids in prompts], decode


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("METAL_CLUSTER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("METAL_CLUSTER_TOKEN", TOKEN)
    monkeypatch.delenv("METAL_CLUSTER_URL", raising=False)
    return tmp_path


def cli(*args, timeout=120):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def status_json(url):
    result = cli("status", "--json", "--url", url)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def client_for(url, timeout=120):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=timeout, max_retries=0)


def greedy(client, ids, n):
    r = client.completions.create(model="m", prompt=ids, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].token_ids


def stream(client, ids, started):
    """('done', tokens) or ('error', message), and when it ended."""
    tokens = []
    try:
        chunks = client.completions.create(model="m", prompt=ids, max_tokens=LONG, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        for c in chunks:
            tokens += c.choices[0].token_ids or []
            started.set()
        return "done", tokens, time.monotonic()
    except openai.APIError as e:
        return "error", str(e), time.monotonic()


def wait_for(predicate, timeout, what, every=0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout}s")


def metric(url, name):
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M))


class Stream:
    """One greedy stream of RESUMED tokens, its chunks kept as they came."""

    def __init__(self, client, ids):
        self.ids, self.chunks, self.texts, self.finish, self.error = ids, [], [], None, None
        self.thread = threading.Thread(target=self._read, args=(client,), daemon=True)
        self.thread.start()

    def _read(self, client):
        try:
            for c in client.completions.create(model="m", prompt=self.ids, max_tokens=RESUMED, temperature=0,
                                               stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True}):
                choice = c.choices[0]
                self.chunks.append(list(choice.token_ids or []))
                self.texts.append(choice.text)
                self.finish = choice.finish_reason or self.finish
        except openai.APIError as e:
            self.error = str(e)

    @property
    def tokens(self) -> list[int]:
        return [t for chunk in list(self.chunks) for t in chunk]


class RawStream:
    """A stream over a bare socket, so that the test can hang up on it at any moment."""

    def __init__(self, url, ids):
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        body = json.dumps({"model": "m", "prompt": ids, "max_tokens": RESUMED, "temperature": 0, "stream": True,
                           "ignore_eos": True})
        self.conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        self.response = self.conn.getresponse()
        self.response.readline()  # the first chunk: it is running

    def hang_up(self):
        self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()


def status_http(url):
    with urllib.request.urlopen(f"{url}/metal-cluster/status", timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_lost_stage_pauses_every_stream_and_the_cluster_heals(llama_model, env, fault, references):
    """Kill -9 (or freeze past the stage timeout) the middle of 3 stages during 8 greedy streams:
    every stream pauses and goes on from where it stopped on the 2 stages left, token-exact, with no
    gap or repeat in its chunks. A client that hangs up during the pause frees its hold at once. A
    frozen stage that wakes later is fenced: it resets itself and the new ring serves on."""
    prompts, expected, decode = references
    with running_server(llama_model, *ARGS, "-pp", "3", log_path=env / "server.log") as url:
        client = client_for(url)
        victim = cluster_state.local_coordinators()[0]["worker_pids"][1]
        try:
            streams = [Stream(client, ids) for ids in prompts]
            leaver = RawStream(url, prompts[0])
            wait_for(lambda: all(s.tokens for s in streams), 60, "every stream running")
            if fault == "SIGSTOP":  # a freeze shorter than the stage timeout is no loss
                os.kill(victim, signal.SIGSTOP)
                time.sleep(0.5)
                os.kill(victim, signal.SIGCONT)
                time.sleep(1.5)  # past the stage timeout, and heartbeats answered again
                assert not _held_lines(env), "a 0.5 s freeze counted as a lost stage"
            os.kill(victim, getattr(signal, fault))
            faulted = time.monotonic()
            at_fault = [len(s.tokens) for s in streams]
            assert all(n < RESUMED for n in at_fault), at_fault  # all of them were mid-stream
            # The pause: all 9 held; the one whose client hangs up frees its hold while the cluster
            # heals. A re-plan can take little more than a second, so the hang-up comes as soon as
            # the hold is seen: in the server's log, which a loaded machine cannot make the test miss
            # as it can a poll of the status gauge. Only 8 requests resume (below).
            wait_for(lambda: "9" in _held_lines(env), 30, "9 requests held", every=0.02)
            leaver.hang_up()
            wait_for(lambda: "8" in _held_lines(env), 5, "the hung-up request let go", every=0.02)
            # Sent once the loss is known, while the cluster heals: held, then answered by the new plan.
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                held = list(pool.map(lambda ids: greedy(client_for(url, 180), ids, 10), prompts[:2]))
            for s in streams:
                s.thread.join(120)
            assert held == [e[:10] for e in expected[:2]]
            for s, want, n in zip(streams, expected, at_fault):
                assert s.error is None, s.error
                assert s.finish == "length"
                assert s.tokens == want, f"paused at {n} tokens; the stream differs from the unhit run"
                assert "".join(s.texts) == decode(want)
            if fault == "SIGSTOP":  # it wakes up on a plan that is gone: fenced, it resets itself idle
                resets = _resets(env)
                os.kill(victim, signal.SIGCONT)
                wait_for(lambda: _resets(env) == resets + 1, 30, "the woken stage reset")
                wait_for(lambda: any("answers again" in e["message"] for e in status_http(url)["events"]), 30,
                         "the woken stage seen and fenced")
            assert time.monotonic() - faulted < 120
        finally:
            with contextlib.suppress(ProcessLookupError):
                if fault == "SIGSTOP" and cluster_state.pid_alive(victim):
                    os.kill(victim, signal.SIGCONT)
        # Serving on the two stages left, token-exact.
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda ids: greedy(client, ids, 10), prompts))
        assert got == [e[:10] for e in expected]
        view = status_json(url)
        assert view["cluster"]["state"] == "serving" and view["cluster"]["replans"] == 1
        assert view["cluster"]["stage_losses"] >= 1
        assert view["cluster"]["requests_resumed"] == 8 and view["cluster"]["requests_lost"] == 0
        assert [s["layers"] for s in view["stages"]] == [[0, 2], [2, 4]]
        assert any("re-planned" in e["message"] for e in view["cluster"]["events"])
        assert metric(url, "metal_cluster_replans_total") == 1
        assert metric(url, "metal_cluster_requests_resumed_total") == 8
        assert metric(url, "metal_cluster_requests_lost_total") == 0
        # Nothing leaked: no KV block held on any stage or in vLLM once the traffic is over.
        wait_for(lambda: all(s["kv_blocks_used"] == 0 for s in status_json(url)["stages"]), 20, "stage KV freed")
        assert metric(url, "vllm:kv_cache_usage_perc") == 0
        assert "re-planned" in (env / "server.log").read_text()


def _held_lines(env) -> list[str]:
    """The held-request counts the server logged, in order."""
    return re.findall(r"requests held for the new plan: (\d+)", (env / "server.log").read_text())


def _resets(env) -> int:
    """Stage workers that have reset themselves so far (their log goes to the server's)."""
    return (env / "server.log").read_text().count("restarting this worker process idle")


def test_no_stage_left_is_a_clear_503_until_rebalance(llama_model, env):
    ref_model, tokenizer = load(str(llama_model))
    ids = tokenizer.encode(PROMPTS[0])
    with running_server(llama_model, *ARGS, "-pp", "2", log_path=env / "server.log") as url:
        client = client_for(url)
        running = Stream(client, ids)  # held through the loss, then ended: no plan can take it
        wait_for(lambda: running.tokens, 60, "the stream running")
        for pid in cluster_state.local_coordinators()[0]["worker_pids"]:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: status_json(url)["cluster"]["state"] == "unavailable", 60, "unavailable")
        running.thread.join(30)
        assert not running.thread.is_alive(), "the held stream hangs"
        assert running.error and "no stage worker is left" in running.error, running.error
        assert "total" in status_json(url)["cluster"]["last_replan"]  # the failed re-plan's timings
        began = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            greedy(client, ids, 5)
        assert refused.value.status_code == 503 and time.monotonic() - began < 5
        assert "no stage worker is left" in refused.value.message and "rebalance" in refused.value.message
        with pytest.raises(urllib.error.HTTPError) as unhealthy:
            urllib.request.urlopen(f"{url}/health", timeout=10)
        assert unhealthy.value.code == 503
        # An operator brings a worker back and asks for a re-plan.
        port = free_port()
        log = open(env / "worker.log", "w")
        worker = subprocess.Popen([*CLI, "worker", "--port", str(port), "--ring-port", str(free_port()),
                                   "--no-advertise"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            result = cli("rebalance", "--url", url, "--peers", f"127.0.0.1:{port}", "--discovery-timeout", "60",
                         timeout=300)
            assert result.returncode == 0, result.stderr
            assert greedy(client, ids, 10) == mlx_lm_greedy(ref_model, ids, 10)
            view = status_json(url)
            assert view["cluster"]["state"] == "serving"
            assert [n["address"] for n in view["nodes"]] == [f"127.0.0.1:{port}"]
        finally:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)


def test_workers_outlive_a_coordinator_restart(llama_model, env):
    """Kill -9 the coordinator of two remote workers; a new `up` finds them busy but orphaned,
    resets them and serves, and the workers were never restarted by anyone."""
    ref_model, tokenizer = load(str(llama_model))
    ids = tokenizer.encode(PROMPTS[2])
    ports = [free_port() for _ in range(4)]
    log = open(env / "workers.log", "w")
    workers = [subprocess.Popen([*CLI, "worker", "--port", str(ports[k]), "--ring-port", str(ports[k + 2]),
                                 "--no-advertise"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
               for k in range(2)]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports[:2])
    up = [llama_model, "--peers", peers, "--no-mdns", "--no-local-worker", "--discovery-timeout", "60", *ARGS]
    try:
        with running_server(*up, log_path=env / "up-1.log", command="up") as url:
            assert greedy(client_for(url), ids, 10) == mlx_lm_greedy(ref_model, ids, 10)
            coordinator = cluster_state.local_coordinators()[0]["pid"]
            os.killpg(coordinator, signal.SIGKILL)  # no goodbye to the workers
        with running_server(*up, log_path=env / "up-2.log", command="up") as url:
            assert greedy(client_for(url), ids, 10) == mlx_lm_greedy(ref_model, ids, 10)
        # The same processes all along (the log says why one is gone).
        assert all(w.poll() is None for w in workers), (env / "workers.log").read_text()[-4000:]
        assert "by a coordinator that is gone" in (env / "up-2.log").read_text()
        assert "restarting this worker process idle" in (env / "workers.log").read_text()
    finally:
        for w in workers:
            with contextlib.suppress(ProcessLookupError):  # gone already: the assert above said so
                os.killpg(w.pid, signal.SIGKILL)
            w.wait(10)


def test_rebalance_lets_running_requests_finish(llama_model, env):
    """A re-plan the operator asks for: the running stream finishes whole on the old plan, a request
    sent meanwhile waits for the new one, and the new worker joins the plan."""
    import threading

    ref_model, tokenizer = load(str(llama_model))
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    port = free_port()
    log = open(env / "worker.log", "w")
    worker = subprocess.Popen([*CLI, "worker", "--port", str(port), "--ring-port", str(free_port()),
                               "--no-advertise"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with running_server(llama_model, *ARGS, "-pp", "2", log_path=env / "server.log") as url, \
                concurrent.futures.ThreadPoolExecutor(2) as pool:
            client = client_for(url)
            first = threading.Event()
            running = pool.submit(stream, client, prompts[0], first)
            assert first.wait(60)
            body = json.dumps({"peers": [f"127.0.0.1:{port}"], "drain_timeout": 60}).encode()
            asked = urllib.request.Request(f"{url}/metal-cluster/rebalance", data=body, method="POST")
            with urllib.request.urlopen(asked, timeout=30) as r:
                assert json.loads(r.read())["rebalance"] == "draining, then re-planning"
            held = pool.submit(greedy, client, prompts[1], 10)
            kind, tokens, ended = running.result(timeout=120)
            assert kind == "done" and tokens == mlx_lm_greedy(ref_model, prompts[0], LONG)
            assert held.result(timeout=120) == mlx_lm_greedy(ref_model, prompts[1], 10)
            view = wait_for(lambda: (v := status_json(url))["cluster"]["replans"] == 1 and v, 60, "re-plan")
            assert len(view["stages"]) == 3 and f"127.0.0.1:{port}" in [n["address"] for n in view["nodes"]]
            events = [e["message"] for e in view["cluster"]["events"]]
            assert events[0].startswith("draining") and any("re-planned" in e for e in events)
            assert view["cluster"]["stage_losses"] == 0
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)


def test_local_workers_take_no_port_promised_to_the_api_server():
    """The API server binds its port only after the local workers are up: a worker that drew the
    same free port took it first (a CI run's `Address already in use`)."""
    from metal_cluster.coordinator.cluster.local_workers import _free_ports

    even = tuple(range(0, 65536, 2))
    ports = _free_ports(20, "127.0.0.1", avoid=even)
    assert len(set(ports)) == 20 and all(p % 2 for p in ports)


def test_local_workers_go_with_their_server(llama_model, env):
    """`serve -pp` killed with -9 (no cleanup of its own): its stage workers stop by themselves."""
    with running_server(llama_model, *ARGS, "-pp", "2", log_path=env / "server.log"):
        coordinator = cluster_state.local_coordinators()[0]
        os.kill(coordinator["pid"], signal.SIGKILL)
        wait_for(lambda: not any(cluster_state.pid_alive(p) for p in coordinator["worker_pids"]), 20,
                 "local workers gone")
