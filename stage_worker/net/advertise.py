"""Bonjour (mDNS) for workers: announce `_metal-cluster._tcp.local.` so coordinators find us.

TXT carries what placement needs and nothing secret: node id, versions, device, memory, ports, link.
zeroconf is bound to the one address we serve on, so nothing is announced on other interfaces.
"""

import platform
import socket
import subprocess
from pathlib import Path

import psutil

from metal_cluster.proto import PROTO_VERSION

SERVICE_TYPE = "_metal-cluster._tcp.local."
SOFTWARE_VERSION = "0.1.0"


def link_kind(ip: str) -> str:
    """"wired" or "wifi" for the interface that holds `ip` (best effort; unknown counts as wired)."""
    name = next((n for n, addrs in psutil.net_if_addrs().items() if any(a.address == ip for a in addrs)), None)
    if name is None:
        return "wired"
    if Path(f"/sys/class/net/{name}/wireless").exists():
        return "wifi"
    if platform.system() == "Darwin":
        try:
            ports = subprocess.run(["networksetup", "-listallhardwareports"], capture_output=True, text=True,
                                   timeout=5).stdout
        except (OSError, subprocess.TimeoutExpired):
            return "wired"
        blocks = ports.split("\n\n")
        if any("Wi-Fi" in b and f"Device: {name}" in b for b in blocks):
            return "wifi"
    return "wired"


def txt_record(node_id: str, grpc_port: int, ring_port: int, ip: str, device: str) -> dict[str, str]:
    vm = psutil.virtual_memory()
    return {
        "node": node_id,
        "version": SOFTWARE_VERSION,
        "proto": str(PROTO_VERSION),
        "device": device,
        "mem_total": str(vm.total),
        "mem_avail": str(vm.available),
        "grpc_port": str(grpc_port),
        "ring_port": str(ring_port),
        "link": link_kind(ip),
    }


class Advertiser:
    def __init__(self, ip: str, node_id: str, grpc_port: int, ring_port: int, device: str):
        from zeroconf import ServiceInfo, Zeroconf

        self.zeroconf = Zeroconf(interfaces=[ip])
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"{node_id}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(ip)],
            port=grpc_port,
            properties=txt_record(node_id, grpc_port, ring_port, ip, device),
            server=f"metal-cluster-{node_id}.local.",
        )
        self.zeroconf.register_service(self.info)

    def close(self):
        try:
            self.zeroconf.unregister_service(self.info)
        finally:
            self.zeroconf.close()
