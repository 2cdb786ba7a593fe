"""Run `metal-cluster worker` (or `up`) as a service: a launchd user agent on macOS, a systemd user
unit on Linux. Rendering the file is kept apart from asking launchctl/systemctl to load it, so the
files can be checked anywhere and written into a test's folder.

deploy/launchd/ and deploy/systemd/ hold these same renderings with @METAL_CLUSTER@ and @HOME@ in
place of the executable and the home folder (the tests keep them identical).
"""

import os
import plistlib
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

LABEL_PREFIX = "com.metal-cluster"
# Tests (and anyone generating files for another machine) write here instead of the manager's own
# folder; the manager is then left alone, since it would not read this folder anyway.
SERVICE_DIR_ENV = "METAL_CLUSTER_SERVICE_DIR"
DESCRIPTIONS = {"worker": "metal-cluster stage worker", "up": "metal-cluster coordinator (up)"}


class ServiceError(RuntimeError):
    """One line for the user."""


@dataclass
class Service:
    kind: str  # "launchd" or "systemd"
    name: str  # "worker" or "up"
    directory: Path
    manage: bool  # load/unload it with launchctl/systemctl

    @property
    def label(self) -> str:
        return f"{LABEL_PREFIX}.{self.name}"

    @property
    def path(self) -> Path:
        if self.kind == "launchd":
            return self.directory / f"{self.label}.plist"
        return self.directory / f"metal-cluster-{self.name}.service"


def host_kind() -> str:
    return "launchd" if sys.platform == "darwin" else "systemd"


def for_host(name: str, kind: str | None = None) -> Service:
    kind = kind or host_kind()
    override = os.environ.get(SERVICE_DIR_ENV)
    if override:
        return Service(kind, name, Path(override), manage=False)
    home = Path.home()
    if kind == "launchd":
        return Service(kind, name, home / "Library" / "LaunchAgents", manage=True)
    root = os.environ.get("XDG_CONFIG_HOME") or str(home / ".config")
    return Service(kind, name, Path(root) / "systemd" / "user", manage=True)


def executable() -> list[str]:
    """The command that runs this metal-cluster: the console script being run, else the one next to
    this interpreter, else `python -m` (how tests and `python -m metal_cluster.coordinator` run)."""
    script = Path(sys.argv[0])
    if script.name == "metal-cluster" and script.is_file():
        return [os.path.abspath(script)]
    beside = Path(sys.executable).parent / "metal-cluster"
    if beside.is_file():
        return [str(beside)]
    return [os.path.abspath(sys.executable), "-m", "metal_cluster.coordinator"]


def log_dir(home: str | Path) -> str:
    return f"{home}/Library/Logs/metal-cluster"


def launchd_plist(name: str, argv: list[str], home: str | Path) -> bytes:
    log = f"{log_dir(home)}/{name}.log"
    job = {
        "Label": f"{LABEL_PREFIX}.{name}",
        "ProgramArguments": list(argv),
        "RunAtLoad": True,
        # Restart after a crash, not after a clean exit: `metal-cluster down --workers-too` and
        # `launchctl bootout` mean stop. launchd spaces restarts by ThrottleInterval.
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 10,
        # A background agent would be throttled (App Nap, low QoS); serving wants a whole Mac.
        "ProcessType": "Interactive",
        "StandardOutPath": log,
        "StandardErrorPath": log,
        # The log file should show each line as it happens, not when a buffer fills.
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1"},
    }
    return plistlib.dumps(job, sort_keys=False)


def systemd_unit(name: str, argv: list[str]) -> str:
    return "\n".join([
        "[Unit]",
        f"Description={DESCRIPTIONS[name]}",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={_systemd_command(argv)}",
        # A crash restarts it; a clean exit (`metal-cluster down --workers-too`) leaves it stopped.
        "Restart=on-failure",
        "RestartSec=5",
        # Output goes to the journal: journalctl --user -u metal-cluster-<name>
        "Environment=PYTHONUNBUFFERED=1",
        # `up` drains before it stops (running requests finish); give it the time `down` gives.
        "TimeoutStopSec=60",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])


EXE_PLACEHOLDER, HOME_PLACEHOLDER = "@METAL_CLUSTER@", "@HOME@"
TEMPLATE_FILES = {("launchd", "worker"): "launchd/com.metal-cluster.worker.plist",
                  ("launchd", "up"): "launchd/com.metal-cluster.up.plist",
                  ("systemd", "worker"): "systemd/metal-cluster-worker.service",
                  ("systemd", "up"): "systemd/metal-cluster-up.service"}


def template(kind: str, name: str) -> bytes:
    """The file deploy/ ships: placeholders for the executable and home, and a note saying how to fill them."""
    argv = [EXE_PLACEHOLDER, name]
    exe = f"s|{EXE_PLACEHOLDER}|$(command -v metal-cluster)|"
    # An XML comment may not hold "--", so the note names the flag without its dashes.
    how = ("`metal-cluster worker` with its install-service flag writes and loads it" if name == "worker" else
           "its model and flags come from ~/.config/metal-cluster/config.toml")
    if kind == "launchd":
        target = f"~/Library/LaunchAgents/{LABEL_PREFIX}.{name}.plist"
        note = (f"<!-- launchd user agent for `metal-cluster {name}`: {how}. By hand:\n"
                f"       mkdir -p ~/Library/Logs/metal-cluster\n"
                f"       sed -e \"{exe}\" -e \"s|{HOME_PLACEHOLDER}|$HOME|g\" THIS_FILE > {target}\n"
                f"       launchctl bootstrap gui/$(id -u) {target} -->\n")
        head, rest = launchd_plist(name, argv, HOME_PLACEHOLDER).decode().split("<plist", 1)
        return (head + note + "<plist" + rest).encode()
    unit = f"metal-cluster-{name}.service"
    note = (f"# systemd user unit for `metal-cluster {name}`: {how}. By hand:\n"
            f"#   sed \"{exe}\" THIS_FILE > ~/.config/systemd/user/{unit}\n"
            f"#   systemctl --user daemon-reload && systemctl --user enable --now {unit}\n")
    return (note + systemd_unit(name, argv)).encode()


def write_templates(deploy: str | Path) -> None:
    for (kind, name), relative in TEMPLATE_FILES.items():
        path = Path(deploy) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(template(kind, name))


def render(service: Service, argv: list[str], home: str | Path | None = None) -> bytes:
    if service.kind == "launchd":
        return launchd_plist(service.name, argv, home if home is not None else Path.home())
    return systemd_unit(service.name, argv).encode()


def _systemd_command(argv: list[str]) -> str:
    """systemd's own quoting: double quotes around words with spaces or quotes, % and $ doubled."""
    words = []
    for arg in argv:
        arg = arg.replace("%", "%%").replace("$", "$$")
        if not arg or any(c in arg for c in " \t\"'\\;"):
            arg = '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
        words.append(arg)
    return " ".join(words)


def manager_commands(service: Service, action: str) -> list[list[str]]:
    """What loads (action "start") or unloads ("stop") the service."""
    if service.kind == "launchd":
        domain = f"gui/{os.getuid()}"
        if action == "start":
            return [["launchctl", "enable", f"{domain}/{service.label}"],
                    ["launchctl", "bootstrap", domain, str(service.path)]]
        return [["launchctl", "bootout", f"{domain}/{service.label}"]]
    unit = service.path.name
    if action == "start":
        # restart, not start: a service already running must pick up the new file.
        return [["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", unit],
                ["systemctl", "--user", "restart", unit]]
    return [["systemctl", "--user", "disable", "--now", unit]]


def install(service: Service, argv: list[str]) -> str:
    """Write the service file and start it; what happened, in one line."""
    manage = _can_manage(service)
    service.directory.mkdir(parents=True, exist_ok=True)
    previous = service.path.read_bytes() if service.path.is_file() else None
    if previous is not None and manage and service.kind == "launchd":
        _run(service, manager_commands(service, "stop"), quiet=True)  # bootstrap refuses a loaded job
    service.path.write_bytes(render(service, argv))
    verb = "wrote" if previous is None else ("kept" if previous == service.path.read_bytes() else "updated")
    start = manager_commands(service, "start")
    # launchd does not create the folder of StandardOutPath, and without it the job cannot start.
    logs = [["mkdir", "-p", log_dir(Path.home())]] if service.kind == "launchd" else []
    if not manage:
        return f"{verb} {service.path}; start it with: {_shell(logs + start)}"
    if logs:
        Path(logs[0][-1]).mkdir(parents=True, exist_ok=True)
    _run(service, start)
    if service.kind == "launchd":
        return f"{verb} {service.path} and started {service.label} (logs: {log_dir(Path.home())}/{service.name}.log)"
    return (f"{verb} {service.path} and started it (logs: journalctl --user -u {service.path.name}; "
            f"to keep it running after logout: loginctl enable-linger {_user()})")


def uninstall(service: Service) -> str:
    if not service.path.is_file():
        return f"no {service.name} service installed at {service.path}: nothing to remove"
    manage = _can_manage(service)
    stop = manager_commands(service, "stop")
    failed = _run(service, stop, quiet=True) if manage else None  # not loaded is fine too
    service.path.unlink()
    if not manage:
        return f"removed {service.path}; if it was loaded, stop it with: {_shell(stop)}"
    if service.kind == "systemd":
        _run(service, [["systemctl", "--user", "daemon-reload"]], quiet=True)
    return f"removed {service.path}" + (f" ({failed})" if failed else " and stopped it")


def _can_manage(service: Service) -> bool:
    return service.manage and shutil.which("launchctl" if service.kind == "launchd" else "systemctl") is not None


def _run(service: Service, commands: list[list[str]], quiet: bool = False) -> str | None:
    """Runs the commands in turn; with `quiet`, the first failure comes back as a line instead."""
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            why = (done.stderr or done.stdout).strip().splitlines()
            failure = f"`{shlex.join(command)}` failed{': ' + why[-1] if why else ''}"
            if quiet:
                return failure
            raise ServiceError(f"wrote {service.path}, but {failure}; run it yourself once that is fixed")
    return None


def _shell(commands: list[list[str]]) -> str:
    return " && ".join(shlex.join(c) for c in commands)


def _user() -> str:
    return os.environ.get("USER") or Path.home().name


def flags_given(ctx, skip: tuple[str, ...]) -> list[str]:
    """The options typed on this command line, as flags again: what the service should run with.
    Values from the config file stay there, so editing the file and restarting is enough."""
    argv = []
    for param in ctx.command.params:
        if param.param_type_name != "option" or param.name in skip:
            continue
        source = ctx.get_parameter_source(param.name)
        if source is None or source.name != "COMMANDLINE":  # typer's click copy has its own enum
            continue
        value = ctx.params[param.name]
        if param.is_flag:
            if param.secondary_opts:
                argv.append(param.opts[0] if value else param.secondary_opts[0])
            elif value:
                argv.append(param.opts[0])
        elif value is not None:
            argv += [_long(param), str(value)]
    return argv


def _long(param) -> str:
    return next((o for o in param.opts if o.startswith("--")), param.opts[0])
