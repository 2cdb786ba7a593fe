"""`metal-cluster`: the command line. Errors a user can fix are one line on stderr, never a traceback."""

import contextlib
import sys

import typer

from metal_cluster.coordinator import blas
from metal_cluster.stage_worker.errors import ModelLoadError

app = typer.Typer(help="Serve LLMs from one Mac or a cluster of them (vLLM scheduler, MLX stages).", no_args_is_help=True)


def fail(message: str, code: int = 2):
    typer.echo(f"metal-cluster: error: {message}", err=True)
    raise typer.Exit(code)


@app.callback()
def main():
    """Commands that run models preload OpenBLAS themselves (see blas.py); the others stay quiet."""


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
):
    """Serve the OpenAI API on this machine. Other flags go to vLLM with vLLM's names
    (--max-model-len, --max-num-seqs, --gpu-memory-utilization, --api-key, --tool-call-parser, ...)."""
    blas.use_openblas_if_present()
    from metal_cluster.coordinator import local_workers
    from metal_cluster.coordinator import serve as server
    from metal_cluster.stage_worker.model_source import resolve_model

    extra = list(ctx.args)
    if model is not None and model.startswith("-"):  # a vLLM flag, not a model: no MODEL was given
        extra.insert(0, model)
        model = None
    try:
        source = resolve_model(model)
    except ModelLoadError as e:
        fail(str(e))
    typer.echo(f"metal-cluster: serving {server.served_name(source)} on one machine", err=True)
    extra += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    try:
        with local_workers.started(pipeline_parallel_size, gpu_memory_utilization) as workers, \
                run_registration(host, port, source, workers) as run_dir:
            addresses = [w.address for w in workers]
            if addresses:
                extra += ["--pipeline-parallel-size", str(pipeline_parallel_size)]
            server.run(server.vllm_argv(source, server.served_name(source), host, port, extra), addresses, run_dir)
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

    from metal_cluster.coordinator import cluster_state

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
    from metal_cluster.coordinator import status as view

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
    from metal_cluster.coordinator import status as view

    try:
        view.bring_down(view.find_url(url), timeout, workers_too)
    except view.StatusError as e:
        fail(str(e), code=1)


@app.command()
def worker(
    host: str = typer.Option("127.0.0.1", help="Address the stage's gRPC service listens on."),
    port: int = typer.Option(7760, help="gRPC port."),
    ring_port: int = typer.Option(None, help="Port of the MLX ring data plane. Default: gRPC port + 1."),
    cluster_token: str = typer.Option(None, help="Shared secret (else $METAL_CLUSTER_TOKEN, else the token file)."),
):
    """Run a stage-worker daemon: it waits for a coordinator to assign it layers."""
    from metal_cluster.stage_worker.auth import TOKEN_ENV, resolve_token

    token = resolve_token(cluster_token)
    if not token:
        fail(f"no cluster token: run `metal-cluster token` once and copy the file to every host, "
             f"or pass --cluster-token / set {TOKEN_ENV}")
    blas.use_openblas_if_present()
    import logging

    from metal_cluster.stage_worker.server import serve as serve_stage

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        serve_stage(host, port, ring_port or port + 1, token)
    except OSError as e:
        fail(str(e))


@app.command()
def token():
    """Create the cluster token file (once) and print its path and token: copy it to every host."""
    from metal_cluster.stage_worker.auth import create_token_file

    path, secret = create_token_file()
    typer.echo(f"{path}\n{secret}")


@app.command()
def generate(
    model: str = typer.Argument(None, help="Model folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct."),
    prompt: str = typer.Option("The capital of France is", "--prompt", "-p"),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1),
    chat: bool = typer.Option(True, help="Wrap the prompt in the model's chat template."),
):
    """Generate one answer on this machine, without a server."""
    blas.use_openblas_if_present()
    from metal_cluster.coordinator.oneshot import generate as run
    from metal_cluster.stage_worker.model_source import resolve_model

    try:
        source = resolve_model(model)
        for text in run(source, prompt, max_tokens, chat=chat):
            sys.stdout.write(text)
            sys.stdout.flush()
    except ModelLoadError as e:
        fail(str(e))
    sys.stdout.write("\n")
