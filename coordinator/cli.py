"""`metal-cluster`: the command line. Errors a user can fix are one line on stderr, never a traceback."""

import contextlib
import sys
from pathlib import Path

import typer

from metal_cluster.coordinator import blas
from metal_cluster.stage_worker.errors import ModelLoadError

app = typer.Typer(help="Serve LLMs from one Mac or a cluster of them (vLLM scheduler, MLX stages).", no_args_is_help=True)


def fail(message: str, code: int = 2):
    typer.echo(f"metal-cluster: error: {message}", err=True)
    raise typer.Exit(code)


@app.callback()
def main(
    ctx: typer.Context,
    config_file: str = typer.Option(None, "--config", envvar="METAL_CLUSTER_CONFIG", show_default=False,
                                    help="Config file. Default: ~/.config/metal-cluster/config.toml."),
):
    """Commands that run models preload OpenBLAS themselves (see blas.py); the others stay quiet."""
    import os

    from metal_cluster.coordinator.commands import start_times

    start_times.mark_started()
    from metal_cluster.coordinator import config
    from metal_cluster.stage_worker.net.auth import TOKEN_FILE_ENV

    try:
        path, table = config.read(config_file)
        # Every command's options default from the file: click hands each subcommand its own part.
        ctx.default_map, settings = config.defaults(path, table, ctx.command)
    except config.ConfigError as e:
        fail(str(e))
    if "token_file" in settings:
        os.environ.setdefault(TOKEN_FILE_ENV, settings["token_file"])  # the environment wins over the file


def _max_body_option():
    return typer.Option(8 * 2**20, min=1, help="Largest request body the OpenAI API reads (bytes); larger ones get 413.")


def _max_waiting_option():
    return typer.Option(512, min=0, help=(
        "Requests that may wait beyond the --max-num-seqs running ones; past that a request gets 503 with Retry-After."))


def _body_timeout_option():
    return typer.Option(30.0, min=0.1, help="Seconds a client has to send its whole request body; past that, 408.")


def _set_admission(max_body: int, max_waiting: int, body_timeout: float) -> None:
    import os

    from metal_cluster.coordinator.api import admission

    os.environ[admission.MAX_BODY_ENV] = str(max_body)
    os.environ[admission.MAX_WAITING_ENV] = str(max_waiting)
    os.environ[admission.BODY_TIMEOUT_ENV] = str(body_timeout)


def _stage_timeout_option():
    return typer.Option(
        0.75, min=0.3, help="Seconds a stage may miss heartbeats (sent ten times a second) before it counts as "
                            "lost and the cluster re-plans; raise it for hosts on Wi-Fi.")


def _resume_timeout_option():
    return typer.Option(
        120.0, min=0, help="Seconds a request running when a stage is lost waits for the new plan (then it "
                           "resumes where it stopped) before it ends with a retryable error.")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model: str = typer.Argument(None, help="Model folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct."),
    host: str = typer.Option("127.0.0.1", help="Address the OpenAI API listens on."),
    port: int = typer.Option(8000, help="Port of the OpenAI API."),
    gpu_memory_utilization: float = typer.Option(
        0.5, min=0.01, max=0.95, help="Fraction of this host's memory for weights, activations and the KV cache."
    ),
    pipeline_parallel_size: int = typer.Option(
        1, "--pipeline-parallel-size", "-pp", min=1, help="Split the layers over this many local stage-worker processes."
    ),
    stage_timeout: float = _stage_timeout_option(),
    resume_timeout: float = _resume_timeout_option(),
    max_request_body_bytes: int = _max_body_option(),
    max_waiting_requests: int = _max_waiting_option(),
    request_body_timeout: float = _body_timeout_option(),
):
    """Serve the OpenAI API on this machine. Other flags go to vLLM with vLLM's names
    (--max-model-len, --max-num-seqs, --gpu-memory-utilization, --api-key, --tool-call-parser, ...)."""
    blas.use_openblas_if_present()
    model, extra = _split_model_arg(model, ctx)
    source = _resolve(model)
    extra = _backend_defaults(extra)
    workers = pipeline_parallel_size if pipeline_parallel_size > 1 else 0
    _set_stage_timeout(stage_timeout, resume_timeout)
    _set_admission(max_request_body_bytes, max_waiting_requests, request_body_timeout)
    typer.echo(f"metal-cluster: serving {_served_name(source)} on one machine", err=True)
    _run_server(source, host, port, gpu_memory_utilization, extra, local_stages=workers)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def up(
    ctx: typer.Context,
    model: str = typer.Argument(None, help="Model folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct."),
    host: str = typer.Option("127.0.0.1", help="Address the OpenAI API listens on."),
    port: int = typer.Option(8000, help="Port of the OpenAI API."),
    gpu_memory_utilization: float = typer.Option(0.5, min=0.01, max=0.95, help="Share of each host's memory."),
    interface: str = typer.Option(None, "--interface", "--advertise-ip",
                                  help="Interface name or IPv4 address for mDNS, gRPC and the ring."),
    peers: str = typer.Option(None, help="Static workers host:port,... (where mDNS cannot reach)."),
    mdns: bool = typer.Option(True, help="Browse for workers with Bonjour (mDNS)."),
    min_workers: int = typer.Option(0, min=0, help="Wait for at least this many workers."),
    discovery_timeout: float = typer.Option(5.0, help="Seconds to browse for workers."),
    local_worker: bool = typer.Option(True, help="Run a stage on this host too."),
    cluster_token: str = typer.Option(None, help="Shared secret (else $METAL_CLUSTER_TOKEN, else the token file)."),
    stage_timeout: float = _stage_timeout_option(),
    resume_timeout: float = _resume_timeout_option(),
    max_request_body_bytes: int = _max_body_option(),
    max_waiting_requests: int = _max_waiting_option(),
    request_body_timeout: float = _body_timeout_option(),
    weights_over_tls: bool = typer.Option(
        False, help="Send weights to workers over TLS too (slower). By default they travel in the clear, each "
                    "piece checked against the manifest's hash, which comes over TLS."),
):
    """Coordinate a cluster: discover workers, place the layers, start the stages, serve the OpenAI API."""
    import os

    from rich.console import Console

    from metal_cluster.coordinator.cluster import placement
    from metal_cluster.coordinator.commands import up as cluster
    from metal_cluster.stage_worker.net.auth import TOKEN_ENV, resolve_token

    blas.use_openblas_if_present()
    model, extra = _split_model_arg(model, ctx)
    source = _resolve(model)
    token = resolve_token(cluster_token)
    if not token:
        fail(f"no cluster token: run `metal-cluster token` and copy the file to every host, "
             f"or pass --cluster-token / set {TOKEN_ENV}")
    os.environ[TOKEN_ENV] = token  # for the executor and the local worker
    _set_stage_timeout(stage_timeout, resume_timeout)
    _set_admission(max_request_body_bytes, max_waiting_requests, request_body_timeout)
    console = Console(stderr=True, soft_wrap=True)  # one line per event, whatever the width
    try:
        ip = cluster.interface_ip(interface)
        hosts = cluster.discover(ip, peers, mdns, discovery_timeout, min_workers, token, console)
    except cluster.UpError as e:
        fail(str(e), code=1)
    if not hosts:
        typer.echo("metal-cluster: no workers found: serving on this machine alone", err=True)
        _run_server(source, host, port, gpu_memory_utilization, extra)
        return
    memory = _host_memory()
    if local_worker:
        from metal_cluster.stage_worker.model.dtypes import on_gpu  # MLX: only when this host runs a stage

        hosts = hosts + [placement.Host("this-host", "local", memory, local=True, gpu=on_gpu())]
    from metal_cluster.coordinator.engine import speculation

    bad_speculation = speculation.problem(extra, source.folder)
    if bad_speculation:
        fail(bad_speculation)
    on_gpu = all(h.gpu for h in hosts)
    cost = placement.ModelCost.of_model(source.folder, source.config, on_gpu=on_gpu)
    cost = placement.with_drafter(cost, source.folder, source.config, *speculation.drafter(extra), on_gpu=on_gpu)
    kv_tokens = _max_model_len(extra, source.config)
    try:
        stages = placement.plan(hosts, cost, gpu_memory_utilization, kv_tokens)
    except placement.PlacementError as e:
        fail(str(e), code=1)
    cluster.show_plan(stages, console)
    store = None
    if any(not s.host.local for s in stages):  # hosts without a copy fetch their layers from here
        try:
            store = cluster.start_model_store(source, _served_name(source), ip, token, console, weights_over_tls)
            stages = cluster.leave_out_hosts_without_room(
                stages, hosts, lambda hosts: placement.plan(hosts, cost, gpu_memory_utilization, kv_tokens),
                store, token, console, mtp=speculation.method(extra) == "mtp")
        except (ModelLoadError, OSError, placement.PlacementError) as e:
            if store:
                store.stop()
            fail(str(e), code=1)
    try:
        _run_server(source, host, port, gpu_memory_utilization, extra, planned=stages, local_ip=ip)
    finally:
        if store:
            store.stop()


# On MLX's CPU backend a step's cost grows with every sequence in it, and the KV pool (sized by
# --max-num-seqs x --max-model-len, committed at start) costs start time: vLLM's 256 sequences of
# 8192 tokens would take the whole memory share (11 GiB for SmolLM2-135M) and a minute to commit.
CPU_MAX_NUM_SEQS = 8


def _backend_defaults(extra: list[str]) -> list[str]:
    from metal_cluster.coordinator.commands.serve import has_flag

    if blas.mlx_on_cpu() and not has_flag(extra, "--max-num-seqs"):
        return ["--max-num-seqs", str(CPU_MAX_NUM_SEQS), *extra]
    return extra


def _set_stage_timeout(seconds: float, resume_s: float) -> None:
    import os

    from metal_cluster.coordinator.engine.executor_env import RESUME_TIMEOUT_ENV, STAGE_TIMEOUT_ENV

    os.environ[STAGE_TIMEOUT_ENV] = str(seconds)  # read by the executor, in vLLM's engine process
    os.environ[RESUME_TIMEOUT_ENV] = str(resume_s)


def _host_memory() -> int:
    import psutil

    return psutil.virtual_memory().total


def _max_model_len(extra: list[str], config: dict) -> int:
    for i, arg in reversed(list(enumerate(extra))):  # the last one wins, as in vLLM
        if arg == "--max-model-len" and i + 1 < len(extra):
            return int(extra[i + 1])
        if arg.startswith("--max-model-len="):
            return int(arg.split("=", 1)[1])
    return int(config.get("max_position_embeddings") or 4096)


def _split_model_arg(model, ctx):
    """MODEL and the vLLM flags. The config file's `vllm_args` go first, so the command line's win."""
    extra = list(ctx.args)
    if model is not None and model.startswith("-"):  # a vLLM flag, not a model: no MODEL was given
        extra.insert(0, model)
        model = ctx.lookup_default("model")  # the config file's, if it names one
    return model, [*(ctx.default_map or {}).get("vllm_args", ()), *extra]


def _resolve(model):
    from metal_cluster.stage_worker.model.model_source import resolve_model

    try:
        return resolve_model(model)
    except ModelLoadError as e:
        fail(str(e))


def _served_name(source):
    from metal_cluster.coordinator.commands import serve as server

    return server.served_name(source)


def _run_server(source, host, port, utilization, extra, local_stages=0, planned=None, local_ip="127.0.0.1"):
    """vLLM's API server over our stages: `local_stages` worker processes of ours, or a `planned`
    placement over remote workers (plus one local worker where the plan has a stage on this host)."""
    import os

    from metal_cluster.coordinator.cluster import local_workers
    from metal_cluster.coordinator.engine import speculation
    from metal_cluster.coordinator.commands import serve as server
    from metal_cluster.coordinator.engine.executor_env import LOCAL_STAGES_ENV

    bad_speculation = speculation.problem(extra, source.folder)
    if bad_speculation:
        fail(bad_speculation)
    extra = speculation.with_draft_folder(extra)
    extra = extra + ["--gpu-memory-utilization", str(utilization)]
    if planned:
        local_stages = sum(1 for s in planned if s.host.local)
    try:
        with local_workers.started(local_stages, host=local_ip, avoid=(port,)) as workers, \
                run_registration(host, port, source, workers) as run_dir:
            os.environ[LOCAL_STAGES_ENV] = ",".join(w.address for w in workers)  # they read our path
            local_addresses = iter(w.address for w in workers)
            if planned:
                addresses = [next(local_addresses) if s.host.local else s.host.grpc_address for s in planned]
                ranges = [(s.start, s.end) for s in planned]
            else:
                addresses, ranges = [w.address for w in workers], None
            if len(addresses) > 1:
                extra += ["--pipeline-parallel-size", str(len(addresses))]
            argv = server.vllm_argv(source, server.served_name(source), host, port, extra)
            server.run(argv, addresses, run_dir, ranges)
    except KeyboardInterrupt:
        raise typer.Exit(130)
    except local_workers.WorkerStartError as e:
        fail(str(e), code=1)
    except Exception as e:  # vLLM's own errors: the engine has already logged the reason
        fail(f"the server stopped: {' '.join(str(e).split())[:300]}", code=1)


@contextlib.contextmanager
def run_registration(host, port, source, workers):
    """Tell `status` and `down` on this machine who we are, for as long as we serve."""
    import os
    import shutil
    import time

    from metal_cluster.coordinator.cluster import cluster_state

    run_dir = cluster_state.run_dir_for(port)
    shutil.rmtree(run_dir, ignore_errors=True)
    cluster_state.write_json(run_dir / cluster_state.COORDINATOR, {
        "url": f"http://{host}:{port}", "pid": os.getpid(), "model": source.folder.name,
        "started": time.time(), "worker_pids": [w.pid for w in workers],
    })
    try:
        yield run_dir
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@app.command()
def status(
    url: str = typer.Option(None, envvar="METAL_CLUSTER_URL", help="The coordinator's API base URL."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
    watch: bool = typer.Option(False, "--watch", help="Refresh in place until Ctrl-C."),
):
    """Show the cluster: nodes, stages and layer ranges, KV use, requests, tokens/s."""
    from metal_cluster.coordinator.commands import status as view

    try:
        view.show(view.find_url(url), as_json, watch)
    except view.StatusError as e:
        fail(str(e), code=1)


@app.command()
def down(
    url: str = typer.Option(None, envvar="METAL_CLUSTER_URL", help="The coordinator's API base URL."),
    timeout: float = typer.Option(30.0, help="Seconds running requests may take to finish before they are ended."),
    workers_too: bool = typer.Option(False, "--workers-too", help="Also stop the remote worker daemons."),
):
    """Drain (no new requests, running ones finish), then stop the coordinator and its stages."""
    from metal_cluster.coordinator.commands import status as view

    try:
        view.bring_down(view.find_url(url), timeout, workers_too)
    except view.StatusError as e:
        fail(str(e), code=1)


@app.command()
def rebalance(
    url: str = typer.Option(None, envvar="METAL_CLUSTER_URL", help="The coordinator's API base URL."),
    peers: str = typer.Option(None, help="Workers to add, host:port,... (returning or new ones)."),
    mdns: bool = typer.Option(False, help="Also add idle workers found with Bonjour (mDNS) on --interface."),
    interface: str = typer.Option(None, "--interface", help="Interface name or IPv4 address to browse on."),
    discovery_timeout: float = typer.Option(5.0, help="Seconds to browse for workers."),
    timeout: float = typer.Option(300.0, help="Seconds to wait for the new plan."),
    drain_timeout: float = typer.Option(30.0, min=0, help="Seconds running requests may take to finish first."),
    cluster_token: str = typer.Option(None, help="Shared secret (else $METAL_CLUSTER_TOKEN, else the token file)."),
):
    """Re-plan a running cluster over its stages plus workers that came back or are new (a worker never
    joins mid-traffic by itself). Running requests finish first, new ones wait for the new plan; what
    still runs after --drain-timeout ends with a retryable error."""
    from rich.console import Console

    from metal_cluster.coordinator.commands import status as view
    from metal_cluster.coordinator.commands import up as cluster
    from metal_cluster.stage_worker.net.auth import resolve_token

    console = Console(stderr=True, soft_wrap=True)
    try:
        target = view.find_url(url)
        addresses = []
        if peers or mdns:
            token = resolve_token(cluster_token)
            ip = cluster.interface_ip(interface)
            hosts = cluster.discover(ip, peers, mdns, discovery_timeout, 0, token, console)
            addresses = [h.grpc_address for h in hosts]
        view.rebalance(target, addresses, timeout, drain_timeout)
    except (view.StatusError, cluster.UpError) as e:
        fail(str(e), code=1)


@app.command()
def worker(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", help="Address the stage's gRPC service listens on."),
    interface: str = typer.Option(None, help="Interface name (en0) or IPv4 address to listen on and announce, "
                                             "instead of --host (a --host on the command line wins)."),
    port: int = typer.Option(7760, help="gRPC port."),
    ring_port: int = typer.Option(None, help="Port of the MLX ring data plane. Default: gRPC port + 1."),
    cluster_token: str = typer.Option(None, help="Shared secret (else $METAL_CLUSTER_TOKEN, else the token file)."),
    advertise: bool = typer.Option(True, help="Announce this worker with Bonjour (mDNS) on --host's interface."),
    advertise_ip: str = typer.Option(None, help="Address to announce (default: --host)."),
    install_service: bool = typer.Option(False, "--install-service", help=(
        "Run this worker as a service instead (launchd agent on macOS, systemd user unit on Linux), with the "
        "flags given here; the config file still applies at each start.")),
    uninstall_service: bool = typer.Option(False, "--uninstall-service", help="Stop and remove that service."),
    cache_limit: float = typer.Option(
        0, min=0, help="GiB of fetched weights to keep in the cache; tensors no stage here needs now (other "
                       "models', layers given away) go first, least recently used first (0: no limit)."),
    coordinator_timeout: float = typer.Option(
        30.0, min=1, help="Seconds without a heartbeat from its coordinator before a serving worker frees itself."),
):
    """Run a stage-worker daemon: it waits for a coordinator to assign it layers."""
    from metal_cluster.stage_worker.net.auth import TOKEN_ENV, resolve_token

    if install_service or uninstall_service:
        return _worker_service(ctx, install_service, uninstall_service)
    token = resolve_token(cluster_token)
    if not token:
        fail(f"no cluster token: run `metal-cluster token` once and copy the file to every host, "
             f"or pass --cluster-token / set {TOKEN_ENV}")
    if interface and not _typed_here(ctx, "host"):
        host = _interface_address(interface)
    from metal_cluster.stage_worker import standby

    standby.pause_after_hand_over()
    blas.use_openblas_if_present()
    import logging

    from metal_cluster.stage_worker.model.lean_mlx_lm import skip_tokenizer_side

    skip_tokenizer_side()  # a stage never tokenizes: its restart at every re-plan skips transformers and torch
    from metal_cluster.stage_worker.server import serve as serve_stage

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        announce = (advertise_ip or host) if advertise else None
        if announce == "0.0.0.0":
            fail("--host 0.0.0.0 listens everywhere; name the address to announce with --advertise-ip")
        serve_stage(host, port, ring_port or port + 1, token, announce, coordinator_timeout,
                    cache_limit=int(cache_limit * 2**30))
    except OSError as e:
        fail(str(e))


cache_app = typer.Typer(help="List or prune this host's cache of fetched weights (what `worker` keeps).")
app.add_typer(cache_app, name="cache")


@cache_app.callback(invoke_without_command=True)
def cache(ctx: typer.Context):
    """List the stages whose tensors this host's cache holds ($METAL_CLUSTER_CACHE or ~/.cache/metal-cluster)."""
    if ctx.invoked_subcommand:
        return
    from metal_cluster.stage_worker.model.model_source import cache_dir
    from metal_cluster.stage_worker.transfer import cache_admin

    root = cache_dir()
    found = cache_admin.stages(root)
    typer.echo(f"cache {root}: {cache_admin.total_bytes(root) / 2**20:.1f} MiB")
    for s in found:
        typer.echo(f"  {s.model} ({s.manifest}) layers [{s.layers[0]}, {s.layers[1]}): {s.tensors} of {s.wanted} "
                   f"tensors, {s.bytes / 2**20:.1f} MiB, used {cache_admin.ago(s.last_used)}")
    if not found:
        typer.echo("  no stage's weights")


@cache_app.command("prune")
def cache_prune(max_size: float = typer.Option(0, min=0, help="GiB of tensors to keep, the most recently used "
                                                              "(0: remove every cached weight).")):
    """Remove cached tensors, least recently used first, down to --max-size; a stage that needs one
    again fetches it."""
    from metal_cluster.stage_worker.model.model_source import cache_dir
    from metal_cluster.stage_worker.transfer import cache_admin

    removed, freed = cache_admin.prune(cache_dir(), int(max_size * 2**30))
    typer.echo(f"cache {cache_dir()}: removed {removed} tensor file(s), freed {freed / 2**20:.1f} MiB; "
               f"{cache_admin.total_bytes(cache_dir()) / 2**20:.1f} MiB left")


@app.command()
def token():
    """Create the cluster token file (once) and print its path and token: copy it to every host."""
    from metal_cluster.stage_worker.net.auth import create_token_file

    path, secret = create_token_file()
    typer.echo(f"{path}\n{secret}")


@app.command()
def doctor(
    ctx: typer.Context,
    role: str = typer.Option("serve", "--for", help="What this host is for: serve (one machine, the default), "
                                                   "up (the coordinator of a cluster) or worker."),
    interface: str = typer.Option(None, "--interface", help="Interface name or IPv4 address to check (as `up` and "
                                                            "`worker` would use it). Default: loopback."),
    host: str = typer.Option("127.0.0.1", help="Address the ports are checked on."),
    port: int = typer.Option(8000, help="The OpenAI API's port (serve, up)."),
    worker_port: int = typer.Option(7760, help="A worker's gRPC port; its ring port is the next one."),
    mdns: bool = typer.Option(True, help="Check that an mDNS announcement on the interface is seen there "
                                         "(up and worker)."),
):
    """Check what this host needs (Python, MLX, OpenBLAS, token file, config, ports, interface, mDNS):
    one line per check, with the fix when it fails; exits 1 when one fails. A missing token file is a
    warning for serve and a failure for up and worker."""
    from metal_cluster.coordinator.commands import doctor as checks

    if role not in checks.ROLES:
        fail(f"--for {role}: not a role; use one of {', '.join(checks.ROLES)}")
    api = [("API", port, "--port")]
    workers = [("worker gRPC", worker_port, "worker --port"), ("worker ring", worker_port + 1, "worker --ring-port")]
    ports = {"serve": api, "up": api + workers, "worker": workers}[role]
    results = checks.run(role, ctx.find_root().params.get("config_file"), host, ports, interface, mdns)
    for check in results:
        typer.echo(check.line())
    failed = [c for c in results if not c.ok]
    warned = sum(c.warning for c in results)
    typer.echo(f"{len(results) - len(failed)} of {len(results)} checks passed"
               + (f" ({warned} with a warning)" if warned else "") + f", for {role}")
    if failed:
        raise typer.Exit(1)


@app.command()
def generate(
    model: str = typer.Argument(None, help="Model folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct."),
    prompt: str = typer.Option("The capital of France is", "--prompt", "-p"),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1),
    chat: bool = typer.Option(True, help="Wrap the prompt in the model's chat template."),
):
    """Generate one answer on this machine, without a server."""
    blas.use_openblas_if_present()
    from metal_cluster.coordinator.commands.oneshot import generate as run
    from metal_cluster.stage_worker.model.model_source import resolve_model

    try:
        source = resolve_model(model)
        for text in run(source, prompt, max_tokens, chat=chat):
            sys.stdout.write(text)
            sys.stdout.flush()
    except ModelLoadError as e:
        fail(str(e))
    sys.stdout.write("\n")


def _typed_here(ctx, name: str) -> bool:
    """Whether the option was on the command line (not from the environment, config file or default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _interface_address(interface: str) -> str:
    import ipaddress

    import psutil

    from metal_cluster.coordinator.commands.up import UpError, interface_ip

    try:
        address = interface_ip(interface)
        ipaddress.IPv4Address(address)
        return address
    except UpError as e:
        fail(str(e))
    except ValueError:
        fail(f"--interface {interface}: no such interface or IPv4 address "
             f"(interfaces here: {', '.join(sorted(psutil.net_if_addrs()))})")


def _worker_service(ctx, install: bool, uninstall: bool):
    """`worker --install-service` / `--uninstall-service`: the service runs this same executable."""
    from metal_cluster.coordinator.commands import services
    from metal_cluster.stage_worker.net.auth import token_file

    if install and uninstall:
        fail("--install-service or --uninstall-service: pick one")
    service = services.for_host("worker")
    try:
        if uninstall:
            typer.echo(services.uninstall(service))
            return
        if _typed_here(ctx, "cluster_token"):
            fail("--install-service keeps --cluster-token out of the service file (others can read it): "
                 "put the token in the token file (`metal-cluster token`) instead")
        if not token_file().is_file():
            fail(f"no token file at {token_file()}: the service could not start; run `metal-cluster token` "
                 f"on one host and copy its file here first")
        root = ctx.find_root()
        config = ["--config", str(Path(root.params["config_file"]).expanduser().resolve())] \
            if root.params.get("config_file") else []
        skip = ("install_service", "uninstall_service", "cluster_token")
        argv = services.executable() + config + ["worker"] + services.flags_given(ctx, skip)
        typer.echo(services.install(service, argv))
    except services.ServiceError as e:
        fail(str(e), code=1)
    except OSError as e:
        fail(f"{e.filename or service.path}: {e.strerror}", code=1)
