"""`metal-cluster up` across three hosts made of network namespaces: Bonjour discovery alone, or
static --peers with mDNS off; placement over 3 stages; token-exact answers through the openai client."""

import json
import os
import re
import struct
import sys
import time

import pytest
from mlx_lm.utils import load

import netns
from references import mlx_lm_greedy

WHY_NOT = netns.can_create_namespaces()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"needs network namespaces: {WHY_NOT}")

TOKEN = "netns-test-token"
PY = [sys.executable, "-m", "metal_cluster.coordinator"]
PROMPTS = ["Hello world, this is a test", "The quick brown fox jumps over the lazy dog", "Numbers 12345"]
CLIENT = """
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="unused", timeout=120, max_retries=0)
out = []
for ids in json.loads(sys.argv[2]):
    r = c.completions.create(model="m", prompt=ids, max_tokens=10, temperature=0,
                             extra_body={"ignore_eos": True, "return_token_ids": True})
    out.append(r.choices[0].token_ids)
c2 = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
out.append(bool(c2.choices[0].message.content is not None))
print(json.dumps(out))
"""


@pytest.fixture
def lan():
    with netns.lan(5) as members:
        yield members


def start_worker(ns, address, tmp_path, token=TOKEN, hide=None, disk=None):
    """A worker with a cache of its own; `hide`: a folder it cannot see (an empty tmpfs over it), so
    that the model is on the coordinator's disk only; `disk`: its cache on a disk of that size."""
    cmd = [*PY, "worker", "--host", address, "--port", "7760", "--ring-port", "7761", "--cluster-token", token]
    cache = tmp_path / f"cache-{address}"
    # `ip netns exec` gives the command a mount namespace of its own: the host keeps its view.
    mounts = [f'mount -t tmpfs none "{hide}"'] if hide else []
    if disk:
        cache.mkdir()
        mounts.append(f'mount -t tmpfs -o size={disk} none "{cache}"')
    if mounts:
        cmd = ["sh", "-c", " && ".join([*mounts, 'exec "$@"']), "sh", *cmd]
    return netns.popen(ns, cmd, tmp_path / f"worker-{address}.log", env={**os.environ, "METAL_CLUSTER_CACHE": str(cache)})


def fetched(log_path):
    """(layers, bytes the worker fetched) for its last assignment, from its log: since the load
    before it, as `up` first asks for room (and the small files come then), then assigns."""
    text = log_path.read_text()
    assigned = text.rindex("assigned layers")
    last = text[max(0, text.rfind("loaded: ", 0, assigned)):]
    layers = tuple(int(x) for x in re.search(r"assigned layers \[(\d+), (\d+)\)", text[assigned:]).groups())
    return layers, sum(int(n) for n in re.findall(r"fetched (\d+) bytes", last))


def tensor_range(model, prefix):
    """(name, length) of the first tensor whose name starts with `prefix`."""
    with open(model / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    name, (a, b) = next((k, i["data_offsets"]) for k, i in header.items() if k.startswith(prefix))
    return name, b - a


def stage_share(model, start, end, num_layers=4, had=None):
    """Bytes a stage of the (untied) llama fetches: its tensors (less those of the layers it `had`),
    from the checkpoint's header read here, and the small files (0 with `had`)."""
    with open(model / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))

    def wanted(name, start, end):
        if name.startswith("model.layers."):
            return start <= int(name.split(".")[2]) < end
        return start == 0 if name.startswith("model.embed_tokens.") else end == num_layers

    tensors = sum(i["data_offsets"][1] - i["data_offsets"][0] for k, i in header.items()
                  if k != "__metadata__" and wanted(k, start, end) and not (had and wanted(k, *had)))
    rest = sum(p.stat().st_size for p in model.iterdir() if p.suffix != ".safetensors")  # no header: tensors alone
    return tensors, 0 if had else rest


def wait_healthy(ns, url, proc, log, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(log).read()[-4000:]
        if netns.run(ns, ["curl", "-sf", f"{url}/health"], timeout=10).returncode == 0:
            return
        time.sleep(1)
    raise AssertionError("up never became healthy:\n" + open(log).read()[-4000:])


def check_cluster(lan, tmp_path, model, up_flags, start_workers=True, log_name="up.log", no_room=False):
    """`no_room`: a fifth host whose disk holds the small files but not a layer is in the plan first."""
    (ns_a, ip_a), (ns_b, ip_b), (ns_c, ip_c), (ns_d, ip_d), (ns_e, ip_e) = lan
    capture_path = tmp_path / f"{log_name}.capture"
    capture = netns.popen(netns.bridge_namespace(), [sys.executable, "-c", netns.CAPTURE, str(capture_path)],
                          tmp_path / f"{log_name}.capture.log")
    if start_workers:
        for ns, ip in ((ns_b, ip_b), (ns_c, ip_c)):
            start_worker(ns, ip, tmp_path, hide=model)  # no copy of the model: they fetch their layers
        start_worker(ns_d, ip_d, tmp_path, token="not-the-token")  # must be left out
        if no_room:  # room for the small files, not for a layer: it refuses, and `up` plans without it
            start_worker(ns_e, ip_e, tmp_path, hide=model, disk="128k")
    log = tmp_path / log_name
    up = netns.popen(ns_a, [*PY, "up", str(model), "--interface", ip_a, "--host", ip_a, "--port", "8000",
                            "--cluster-token", TOKEN, "--gpu-memory-utilization", "0.05", "--max-model-len", "512",
                            "--max-num-batched-tokens", "64", "--served-model-name", "m", *up_flags], log)
    url = f"http://{ip_a}:8000"
    wait_healthy(ns_a, url, up, log)
    ref_model, tokenizer = load(str(model))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    result = netns.run(ns_a, [sys.executable, "-c", CLIENT, f"{url}/v1", json.dumps(prompts)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    assert answers[:-1] == [mlx_lm_greedy(ref_model, ids, 10) for ids in prompts]
    assert answers[-1] is True
    capture.terminate()
    capture.wait(10)
    text = log.read_text()
    left_out = [line for line in text.splitlines() if "left out" in line and f"{ip_d}:7760" in line]
    assert len(left_out) == 1 and "not from this cluster's token" in left_out[0], text[-3000:]
    assert "placement" in text and "over 3 stage(s)" in text  # the plan, printed, then run on 3 stages
    assert "assigned" not in (tmp_path / f"worker-{ip_d}.log").read_text()
    if no_room:
        refused = [line for line in text.splitlines() if "left out" in line and f"{ip_e}:7760" in line]
        assert len(refused) == 1 and "this worker's disk has" in refused[0] and "free space" in refused[0], text[-3000:]
        assert text.index(refused[0]) < text.rindex("placement")  # planned again without it
        worker_e = (tmp_path / f"worker-{ip_e}.log").read_text()
        assert "no room for layers" in worker_e and "assigned" not in worker_e, worker_e[-3000:]
    # Everything between the hosts (gRPC control, the ring's hidden states) crossed the bridge; the
    # token never did: the control plane is TLS keyed by it, and nothing else carries it.
    wire = capture_path.read_bytes()
    tls_records = wire.count(b"\x17\x03\x03")  # TLS application-data record headers: the capture saw gRPC
    assert len(wire) > 100_000 and tls_records > 50, f"{len(wire)} bytes, {tls_records} TLS records captured: " \
                                                     f"{(tmp_path / f'{log_name}.capture.log').read_text()}"
    assert TOKEN.encode() not in wire
    # The model's path travels in every AssignRequest: in the clear over plaintext gRPC (protobuf is
    # not compressed), so its absence says the control plane was encrypted.
    assert str(model).encode() not in wire
    return text


def test_up_finds_workers_by_mdns_alone(lan, tmp_path, llama_model):
    text = check_cluster(lan, tmp_path, llama_model, ["--discovery-timeout", "20"])
    assert text.count("found ") >= 3


def test_up_with_static_peers_and_mdns_off(lan, tmp_path, llama_model):
    """Also: workers with no copy of the model fetch their layers' share of it; a second `up` moves no
    weight bytes, but fetches again the one tensor corrupted in a worker's cache; a worker whose disk
    cannot hold its layers is left out of both plans."""
    (ns_a, _), (_, ip_b), (_, ip_c), (_, ip_d), (_, ip_e) = lan
    peers = f"{ip_b}:7760,{ip_c}:7760,{ip_d}:7760,{ip_e}:7760"
    flags = ["--no-mdns", "--peers", peers, "--discovery-timeout", "60"]
    text = check_cluster(lan, tmp_path, llama_model, flags, no_room=True)
    assert "looking for workers" not in text and "model store:" in text
    for ip in (ip_b, ip_c):
        (a, b), received = fetched(tmp_path / f"worker-{ip}.log")
        tensors, rest = stage_share(llama_model, a, b)
        assert received == tensors + rest, (ip, a, b)
        total = (llama_model / "model.safetensors").stat().st_size
        assert tensors < 0.75 * total  # a share of the checkpoint, not a copy of it
        cache = tmp_path / f"cache-{ip}"  # and all the worker keeps of it (links not followed)
        kept = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and not p.is_symlink())
        assert tensors <= kept <= tensors + 0.1 * total, (ip, kept, tensors)

    netns.kill_all(ns_a)  # the coordinator goes; the workers are claimed by the next one
    (a, b), _ = fetched(tmp_path / f"worker-{ip_c}.log")
    name, length = tensor_range(llama_model, f"model.layers.{a}.")
    cached = next(p for p in (tmp_path / f"cache-{ip_c}" / "tensors").iterdir()
                  if not p.name.endswith(".part") and p.name[0] != "." and f'"{name}"'.encode() in p.read_bytes()[:300])
    with open(cached, "r+b") as f:  # one byte of a tensor of c's first layer, as the cache holds it
        f.seek(-(length // 2), os.SEEK_END)
        byte = f.read(1)
        f.seek(-(length // 2), os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    check_cluster(lan, tmp_path, llama_model, flags, start_workers=False, log_name="up-again.log", no_room=True)
    assert fetched(tmp_path / f"worker-{ip_b}.log")[1] == 0  # nothing moved: all in its cache
    assert "failed its hash" not in (tmp_path / f"worker-{ip_b}.log").read_text()
    assert fetched(tmp_path / f"worker-{ip_c}.log") == ((a, b), length)  # only the corrupted tensor
    assert "failed its hash" in (tmp_path / f"worker-{ip_c}.log").read_text()


STREAMS = """
import concurrent.futures, json, sys, threading, time, openai
url, prompts = sys.argv[1], json.loads(sys.argv[2])
c = openai.OpenAI(base_url=url, api_key="unused", timeout=180, max_retries=0)
first = threading.Event()
def stream(ids):
    tokens = []
    try:
        for ch in c.completions.create(model="m", prompt=ids, max_tokens=256, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True}):
            tokens += ch.choices[0].token_ids or []
            finish = ch.choices[0].finish_reason
            first.set()
        return ["done" if finish == "length" else finish, tokens, time.monotonic()]
    except openai.APIError as e:
        return ["error", str(e), time.monotonic()]
def greedy(ids):
    r = c.completions.create(model="m", prompt=ids, max_tokens=10, temperature=0,
                             extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].token_ids
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    streams = [pool.submit(stream, ids) for ids in prompts]
    first.wait(120)
    print("STARTED", flush=True)
    ended = [f.result() for f in streams]
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    after = list(pool.map(greedy, prompts))
print(json.dumps({"streams": ended, "after": after}), flush=True)
"""


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_lost_host_mid_traffic_is_healed_around(lan, tmp_path, llama_model, fault):
    """Three stages on three namespaced hosts; the host of the last stage dies (or freezes past the
    stage timeout, 0.75 s) during 8 greedy streams of 256 tokens: every stream pauses and resumes on the
    two hosts left, token-exact."""
    import os
    import signal
    import subprocess

    (ns_a, ip_a), (ns_b, ip_b), (ns_c, ip_c), *_ = lan
    for ns, ip in ((ns_b, ip_b), (ns_c, ip_c)):
        start_worker(ns, ip, tmp_path, hide=llama_model)
    log = tmp_path / "up.log"
    up = netns.popen(ns_a, [*PY, "up", str(llama_model), "--interface", ip_a, "--host", ip_a, "--port", "8000",
                            "--cluster-token", TOKEN, "--gpu-memory-utilization", "0.05", "--max-model-len", "512",
                            "--max-num-batched-tokens", "64", "--served-model-name", "m", "--no-mdns",
                            "--peers", f"{ip_b}:7760,{ip_c}:7760", "--discovery-timeout", "60",
                            ], log)  # the default stage timeout (0.75 s)
    url = f"http://{ip_a}:8000"
    wait_healthy(ns_a, url, up, log)
    before = fetched(tmp_path / f"worker-{ip_b}.log")[0]
    ref_model, tokenizer = load(str(llama_model))
    prompts = [tokenizer.encode(p) for p in PROMPTS * 3][:8]
    client = subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, "-c", STREAMS, f"{url}/v1",
                               json.dumps(prompts)], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "STARTED"
        time.sleep(0.5)
        for pid in subprocess.run(["ip", "netns", "pids", ns_c], capture_output=True, text=True).stdout.split():
            os.kill(int(pid), getattr(signal, fault))  # everything on that host dies or freezes
        killed = time.monotonic()
        out, _ = client.communicate(timeout=400)
    finally:
        client.kill()
    result = json.loads(out.strip().splitlines()[-1])
    for (kind, value, ended), ids in zip(result["streams"], prompts):
        assert kind == "done", value
        assert ended - killed < 300  # a pause, bounded
        assert value == mlx_lm_greedy(ref_model, ids, 256)  # the chunks joined: no gap, no repeat
    assert result["after"] == [mlx_lm_greedy(ref_model, ids, 10) for ids in prompts]
    deadline = time.monotonic() + 15  # the snapshot follows heartbeats, once a second
    while True:
        status = json.loads(netns.run(ns_a, ["curl", "-sf", f"{url}/metal-cluster/status"]).stdout)
        if status["state"] == "serving" or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert status["state"] == "serving" and status["replans"] == 1
    assert status["requests_resumed"] == 8 and status["requests_lost"] == 0
    hosts = sorted(n["address"].rsplit(":", 1)[0] for n in status["nodes"])
    assert hosts == [ip_a, ip_b] and sorted(s["layers"] for s in status["stages"]) == [[0, 2], [2, 4]]
    assert "re-planned" in log.read_text()
    after, received = fetched(tmp_path / f"worker-{ip_b}.log")  # the survivor fetched only what it lacked
    assert received == stage_share(llama_model, *after, had=before)[0] and after != before
