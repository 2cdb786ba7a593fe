"""`metal-cluster doctor`: what a new host needs, one line per check with the fix when it fails."""

import os
import socket
import stat
import sys
import time
import uuid
from dataclasses import dataclass

# Its own service type: a probe must never look like a worker to a coordinator browsing nearby.
PROBE_TYPE = "_mc-doctor._tcp.local."


# What a host is checked for: `serve` alone needs no token, mDNS or worker ports; `up` and `worker` do.
ROLES = ("serve", "up", "worker")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warning: bool = False  # passes, but names what a cluster role would need

    def line(self) -> str:
        mark = "warn" if self.warning else "ok  " if self.ok else "FAIL"
        text = f"{mark} {self.name}: {self.detail}"
        return text if (self.ok and not self.warning) or not self.fix else f"{text} -> {self.fix}"


def python_version() -> Check:
    v = sys.version_info
    ok = (3, 11) <= (v.major, v.minor) <= (3, 13)
    return Check("python", ok, f"{v.major}.{v.minor}.{v.micro} at {sys.executable}",
                 "use Python 3.11-3.13 (PYTHON=python3.12 bash deploy/install.sh)")


def mlx_backend() -> Check:
    try:
        import mlx.core as mx

        device = mx.default_device()
        detail = f"mlx {mx.__version__} on {device.type.name}"
        if device.type == mx.DeviceType.gpu:
            info = mx.device_info()
            detail += f" ({info.get('device_name', 'GPU')})"
        return Check("mlx", True, detail)
    except Exception as e:  # an import that fails names its own reason
        return Check("mlx", False, f"cannot use MLX: {e}",
                     "bash deploy/install.sh (Linux: mlx[cpu] or --cuda; a Mac: Apple Silicon, macOS 15+)")


def openblas() -> Check | None:
    from metal_cluster.coordinator import blas

    if not sys.platform.startswith("linux"):
        return None
    lib = blas.find_openblas()
    if lib:
        forwarding = ("one-row products forwarded to GEMV" if blas.gemv_forward()
                      else "no C compiler to build coordinator/gemv_forward.c: one-row products stay GEMMs")
        return Check("openblas", True, f"{lib} (preloaded for CPU matmuls; {forwarding})")
    return Check("openblas", False, "not found: MLX's CPU backend falls back to a ~30x slower reference BLAS",
                 "apt-get install libopenblas0-pthread")


def token_file(role: str = "up") -> Check:
    from metal_cluster.stage_worker.net.auth import TOKEN_ENV, token_file as path_of

    path = path_of()
    if not path.is_file():
        if os.environ.get(TOKEN_ENV):
            return Check("token", True, f"from ${TOKEN_ENV} (no token file at {path})")
        fix = "run `metal-cluster token` on one host and copy the file to the others (mode 600)"
        if role == "serve":
            return Check("token", True, f"no token file at {path}: serve needs none, up and worker do",
                         fix, warning=True)
        return Check("token", False, f"no token file at {path}", fix)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        return Check("token", False, f"{path} is readable by others (mode {mode:03o})", f"chmod 600 {path}")
    if not path.read_text().strip():
        return Check("token", False, f"{path} is empty", f"rm {path} && metal-cluster token")
    return Check("token", True, f"{path} (mode {mode:03o})")


def config_file(path_given: str | None) -> Check:
    from metal_cluster.coordinator import config

    try:
        path, table = config.read(path_given)
    except config.ConfigError as e:
        return Check("config", False, str(e), "fix the file (deploy/config.example.toml shows every key)")
    if not path.is_file():
        return Check("config", True, f"no config file at {path} (defaults)")
    if not table:
        return Check("config", True, f"{path} (empty)")
    return Check("config", True, f"{path} ({', '.join(sorted(table))})")


def port_free(name: str, host: str, port: int, flag: str) -> Check:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return Check(f"port {port}", False, f"{name} port {host}:{port} is taken ({e.strerror})",
                         f"stop what listens there (ss -ltnp 'sport = :{port}') or pick another with {flag}")
    return Check(f"port {port}", True, f"{name} port {host}:{port} is free")


def interface(name_or_ip: str | None) -> tuple[Check, str | None]:
    from metal_cluster.coordinator.commands.up import UpError, interface_ip

    try:
        ip = interface_ip(name_or_ip)
        socket.inet_aton(ip)
    except (UpError, OSError) as e:
        import psutil

        return Check("interface", False, f"{name_or_ip}: {e}",
                     f"name one of: {', '.join(sorted(psutil.net_if_addrs()))}"), None
    kind = "loopback (this host only)" if ip.startswith("127.") else "LAN"
    return Check("interface", True, f"{name_or_ip or 'default'} -> {ip}, {kind}"), ip


def mdns_visible(ip: str, timeout_s: float = 3.0) -> Check:
    """Announce a probe on `ip` and look for it there: multicast that goes out and comes back."""
    from zeroconf import ServiceBrowser, ServiceInfo, Zeroconf

    name = f"doctor-{uuid.uuid4().hex[:8]}.{PROBE_TYPE}"
    seen = []
    announcer = Zeroconf(interfaces=[ip])
    listener = Zeroconf(interfaces=[ip])
    info = ServiceInfo(PROBE_TYPE, name, addresses=[socket.inet_aton(ip)], port=9, properties={},
                       server=f"{name.split('.')[0]}.local.")
    try:
        announcer.register_service(info)
        browser = ServiceBrowser(listener, PROBE_TYPE, handlers=[lambda zeroconf, service_type, name, state_change:
                                                                 seen.append(name)])
        deadline = time.monotonic() + timeout_s
        while name not in seen and time.monotonic() < deadline:
            time.sleep(0.1)
        browser.cancel()
    except Exception as e:  # zeroconf's own errors and the socket's: either way no mDNS here
        return Check("mdns", False, f"cannot send mDNS on {ip}: {e}",
                     "allow UDP 5353 multicast on this interface, or use --peers host:port")
    finally:
        announcer.unregister_all_services()
        announcer.close()
        listener.close()
    if name in seen:
        return Check("mdns", True, f"a probe announced on {ip} was seen there")
    return Check("mdns", False, f"a probe announced on {ip} was not seen within {timeout_s:.0f}s",
                 "allow UDP 5353 multicast (firewall, Wi-Fi client isolation), or use --peers host:port")


def run(role: str, config_path: str | None, host: str, ports: list[tuple[str, int, str]],
        iface: str | None, mdns: bool) -> list[Check]:
    """`ports` are the ones `role` listens on; serve alone never announces, so it skips mDNS."""
    checks = [python_version(), mlx_backend(), openblas(), token_file(role), config_file(config_path)]
    checks += [port_free(name, host, port, flag) for name, port, flag in ports]
    iface_check, ip = interface(iface)
    checks.append(iface_check)
    if mdns and ip and role != "serve":
        checks.append(mdns_visible(ip))
    return [c for c in checks if c is not None]
