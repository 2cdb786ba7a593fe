"""`metal-cluster worker` at its gRPC boundary: bad requests get a status naming the problem and
the worker keeps serving; a stage holds only its own layers."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

import tiny_models
from metal_cluster.coordinator.cluster.stages import RemoteStage, StageCallError
from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.proto import cluster_pb2_grpc as pb_grpc
from server_process import free_port


TOKEN = "test-token-123"


@contextlib.contextmanager
def worker_process(log_path):
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "metal_cluster.coordinator", "worker", "--port", str(port),
                                 "--ring-port", str(free_port()), "--cluster-token", TOKEN],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    stage = RemoteStage(f"127.0.0.1:{port}", token=TOKEN, timeout_s=120)
    try:
        try:
            stage.wait_ready(time.monotonic() + 60, still_starting=lambda: proc.poll() is None)
        except StageCallError as e:
            raise AssertionError(f"worker did not come up: {e}\n{open(log_path).read()}") from None
        stage.pid = proc.pid
        yield stage
    finally:
        stage.close()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def assign(stage, model, start, end, block_size=16):
    return stage.assign(pb.AssignRequest(version=PROTO_VERSION, model=str(model), layer_start=start, layer_end=end,
                                         block_size=block_size, max_num_batched_tokens=32, memory_utilization=0.05))


def step_status(stage, step):
    stub = pb_grpc.StageStub(stage.channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.Step(step, timeout=60)
    return err.value.code(), err.value.details()


def test_bad_steps_get_a_clear_status_and_the_worker_stays_up(llama_model, tmp_path):
    with worker_process(tmp_path / "worker.log") as stage:
        assign(stage, llama_model, 0, 4)
        stage.start(pb.StartRequest(version=PROTO_VERSION, num_blocks=32, world_size=1))

        unknown = pb.StepRequest(version=PROTO_VERSION, step_id=0)
        unknown.cached_requests.append(pb.CachedRequest(req_id="ghost", num_computed_tokens=3))
        unknown.scheduled.append(pb.ScheduledTokens(req_id="ghost", num_tokens=1))
        code, details = step_status(stage, unknown)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown request 'ghost'" in details

        out_of_range = pb.StepRequest(version=PROTO_VERSION, step_id=1)
        out_of_range.new_requests.append(pb.NewRequest(req_id="a", prompt_token_ids=[5, 6, 7], block_ids=[999]))
        out_of_range.scheduled.append(pb.ScheduledTokens(req_id="a", num_tokens=3))
        code, details = step_status(stage, out_of_range)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "block id 999 out of range" in details

        old = pb.StepRequest(version=PROTO_VERSION + 1, step_id=2)
        code, details = step_status(stage, old)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "proto version" in details

        good = pb.StepRequest(version=PROTO_VERSION, step_id=2)
        good.new_requests.append(pb.NewRequest(req_id="a", prompt_token_ids=[5, 6, 7], block_ids=[1]))
        good.scheduled.append(pb.ScheduledTokens(req_id="a", num_tokens=3))
        response = stage.submit(good).result(timeout=60)
        assert [s.req_id for s in response.sampled] == ["a"]
        health = stage.health()
        assert health.state == "serving" and health.num_requests == 1 and health.steps == 1


def test_second_assign_is_refused(llama_model, tmp_path):
    with worker_process(tmp_path / "worker.log") as stage:
        assign(stage, llama_model, 0, 2)
        with pytest.raises(StageCallError, match="already holds layers"):
            assign(stage, llama_model, 2, 4)
        # A worker restarts at every re-plan: it never imports the tokenizer side (transformers,
        # torch: 8 s of its start here), only mlx-lm's model code (lean_mlx_lm.py).
        with open(f"/proc/{stage.pid}/maps") as maps:
            mapped = maps.read()
        assert "libtorch" not in mapped and "mlx" in mapped
    with worker_process(tmp_path / "worker-replan.log") as stage:
        # A re-plan passes the activation peak the worker measured for the plan before: no warm-up.
        known = stage.assign(pb.AssignRequest(version=PROTO_VERSION, model=str(llama_model), layer_start=0, layer_end=2,
                                              block_size=16, max_num_batched_tokens=32, memory_utilization=0.05,
                                              activation_bytes_known=12345))
        assert known.activation_bytes == 12345 and known.warm_up_seconds < 0.01
    with worker_process(tmp_path / "worker2.log") as other:
        with pytest.raises(StageCallError, match="model not found"):
            assign(other, tmp_path / "no-such-model", 0, 1)
        assert other.health().state == "idle"


def test_a_quarter_stage_holds_a_quarter_of_the_model(tmp_path):
    folder = tiny_models.build_tiny_model("llama", tmp_path / "m", num_layers=8, hidden_size=512,
                                          intermediate_size=2048, num_heads=8, num_kv_heads=4)

    def growth(start, end):
        with worker_process(tmp_path / f"w{start}.log") as stage:
            before = stage.health().resident_bytes
            assign(stage, folder, start, end)
            return stage.health().resident_bytes - before

    whole, quarter = growth(0, 8), growth(2, 4)
    assert whole > 100 * 2**20, f"whole model grew the worker by only {whole / 2**20:.0f} MiB"
    assert quarter < 0.4 * whole, f"a 2-of-8-layer stage grew by {quarter / 2**20:.0f} MiB vs {whole / 2**20:.0f} MiB"


def handshake_refusals(log_path) -> list[str]:
    return [line for line in log_path.read_text().splitlines() if "Handshake failed" in line]


def test_another_clusters_host_and_a_plaintext_client_are_refused(tmp_path, monkeypatch):
    """Mutual TLS keyed by the token: a coordinator of another cluster is refused by the worker (and
    refuses it: `up` leaves it out saying why, at once rather than after its wait for a booting
    worker), a plaintext gRPC client is refused with one line in the worker's log. (A coordinator of
    another cluster rejects the worker's certificate before it shows its own: TLS 1.3 ends there, and
    the line is the coordinator's.)"""
    from rich.console import Console

    from metal_cluster.coordinator.commands import up as cluster

    log = tmp_path / "worker.log"
    with worker_process(log) as stage:
        assert handshake_refusals(log) == []

        intruder = RemoteStage(stage.name, token="another-clusters-token")
        with pytest.raises(StageCallError, match="not from this cluster's token") as refused:
            intruder.health()
        intruder.close()
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED

        console = Console(file=open(tmp_path / "up.out", "w"), width=400)
        started = time.monotonic()
        assert cluster.discover("127.0.0.1", stage.name, False, 30, 0, "another-clusters-token", console) == []
        console.file.close()
        assert time.monotonic() - started < 10
        said = (tmp_path / "up.out").read_text()
        assert f"left out {stage.name}" in said and "not from this cluster's token" in said, said
        before = len(handshake_refusals(log))

        plain = grpc.insecure_channel(stage.name)
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.StageStub(plain).Health(pb.HealthRequest(version=PROTO_VERSION), timeout=10)
        plain.close()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        time.sleep(0.5)  # the worker's log line is written as the handshake ends, maybe after the client saw it
        lines = handshake_refusals(log)
        assert len(lines) == before + 1 and "WRONG_VERSION_NUMBER" in lines[-1], lines

        assert stage.health().state == "idle"  # the cluster's own coordinator still gets through
    assert len(handshake_refusals(log)) == before + 1
    assert "TLS for cluster" in log.read_text()


def test_worker_without_any_token_does_not_start(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-config"))
    monkeypatch.delenv("METAL_CLUSTER_TOKEN", raising=False)
    result = subprocess.run([sys.executable, "-m", "metal_cluster.coordinator", "worker", "--port", str(free_port())],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "no cluster token" in result.stderr and "Traceback" not in result.stderr


def test_token_command_creates_the_file_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    cli = [sys.executable, "-m", "metal_cluster.coordinator", "token"]
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path)}
    first = subprocess.run(cli, capture_output=True, text=True, timeout=60, env=env).stdout.split()
    second = subprocess.run(cli, capture_output=True, text=True, timeout=60, env=env).stdout.split()
    assert first == second and len(first[1]) >= 24
    path = tmp_path / "metal-cluster" / "token"
    assert first[0] == str(path) and oct(path.stat().st_mode & 0o777) == "0o600"


def test_every_grpc_port_and_channel_goes_through_cluster_tls():
    """Only stage_worker/net/cluster_tls.py opens gRPC ports and channels, so none can skip the TLS."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    direct = ("insecure_channel", "add_insecure_port", "secure_channel(", "add_secure_port(")
    offenders = [f"{path.relative_to(root)}: {word}"
                 for folder in ("coordinator", "stage_worker") for path in sorted((root / folder).rglob("*.py"))
                 if path.name != "cluster_tls.py" and not path.name.endswith("_pb2_grpc.py")
                 for word in direct if word in path.read_text()]
    assert offenders == [], "open gRPC ports and channels with cluster_tls.add_port / cluster_tls.channel"
