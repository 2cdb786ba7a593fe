"""Finding workers: Bonjour (mDNS) browsing on one interface, plus static --peers."""

import time
from dataclasses import dataclass

from metal_cluster.stage_worker.net.advertise import SERVICE_TYPE


@dataclass
class Found:
    address: str  # gRPC host:port
    node: str = ""
    device: str = ""
    memory_total: int = 0
    link: str = "wired"
    source: str = "mdns"


def browse(interface_ip: str, timeout_s: float, min_workers: int, progress=None) -> list[Found]:
    """Workers announcing themselves on `interface_ip`'s network, waiting up to timeout_s
    (less once min_workers answered, after a short settle)."""
    from zeroconf import ServiceBrowser, Zeroconf

    zeroconf = Zeroconf(interfaces=[interface_ip])
    names: set[str] = set()

    def on_change(zeroconf, service_type, name, state_change):
        names.add(name)

    browser = ServiceBrowser(zeroconf, SERVICE_TYPE, handlers=[on_change])
    found: dict[str, Found] = {}
    deadline = time.monotonic() + timeout_s
    settle_until = None
    try:
        while time.monotonic() < deadline:
            for name in list(names - set(found)):
                info = zeroconf.get_service_info(SERVICE_TYPE, name, timeout=2000)
                if info is not None and info.parsed_addresses():
                    found[name] = _to_found(info)
                    if progress:
                        progress(found[name])
            if min_workers and len(found) >= min_workers:
                settle_until = settle_until or time.monotonic() + 1.0
                if time.monotonic() >= settle_until:
                    break
            time.sleep(0.2)
    finally:
        browser.cancel()
        zeroconf.close()
    return list(found.values())


def _to_found(info) -> Found:
    txt = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
    return Found(
        address=f"{info.parsed_addresses()[0]}:{info.port}",
        node=txt.get("node", ""),
        device=txt.get("device", ""),
        memory_total=int(txt.get("mem_total", 0) or 0),
        link=txt.get("link", "wired"),
    )


def static_peers(peers: str | None) -> list[Found]:
    return [Found(address=p.strip(), source="static") for p in (peers or "").split(",") if p.strip()]
