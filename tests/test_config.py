"""The config file: every command's defaults come from it, flags and the environment win over it, and
a mistake in it is one line naming the file and the key. The CLI runs as a real process each time."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from metal_cluster.coordinator import cli, config

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "metal_cluster.coordinator"]
# Ports nothing listens on: `status` fails at once, naming the URL it tried.
FILE_URL, FLAG_URL, ENV_URL = "http://127.0.0.1:9", "http://127.0.0.1:19", "http://127.0.0.1:29"


@pytest.fixture
def home(tmp_path):
    """An environment of our own: no config, token or URL from the machine running the tests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAL_CLUSTER_")}
    env.update(HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    return env


def run(env, *args, **extra_env):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env={**env, **extra_env})


def one_error_line(result) -> str:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("metal-cluster: error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_file_gives_defaults_and_flags_and_environment_win(home, tmp_path):
    conf = write(tmp_path / "c.toml", f'[status]\nurl = "{FILE_URL}"\n')
    assert FILE_URL in one_error_line(run(home, "--config", str(conf), "status", "--json"))
    assert FLAG_URL in one_error_line(run(home, "--config", str(conf), "status", "--json", "--url", FLAG_URL))
    assert ENV_URL in one_error_line(run(home, "--config", str(conf), "status", "--json", METAL_CLUSTER_URL=ENV_URL))


def test_where_the_file_is_found(home, tmp_path):
    # The default place (under XDG_CONFIG_HOME), then $METAL_CLUSTER_CONFIG, then --config.
    write(Path(home["XDG_CONFIG_HOME"]) / "metal-cluster" / "config.toml", f'url = "{FILE_URL}"\n')
    assert FILE_URL in one_error_line(run(home, "status"))
    by_env = write(tmp_path / "env.toml", f'url = "{ENV_URL}"\n')
    assert ENV_URL in one_error_line(run(home, "status", METAL_CLUSTER_CONFIG=str(by_env)))
    by_flag = write(tmp_path / "flag.toml", f'url = "{FLAG_URL}"\n')
    assert FLAG_URL in one_error_line(run(home, "--config", str(by_flag), "status", METAL_CLUSTER_CONFIG=str(by_env)))


def test_shared_key_reaches_every_command_that_has_it_and_a_table_wins(home, tmp_path):
    conf = write(tmp_path / "c.toml", f'url = "{FILE_URL}"\n[down]\nurl = "{FLAG_URL}"\n')
    assert FILE_URL in one_error_line(run(home, "--config", str(conf), "status"))
    assert FLAG_URL in one_error_line(run(home, "--config", str(conf), "down"))


def test_model_from_the_file_with_home_expanded(home, tmp_path):
    conf = write(tmp_path / "c.toml", 'model = "~/no-such-model"\n')
    expanded = str(Path(home["HOME"]) / "no-such-model")
    assert expanded in one_error_line(run(home, "--config", str(conf), "generate"))
    # A vLLM flag first is no model: the file's model still applies.
    assert expanded in one_error_line(run(home, "--config", str(conf), "serve", "--max-model-len", "64"))
    assert str(tmp_path / "other") in one_error_line(run(home, "--config", str(conf), "generate", str(tmp_path / "other")))


def test_vllm_args_come_before_the_command_lines_own(tmp_path):
    conf = write(tmp_path / "c.toml", 'model = "/models/m"\n[up]\nvllm_args = ["--max-model-len", "8192", "--max-num-seqs", "8"]\n')
    group = typer.main.get_command(cli.app)
    root = group.make_context("metal-cluster", ["up"])
    root.default_map, _ = config.defaults(*config.read(conf), group)
    up = group.commands["up"].make_context("up", ["--max-model-len", "512"], parent=root)
    model, extra = cli._split_model_arg(up.params["model"], up)
    assert model == "/models/m"
    assert extra == ["--max-model-len", "8192", "--max-num-seqs", "8", "--max-model-len", "512"]
    assert cli._max_model_len(extra, {}) == 512  # the last one wins, as in vLLM


def test_token_file_setting_moves_the_token_and_the_environment_wins(home, tmp_path):
    conf = write(tmp_path / "c.toml", 'token_file = "~/secrets/cluster-token"\n')
    made = run(home, "--config", str(conf), "token")
    assert made.returncode == 0, made.stderr
    path, token = made.stdout.split()
    assert path == str(Path(home["HOME"]) / "secrets" / "cluster-token")
    assert Path(path).read_text().strip() == token and Path(path).stat().st_mode & 0o777 == 0o600
    elsewhere = tmp_path / "env-token"
    made = run(home, "--config", str(conf), "token", METAL_CLUSTER_TOKEN_FILE=str(elsewhere))
    assert made.stdout.split()[0] == str(elsewhere)


def test_worker_reads_the_token_file_the_config_names(home, tmp_path):
    # With no token anywhere the worker stops at once; with the file the config names, it gets past
    # that check (and is then stopped by a bad --interface before it binds anything).
    conf = write(tmp_path / "c.toml", f'token_file = "{tmp_path / "tok"}"\n')
    assert "no cluster token" in one_error_line(run(home, "--config", str(conf), "worker", "--interface", "nope0"))
    write(tmp_path / "tok", "secret\n")
    assert "--interface nope0" in one_error_line(run(home, "--config", str(conf), "worker", "--interface", "nope0"))


def test_the_example_config_is_valid():
    group = typer.main.get_command(cli.app)
    default_map, _ = config.defaults(*config.read(ROOT / "deploy" / "config.example.toml"), group)
    assert default_map["worker"]["port"] == 7760 and default_map["worker"]["interface"] == "en0"
    assert default_map["up"]["vllm_args"][:2] == ["--max-model-len", "8192"]
    assert default_map["up"]["gpu_memory_utilization"] == 0.6


@pytest.mark.parametrize("text, needles", [
    ("port = 7760\n", ["`port`", "[worker]"]),
    ('[worker]\nprot = 7760\n', ["`prot`", "[worker]", "did you mean `port`"]),
    ('[worker]\nport = "7760"\n', ["[worker] port", "whole number", '"7760"']),
    ("gpu_memory_utilization = 1.5\n", ["gpu_memory_utilization", "0.95"]),
    ("[status]\njson = 1\n", ["[status] json", "true or false"]),
    ('[up]\ncluster_token = "s3cret"\n', ["cluster_token", "token file"]),
    ('[up]\nvllm_args = "--max-model-len 8"\n', ["vllm_args", "list of strings"]),
    ("worker = 1\n", ["`worker`", "[worker] table"]),
    ("[serve\nport = 1\n", ["not valid TOML", "line 1"]),
])
def test_bad_config_is_one_line_naming_file_and_key(home, tmp_path, text, needles):
    conf = write(tmp_path / "bad.toml", text)
    line = one_error_line(run(home, "--config", str(conf), "status"))
    for needle in [str(conf), *needles]:
        assert needle in line, line
    assert "s3cret" not in line


def test_a_named_config_file_must_exist(home, tmp_path):
    line = one_error_line(run(home, "--config", str(tmp_path / "nowhere.toml"), "status"))
    assert str(tmp_path / "nowhere.toml") in line and "--config" in line
