"""Bad models on the command line: one clear line on stderr naming the file or architecture."""

import json
import shutil
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "metal_cluster.coordinator"]


def run_generate(model):
    return subprocess.run([*CLI, "generate", str(model), "--max-tokens", "2"],
                          capture_output=True, text=True, timeout=120)


def assert_one_line_error(result, *needles):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("metal-cluster: error:")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_folder_missing_a_file(llama_model, tmp_path, missing):
    broken = tmp_path / "broken"
    shutil.copytree(llama_model, broken)
    (broken / missing).unlink()
    result = run_generate(broken)
    assert_one_line_error(result, str(broken), missing.split(".")[0])


def test_unsupported_architecture(llama_model, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(llama_model, odd)
    config = json.loads((odd / "config.json").read_text())
    config["model_type"] = "mamba"
    (odd / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_generate(odd), "mamba", "not supported")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert_one_line_error(run_generate(bad), str(bad))


def test_missing_model_path(tmp_path):
    assert_one_line_error(run_generate(tmp_path / "nowhere"), str(tmp_path / "nowhere"))


def test_generate_tiny_model(llama_model):
    result = subprocess.run([*CLI, "generate", str(llama_model), "--max-tokens", "4", "--no-chat"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_worker_on_an_address_this_host_lacks():
    result = subprocess.run([*CLI, "worker", "--host", "10.255.255.1", "--port", "7999", "--cluster-token", "t",
                             "--no-advertise"], capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, "cannot listen on 10.255.255.1:7999", "--host")
