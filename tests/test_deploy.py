"""deploy/: the launchd agents and systemd units are well-formed and run commands the CLI has, the
Homebrew formula's test passes against this CLI, `worker --install-service` writes and removes the
host's service, and install.sh run twice in a clean environment changes nothing the second time."""

import configparser
import os
import plistlib
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from metal_cluster.coordinator.commands import services
from metal_cluster.coordinator.cli import app

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CONSOLE_SCRIPT = Path(sys.executable).parent / "metal-cluster"
PLISTS = sorted((DEPLOY / "launchd").glob("*.plist"))
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))


def clean_env(tmp_path: Path) -> dict:
    """No config, token or service folder from the machine running the tests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAL_CLUSTER_")}
    env.update(HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "xdg"), COLUMNS="200")
    return env


def assert_cli_accepts(argv: list[str]) -> None:
    """The command line parses in the real CLI: the command exists and takes every flag given."""
    no_config = {"XDG_CONFIG_HOME": "/nonexistent", "METAL_CLUSTER_CONFIG": None}
    result = CliRunner(env=no_config).invoke(app, [*argv, "--help"], prog_name="metal-cluster")
    assert result.exit_code == 0, f"metal-cluster {shlex.join(argv)}: {result.output}"


def unit_sections(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(text)
    return parser


def exec_start(text: str) -> list[str]:
    return shlex.split(unit_sections(text)["Service"]["ExecStart"])


def test_the_shipped_files_are_the_renderer_s():
    for (kind, name), relative in services.TEMPLATE_FILES.items():
        assert (DEPLOY / relative).read_bytes() == services.template(kind, name), (
            f"deploy/{relative} differs from services.template(); regenerate: .venv/bin/python -c "
            f"'from metal_cluster.coordinator.commands.services import write_templates; write_templates(\"deploy\")'")


@pytest.mark.parametrize("path", PLISTS, ids=lambda p: p.name)
def test_launchd_agents(path):
    job = plistlib.loads(path.read_bytes())
    name = path.name.removeprefix("com.metal-cluster.").removesuffix(".plist")
    assert job["Label"] == f"com.metal-cluster.{name}"
    assert job["ProgramArguments"][0] == "@METAL_CLUSTER@"
    assert job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False}  # restart after a crash, not after a clean stop
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert job[key] == f"@HOME@/Library/Logs/metal-cluster/{name}.log"
    assert_cli_accepts(job["ProgramArguments"][1:])


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_systemd_units(path):
    unit = unit_sections(path.read_text())
    assert unit["Service"]["Restart"] == "on-failure"
    assert unit["Install"]["WantedBy"] == "default.target"
    assert "StandardOutput" not in unit["Service"]  # the journal, systemd's default
    argv = exec_start(path.read_text())
    assert argv[0] == "@METAL_CLUSTER@"
    assert argv[1] == path.name.removeprefix("metal-cluster-").removesuffix(".service")
    assert_cli_accepts(argv[1:])


@pytest.mark.parametrize("name", ["worker", "up"])
def test_rendered_units_verify(name, tmp_path):
    """With the real executable in place, systemd's own checker finds nothing to say (where present)."""
    argv = [str(CONSOLE_SCRIPT), "--config", str(tmp_path / "my config.toml"), name]
    path = tmp_path / f"metal-cluster-{name}.service"
    path.write_text(services.systemd_unit(name, argv))
    assert exec_start(path.read_text()) == argv  # the quoting survives a space
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed (the parser checks above still ran)")
    done = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), done.stderr + done.stdout


def test_rendered_plist_names_the_executable_and_home(tmp_path):
    argv = [str(CONSOLE_SCRIPT), "worker", "--interface", "en0"]
    job = plistlib.loads(services.launchd_plist("worker", argv, "/Users/ann"))
    assert job["ProgramArguments"] == argv
    assert job["StandardErrorPath"] == "/Users/ann/Library/Logs/metal-cluster/worker.log"


def test_homebrew_formula_test_block_passes(tmp_path):
    """Runs the formula's `test do` commands against this CLI, as `brew test` would on a Mac."""
    formula = (DEPLOY / "homebrew" / "metal-cluster.rb").read_text()
    assert "include Language::Python::Virtualenv" in formula
    assert 'depends_on "python@3.12"' in formula and "depends_on macos: :sequoia" in formula
    block = formula[formula.index("  test do"):]
    for content in re.findall(r'\(testpath/"([^"]+)"\)\.write "([^"]*)"', block):
        (tmp_path / content[0]).write_text(content[1].encode().decode("unicode_escape"))
    commands = [(shlex.split(args), 0) for args in re.findall(r'system bin/"metal-cluster", (.+)', block)
                for args in [args.replace('"', "").replace(",", "")]]
    commands += [(shlex.split(line.replace("#{testpath}", str(tmp_path)).replace("2>&1", "")), int(code or 0))
                 for line, code in re.findall(r'shell_output\("#\{bin\}/metal-cluster ([^"]+)"(?:, (\d+))?\)', block)]
    assert len(commands) >= 3, commands
    outputs = []
    for argv, code in commands:
        done = subprocess.run([str(CONSOLE_SCRIPT), *argv], capture_output=True, text=True, timeout=60,
                              env=clean_env(tmp_path))
        assert done.returncode == code, (argv, done.stdout, done.stderr)
        outputs.append(done.stdout + done.stderr)
    for expected in re.findall(r'assert_match "([^"]+)"', block):
        assert any(expected in out for out in outputs), (expected, outputs)
    for caveat in re.findall(r"^\s+(metal-cluster [^\n(]+)$", formula, re.M):
        assert_cli_accepts(shlex.split(caveat)[1:])


@pytest.fixture
def service_env(tmp_path):
    return {**clean_env(tmp_path), "METAL_CLUSTER_SERVICE_DIR": str(tmp_path / "services")}


def run_cli(env, *args):
    return subprocess.run([str(CONSOLE_SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env)


def test_worker_install_and_uninstall_service(service_env, tmp_path):
    unit = tmp_path / "services" / "metal-cluster-worker.service"
    flags = ["--interface", "lo", "--port", "7790", "--no-advertise"]

    refused = run_cli(service_env, "worker", *flags, "--install-service")
    assert refused.returncode == 2 and "no token file" in refused.stderr and not unit.exists()
    assert run_cli(service_env, "token").returncode == 0
    refused = run_cli(service_env, "worker", "--cluster-token", "s3cret", "--install-service")
    assert refused.returncode == 2 and "--cluster-token" in refused.stderr and not unit.exists()

    config = tmp_path / "config.toml"
    config.write_text("[worker]\nring_port = 7795\n")
    done = run_cli(service_env, "--config", str(config), "worker", *flags, "--install-service")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {unit}; start it with: systemctl --user daemon-reload")
    argv = exec_start(unit.read_text())
    # The running executable, the config file given, the flags typed; the file's values stay in the file.
    assert argv == [str(CONSOLE_SCRIPT), "--config", str(config), "worker", *flags]
    assert_cli_accepts(argv[1:])
    assert unit_sections(unit.read_text())["Service"]["Restart"] == "on-failure"

    again = run_cli(service_env, "--config", str(config), "worker", *flags, "--install-service")
    assert again.stdout.startswith(f"kept {unit}")
    assert run_cli(service_env, "worker", "--uninstall-service").stdout.startswith(f"removed {unit}")
    assert not unit.exists()
    assert "nothing to remove" in run_cli(service_env, "worker", "--uninstall-service").stdout


def test_launchd_service_in_a_folder(tmp_path):
    service = services.Service("launchd", "worker", tmp_path, manage=False)
    argv = [str(CONSOLE_SCRIPT), "worker", "--interface", "en0"]
    said = services.install(service, argv)
    assert "launchctl bootstrap gui/" in said and "mkdir -p" in said
    job = plistlib.loads((tmp_path / "com.metal-cluster.worker.plist").read_bytes())
    assert job["ProgramArguments"] == argv and job["RunAtLoad"] is True
    assert "launchctl bootout" in services.uninstall(service)
    assert not (tmp_path / "com.metal-cluster.worker.plist").exists()


def _vllm_wheel_cached(python: str) -> bool:
    listing = subprocess.run([python, "-m", "pip", "cache", "list", "vllm*"], capture_output=True, text=True)
    return "+empty" in listing.stdout


@pytest.mark.skipif(sys.platform != "linux", reason="the Linux path of install.sh")
def test_install_sh_twice_in_a_clean_environment(tmp_path):
    """A copy of this checkout, a new environment and bin folder; pip's cache is the machine's, so
    the vLLM wheel built by the first install is reused (about 1.5 minutes instead of many)."""
    if not _vllm_wheel_cached(sys.executable) and not os.environ.get("METAL_CLUSTER_TEST_INSTALL"):
        pytest.skip("no vLLM wheel in pip's cache yet (run deploy/install.sh once, or set "
                    "METAL_CLUSTER_TEST_INSTALL=1 to build it here)")
    copy = tmp_path / "checkout"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    venv, bin_dir = tmp_path / "venv", tmp_path / "bin"
    env = {**os.environ, "METAL_CLUSTER_VENV": str(venv), "METAL_CLUSTER_BIN_DIR": str(bin_dir)}
    env.pop("VIRTUAL_ENV", None)

    def install():
        start = time.monotonic()
        done = subprocess.run(["bash", "deploy/install.sh"], cwd=copy, env=env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stdout + done.stderr
        said = [line for line in done.stdout.splitlines() if line.startswith("install: ")]
        return said, time.monotonic() - start

    def freeze():
        return subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True,
                              text=True, check=True).stdout

    said, first_s = install()
    assert said[-1] == f"install: done: {bin_dir / 'metal-cluster'}", said
    assert (bin_dir / "metal-cluster").resolve() == (venv / "bin" / "metal-cluster").resolve()
    before = freeze()
    said, second_s = install()
    assert said[-1] == "install: nothing to change", said
    assert freeze() == before
    assert second_s < 30, second_s
    done = subprocess.run([str(bin_dir / "metal-cluster"), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "worker" in done.stdout
    print(f"install.sh: first run {first_s:.0f}s, second {second_s:.1f}s")
