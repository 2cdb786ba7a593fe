"""`metal-cluster doctor` on this host: a passing one, then a token file others can read and a port
in use, each named with its fix. mDNS only on loopback."""

import socket
import subprocess
import sys

import pytest

from server_process import free_port

CLI = [sys.executable, "-m", "metal_cluster.coordinator"]


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A host with its own config folder and a token file made by `metal-cluster token`."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    for name in ("METAL_CLUSTER_TOKEN", "METAL_CLUSTER_TOKEN_FILE", "METAL_CLUSTER_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    subprocess.run([*CLI, "token"], check=True, capture_output=True, timeout=60)
    return tmp_path / "metal-cluster" / "token"


def doctor(api_port, worker_port, role="up"):
    return subprocess.run([*CLI, "doctor", "--for", role, "--interface", "127.0.0.1", "--port", str(api_port),
                           "--worker-port", str(worker_port)], capture_output=True, text=True, timeout=120)


def free_pair() -> int:
    """A port whose next one is free too (a worker's gRPC and ring ports)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two free ports in a row")


def test_doctor_on_a_good_host_passes_every_check(host):
    result = doctor(free_port(), free_pair())
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    names = [line.split()[1].rstrip(":") for line in lines[:-1]]
    assert names[:2] == ["python", "mlx"] and {"token", "config", "interface", "mdns"} <= set(names)
    assert sum(n == "port" for n in names) == 3
    assert all(line.startswith("ok ") for line in lines[:-1]), result.stdout
    assert "a probe announced on 127.0.0.1 was seen there" in result.stdout
    assert lines[-1] == f"{len(lines) - 1} of {len(lines) - 1} checks passed, for up"


@pytest.fixture
def fresh_host(tmp_path, monkeypatch):
    """A host as the README's install leaves it: no token file, no config."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    for name in ("METAL_CLUSTER_TOKEN", "METAL_CLUSTER_TOKEN_FILE", "METAL_CLUSTER_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "metal-cluster" / "token"


def test_doctor_on_a_fresh_single_node_host_warns_of_the_token_and_passes(fresh_host):
    result = subprocess.run([*CLI, "doctor", "--port", str(free_port())], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    token = [line for line in lines if line.split()[1] == "token:"]
    assert token == [f"warn token: no token file at {fresh_host}: serve needs none, up and worker do -> "
                     "run `metal-cluster token` on one host and copy the file to the others (mode 600)"]
    names = [line.split()[1].rstrip(":") for line in lines[:-1]]
    assert "mdns" not in names and sum(n == "port" for n in names) == 1  # serve announces nothing
    assert lines[-1].endswith("checks passed (1 with a warning), for serve")


@pytest.mark.parametrize("role", ["worker", "up"])
def test_doctor_for_a_cluster_role_fails_without_a_token(fresh_host, role):
    result = doctor(free_port(), free_pair(), role)
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert failed == [f"FAIL token: no token file at {fresh_host} -> "
                      "run `metal-cluster token` on one host and copy the file to the others (mode 600)"]


def test_doctor_names_an_unknown_role_in_one_line():
    result = subprocess.run([*CLI, "doctor", "--for", "laptop"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--for laptop: not a role; use one of serve, up, worker" in result.stderr


def test_doctor_names_a_readable_token_file_and_a_port_in_use(host):
    host.chmod(0o644)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = doctor(taken.getsockname()[1], free_pair())
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 2, result.stdout
    token, port = failed
    assert f"{host} is readable by others (mode 644)" in token and f"chmod 600 {host}" in token
    assert "is taken" in port and "--port" in port
