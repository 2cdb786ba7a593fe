"""`metal-cluster up`: find workers, check they share our token, and plan who runs which layers."""

import time
from concurrent.futures import ThreadPoolExecutor

import psutil
from rich.console import Console
from rich.table import Table

from metal_cluster.coordinator.cluster.discovery import Found, browse, static_peers
from metal_cluster.coordinator.cluster.placement import Host, StagePlan
from metal_cluster.coordinator.cluster.stages import RemoteStage, StageCallError
from metal_cluster.proto import PROTO_VERSION, pb


ORPHANED_S = 3.0  # three missed heartbeats: the worker's coordinator is gone


class UpError(RuntimeError):
    pass


def interface_ip(interface: str | None) -> str:
    """An IPv4 address, or an interface name resolved to its IPv4 address."""
    if not interface:
        return "127.0.0.1"
    addrs = psutil.net_if_addrs()
    if interface in addrs:
        for a in addrs[interface]:
            if a.family.name == "AF_INET":
                return a.address
        raise UpError(f"interface {interface} has no IPv4 address")
    return interface


def discover(ip: str, peers: str | None, mdns: bool, timeout_s: float, min_workers: int, token: str,
             console: Console) -> list[Host]:
    found: list[Found] = static_peers(peers)
    if mdns:
        console.print(f"looking for workers on {ip} (mDNS, up to {timeout_s:.0f}s)...")
        found += browse(ip, timeout_s, min_workers,
                        progress=lambda f: console.print(f"  found {f.node or f.address} at {f.address} ({f.device})"))
    hosts, seen = [], set()
    for f in found:
        if f.address in seen:
            continue
        seen.add(f.address)
        host = _check(f, token, console, deadline=time.monotonic() + timeout_s)
        if host:
            hosts.append(host)
    if len(hosts) < min_workers:
        raise UpError(f"found {len(hosts)} usable worker(s), --min-workers asks for {min_workers}")
    return hosts


def _check(found: Found, token: str, console: Console, deadline: float) -> Host | None:
    """The worker's health, waiting until `deadline` for one that is still starting."""
    stage = RemoteStage(found.address, token=token)
    try:
        health = stage.wait_ready(deadline)
        if health.state != "idle":
            health = _claim_if_orphaned(stage, health, console, deadline)
    except StageCallError as e:
        console.print(f"  left out {found.address}: {e}")
        return None
    finally:
        stage.close()
    if health is None:
        return None
    return Host(name=health.node_id, grpc_address=found.address, memory_total=health.host_memory_bytes,
                wired=found.link != "wifi", ring_port=health.ring_port, gpu=health.device.endswith("gpu"))


def _claim_if_orphaned(stage: RemoteStage, health, console: Console, deadline: float):
    """A busy worker whose coordinator stopped sending heartbeats (it crashed or restarted) is reset and
    used; one that still hears from its coordinator belongs to another cluster and is left out."""
    from metal_cluster.coordinator.cluster.replan import wait_idle

    while health.coordinator_silent_s < ORPHANED_S:
        if time.monotonic() >= deadline:
            console.print(f"  left out {stage.name}: it is {health.state} for another coordinator")
            return None
        time.sleep(0.5)
        health = stage.health()
    console.print(f"  {stage.name} was left {health.state} by a coordinator that is gone "
                  f"({health.coordinator_silent_s:.0f}s without heartbeats): resetting it")
    stage.reset("a new coordinator claims this orphaned stage")
    return wait_idle(stage, time.monotonic() + 60)


def start_model_store(source, name: str, ip: str, token: str, console: Console, weights_over_tls: bool = False):
    """Serve the model to workers that have no copy; its manifest is hashed once (cached after)."""
    import os

    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from metal_cluster.coordinator.cluster import model_store
    from metal_cluster.coordinator.engine.executor_env import MANIFEST_ENV, MODEL_STORE_ENV

    with Progress("hashing the model for workers", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("hash", total=None)
        store = model_store.start(source, name, ip, token, weights_over_tls=weights_over_tls,
                                  progress=lambda done, total: bar.update(task, completed=done, total=total))
    size = sum(f.size for f in store.manifest.files)
    how = "over TLS" if weights_over_tls else f"in the clear on port {store.manifest.bulk_port}, hash-checked"
    console.print(f"model store: {len(store.manifest.files)} files, {size / 2**20:.1f} MiB "
                  f"(manifest {store.manifest.sha256[:12]}) at {store.address}: workers fetch their layers "
                  f"from here ({how})")
    os.environ[MODEL_STORE_ENV] = store.address
    os.environ[MANIFEST_ENV] = store.manifest.sha256
    return store


def show_plan(stages: list[StagePlan], console: Console) -> None:
    table = Table(title="placement")
    for col in ("stage", "node", "address", "memory", "layers"):
        table.add_column(col)
    for k, s in enumerate(stages):
        table.add_row(str(k), s.host.name + (" (this host)" if s.host.local else ""), s.host.grpc_address,
                      f"{s.host.memory_total / 2**30:.0f} GiB", f"[{s.start}, {s.end})")
    console.print(table)


def leave_out_hosts_without_room(stages: list[StagePlan], hosts: list[Host], replan, store, token: str,
                                 console: Console, mtp: bool = False) -> list[StagePlan]:
    """Ask each worker of the plan whether its cache can hold its layers' weights (the last one's
    with the checkpoint's MTP layers, for `mtp`); plan again (`replan(hosts)`) without those that
    cannot, until all can. Each round leaves one out at least, so it ends: with a plan, or with the
    PlacementError of hosts too few to hold the model."""
    while True:
        remote = [s for s in stages if not s.host.local]
        last = stages[-1]
        with ThreadPoolExecutor(max_workers=max(1, len(remote))) as pool:
            refusals = dict(zip((s.host.grpc_address for s in remote),
                                pool.map(lambda s: _room_refusal(s, store, token, mtp and s is last), remote)))
        refused = {address: why for address, why in refusals.items() if why}
        if not refused:
            return stages
        for address, why in refused.items():
            console.print(f"  left out {address}: {why}")
        hosts = [h for h in hosts if h.grpc_address not in refused]
        stages = replan(hosts)
        show_plan(stages, console)


def _room_refusal(stage: StagePlan, store, token: str, mtp: bool = False) -> str:
    """Why the stage's host cannot hold its layers ("" if it can)."""
    remote = RemoteStage(stage.host.grpc_address, token=token)
    try:
        return remote.weights_room(pb.WeightsRoomRequest(
            version=PROTO_VERSION, model_store=store.address, manifest_sha256=store.manifest.sha256,
            layer_start=stage.start, layer_end=stage.end, spec_mtp=mtp)).refusal
    except StageCallError as e:
        return f"cannot fetch its layers from this coordinator: {e}"
    finally:
        remote.close()
