"""`metal-cluster serve`: vLLM's own OpenAI API server, with our platform and executor underneath.

vLLM's argument parser stays the single source of serving flags; we only set defaults that suit
this machine and pass everything else through with vLLM's names.
"""

import json
import os
import re
import sys
import threading
import time
import urllib.request

from metal_cluster.coordinator.commands import start_times
from metal_cluster.coordinator.cluster.cluster_state import RUN_DIR_ENV
from metal_cluster.coordinator.engine.executor_env import LAYERS_ENV, STAGES_ENV
from metal_cluster.coordinator.api.http_routes import API_KEYS_ENV, LORA_CHECK_ENV
from metal_cluster.coordinator.engine.vllm_platform import ACTIVATE_ENV
from metal_cluster.stage_worker.model.model_source import ModelSource


def vllm_argv(source: ModelSource, served_name: str, host: str, port: int, extra: list[str]) -> list[str]:
    argv = [
        "--model", str(source.folder),
        "--host", host,
        "--port", str(port),
        "--enforce-eager",
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--middleware", "metal_cluster.coordinator.api.http_routes.cluster_routes",
        "--middleware", "metal_cluster.coordinator.api.admission.Admission",
    ]
    if not has_flag(extra, "--served-model-name"):
        argv += ["--served-model-name", served_name]
    return argv + extra  # argparse keeps the last value: the user's flags win


def has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def served_name(source: ModelSource) -> str:
    name = source.gguf.stem if source.gguf else source.folder.name
    return re.sub(r"\.(Q\d\w*|F16|F32|BF16)$", "", name)  # "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct"


def run(argv: list[str], stage_addresses: list[str] | None = None, run_dir=None,
        layer_ranges: list[tuple[int, int]] | None = None) -> None:
    os.environ[ACTIVATE_ENV] = "1"  # before vLLM resolves its platform; inherited by EngineCore
    if stage_addresses:
        os.environ[STAGES_ENV] = ",".join(stage_addresses)
    if layer_ranges:
        os.environ[LAYERS_ENV] = ",".join(f"{a}-{b}" for a, b in layer_ranges)
    if run_dir is not None:
        os.environ[RUN_DIR_ENV] = str(run_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local; never reach for a hub
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    start_given = "VLLM_WORKER_MULTIPROC_METHOD" in os.environ  # before vLLM's CLI set-up sets it

    import uvloop
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.common.startup import cli_env_setup
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from metal_cluster.coordinator.engine import vllm_options

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="metal-cluster serve"))
    args = parser.parse_args(argv)
    refused = vllm_options.refusal(parser, args)
    if refused:
        print(f"metal-cluster: error: {refused}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    if args.enable_lora:
        _check_lora_modules(args)
    if not start_given:
        _choose_engine_start(in_process_stage=not stage_addresses,
                             read_adapters_here=bool(args.enable_lora and args.lora_modules))
    if args.api_key:  # the dashboard route asks for the same key as the API
        os.environ[API_KEYS_ENV] = "\n".join(args.api_key if isinstance(args.api_key, list) else [args.api_key])
    _announce_when_ready(args)
    uvloop.run(run_server(args))


def _choose_engine_start(in_process_stage: bool, read_adapters_here: bool) -> None:
    """How vLLM starts EngineCore where the environment did not say (vLLM's CLI would spawn).

    A fork inherits torch and vLLM instead of importing them again (the default model's first
    answer: 14 s against 25 s spawned on two cores; bench/README.md). It is taken only where it is known to be safe: MLX on the CPU (Metal and CUDA contexts
    are not fork-safe), a single stage that runs inside EngineCore (with stage workers this process
    has already spoken gRPC, which is not fork-safe either), and no MLX evaluation here. A fork
    copies MLX's scheduler without the threads that serve it, so after one the child's first
    evaluation, loading its weights, waits forever. Checking --lora-modules evaluates the adapters
    in MLX; nothing else this process does before the engine starts does (importing MLX and
    mlx-lm, or turning a GGUF file into a folder, starts none of those threads)."""
    from metal_cluster.coordinator import blas

    fork = in_process_stage and not read_adapters_here and blas.mlx_on_cpu()
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork" if fork else "spawn"


def _check_lora_modules(args) -> None:
    """A bad --lora-modules adapter is one line before anything starts, not vLLM's traceback once the
    engine is up; the API server checks adapters loaded at run time the same way (http_routes.py)."""
    from metal_cluster.coordinator.engine.lora_adapters import LoRAAdapterError, read_adapter

    os.environ[LORA_CHECK_ENV] = json.dumps({"model": args.model, "max_rank": args.max_lora_rank})
    for module in args.lora_modules or ():
        try:
            read_adapter(module.path, module.name, args.model, args.max_lora_rank)
        except LoRAAdapterError as e:
            print(f"metal-cluster: error: --lora-modules: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None


def _announce_when_ready(args) -> None:
    """One summary line once the server answers: model, KV blocks and tokens, URL."""
    host = args.host or "127.0.0.1"
    url = f"http://{host}:{args.port}"

    def wait():
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    pass
                break
            except OSError:
                time.sleep(0.5)
        else:
            return
        blocks, block_size = _kv_from_metrics(url)
        names = ", ".join(args.served_model_name or [args.model])
        kv = f"KV {blocks} blocks x {block_size} = {blocks * block_size} tokens" if blocks else "KV size unknown"
        took = start_times.since_start()
        after = f" after {took:.1f} s" if took is not None else ""
        print(f"metal-cluster: ready{after}: model {names}; {kv}; OpenAI API at {url}/v1; dashboard at {url}/dashboard",
              flush=True)

    threading.Thread(target=wait, name="ready-announcer", daemon=True).start()


def _kv_from_metrics(url: str) -> tuple[int, int]:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0, 0
    m = re.search(r"vllm:cache_config_info\{([^}]*)\}", text)
    if not m:
        return 0, 0
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    try:
        return int(labels.get("num_gpu_blocks", 0)), int(labels.get("block_size", 0))
    except ValueError:
        return 0, 0
