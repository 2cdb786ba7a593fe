"""Network namespaces as test hosts: a bridge namespace and hosts on 10.77.<net>.0/24 behind it.

Only addresses and interfaces these helpers create are used; nothing touches the machine's own
interfaces, and everything is removed on exit, failed test or not.
"""

import contextlib
import os
import shutil
import signal
import subprocess


def can_create_namespaces() -> str | None:
    """None when we can, else why not."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"mc-probe-{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"cannot create a network namespace: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args, ns=None):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def bridge_namespace() -> str:
    """The namespace holding the bridge of this process's `lan` (where all traffic between hosts passes)."""
    return f"mcbr{os.getpid() % 10000}"


# Every frame on the bridge's ports into one file until SIGTERM (no tcpdump needed: a packet socket).
CAPTURE = """
import signal, socket, sys
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(3))
s.settimeout(0.2)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
with open(sys.argv[1], "wb") as out:
    while not stop:
        try:
            out.write(s.recv(262144))
        except (socket.timeout, InterruptedError):
            pass
"""


@contextlib.contextmanager
def lan(hosts: int, net: int = 77):
    """Yield [(namespace, address)] for `hosts` hosts on one bridged segment."""
    tag = f"{os.getpid() % 10000}"
    bridge = bridge_namespace()
    names = [f"mch{tag}x{i}" for i in range(hosts)]
    created = []
    try:
        subprocess.run(["ip", "netns", "add", bridge], check=True, timeout=30)
        created.append(bridge)
        _ip("link", "add", "br0", "type", "bridge", ns=bridge)
        _ip("link", "set", "br0", "up", ns=bridge)
        members = []
        for i, ns in enumerate(names):
            subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
            created.append(ns)
            peer = f"p{i}"
            _ip("link", "add", "eth0", "type", "veth", "peer", "name", peer, "netns", bridge, ns=ns)
            _ip("link", "set", peer, "master", "br0", ns=bridge)
            _ip("link", "set", peer, "up", ns=bridge)
            address = f"10.{net}.0.{i + 1}"
            _ip("addr", "add", f"{address}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            members.append((ns, address))
        yield members
    finally:
        for ns in reversed(created):
            kill_all(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def kill_all(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def popen(ns: str, cmd: list[str], log_path, env=None) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)


def run(ns: str, cmd: list[str], timeout=120, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=timeout, env=env)
