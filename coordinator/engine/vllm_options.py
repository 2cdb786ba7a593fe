"""Which of vLLM's serving options metal-cluster honours, and the one line that refuses the rest.

vLLM's front end, scheduler and KV cache manager run here unchanged, so their options work. What
vLLM's own torch model runner, kernels, devices and parallel layouts would do is done by MLX stages,
so those options would be silently ignored: a value other than the default is refused before
anything starts. Options are reviewed by vLLM's argument group (`GROUPS`) with the exceptions
named (`OPTIONS`); an option of a group not reviewed here (a newer vLLM) is refused.

`python -m metal_cluster.coordinator.engine.vllm_options` prints the README's tables (the serve
options, then the request fields, whose refusals are vllm_platform.UNSUPPORTED_SAMPLING).
"""

import argparse
from dataclasses import dataclass

WORKS, REFUSED = "works", "refused"


@dataclass(frozen=True)
class Verdict:
    status: str  # WORKS or REFUSED
    note: str = ""


RUNNER = "tunes vLLM's torch model runner; MLX stages run the model here"
GROUPS = {
    "options": Verdict(WORKS, "the API server and engine process, as vLLM runs them"),
    "Frontend": Verdict(WORKS, "vLLM's OpenAI server runs unchanged"),
    "ModelConfig": Verdict(REFUSED, "changes how vLLM's torch runner loads or runs the model; the stages read "
                                    "the checkpoint themselves"),
    "LoadConfig": Verdict(REFUSED, "vLLM's weight loader; the stages map the checkpoint themselves"),
    "AttentionConfig": Verdict(REFUSED, "the stages run their own paged attention"),
    "MambaConfig": Verdict(REFUSED, "the stages run their own Gated DeltaNet kernels"),
    "StructuredOutputsConfig": Verdict(WORKS, "grammars run in vLLM's scheduler; the stages apply its bitmask"),
    "ParallelConfig": Verdict(REFUSED, "torch distributed layouts; stages split layers with -pp / `up`"),
    "CacheConfig": Verdict(REFUSED, "the stages own their KV pools"),
    "OffloadConfig": Verdict(REFUSED, "weights stay in unified memory"),
    "MultiModalConfig": Verdict(REFUSED, "text only: the language model of a vision-language checkpoint"),
    "LoRAConfig": Verdict(REFUSED, "the stages apply adapters themselves"),
    "LoggingConfig": Verdict(WORKS),
    "ObservabilityConfig": Verdict(WORKS, "metrics and traces of vLLM's front end and scheduler"),
    "SchedulerConfig": Verdict(WORKS, "vLLM's scheduler runs unchanged"),
    "CompilationConfig": Verdict(REFUSED, "CUDA graphs; MLX compiles the decode step itself"),
    "KernelConfig": Verdict(REFUSED, RUNNER),
    "VllmConfig": Verdict(REFUSED, RUNNER),
}

OPTIONS = {
    # ModelConfig: what the front end and the stages both honour.
    "--model": Verdict(WORKS),
    "--runner": Verdict(WORKS, "generate or pooling"),
    "--convert": Verdict(WORKS, "embed, classify"),
    "--tokenizer": Verdict(WORKS),
    "--tokenizer-mode": Verdict(WORKS),
    "--trust-remote-code": Verdict(WORKS, "for the tokenizer and config only; the stages run their own family code"),
    "--dtype": Verdict(REFUSED, "the stages keep the checkpoint's dtype (float32 activations on a CPU)"),
    "--seed": Verdict(WORKS),
    "--max-model-len": Verdict(WORKS),
    "--enforce-eager": Verdict(WORKS, "always on: nothing is captured as a CUDA graph"),
    "--max-logprobs": Verdict(WORKS),
    "--served-model-name": Verdict(WORKS),
    "--skip-tokenizer-init": Verdict(WORKS),
    "--config-format": Verdict(WORKS),
    "--hf-config-path": Verdict(WORKS),
    "--tokenizer-revision": Verdict(WORKS),
    "--generation-config": Verdict(WORKS, "sampling defaults, in the front end"),
    "--override-generation-config": Verdict(WORKS, "sampling defaults, in the front end"),
    "--pooler-config": Verdict(WORKS, "pooling type and normalisation"),
    "--renderer-num-workers": Verdict(WORKS, "front-end chat template rendering"),
    "--disable-cascade-attn": Verdict(WORKS, "no cascade attention here: nothing to disable"),
    "--logits-processors": Verdict(REFUSED, "torch logits processors; the sampler runs in MLX on the last stage"),
    # StructuredOutputsConfig and the front end: as vLLM.
    # ParallelConfig: the one layout the stages implement.
    "--pipeline-parallel-size": Verdict(WORKS, "one stage per worker process (serve) or host (up)"),
    "--distributed-executor-backend": Verdict(REFUSED, "the executor is metal-cluster's"),
    # CacheConfig: what vLLM's KV cache manager and scheduler decide.
    "--block-size": Verdict(WORKS),
    "--gpu-memory-utilization": Verdict(WORKS, "the share of each host's memory"),
    "--num-gpu-blocks-override": Verdict(WORKS),
    "--enable-prefix-caching": Verdict(WORKS, "on by default"),
    "--prefix-caching-hash-algo": Verdict(WORKS),
    "--mamba-block-size": Verdict(WORKS),
    "--mamba-cache-mode": Verdict(WORKS, "align is what hybrid families use"),
    # MultiModalConfig
    "--language-model-only": Verdict(WORKS, "always so"),
    # LoRAConfig: what the stages implement.
    "--enable-lora": Verdict(WORKS),
    "--max-loras": Verdict(WORKS),
    "--max-lora-rank": Verdict(WORKS),
    # ObservabilityConfig: the ones about vLLM's GPU worker.
    "--collect-detailed-traces": Verdict(REFUSED, "traces of vLLM's model runner, which does not run here"),
    "--cudagraph-metrics": Verdict(REFUSED, "no CUDA graphs here"),
    "--enable-layerwise-nvtx-tracing": Verdict(REFUSED, "no NVTX ranges in MLX stages"),
    "--enable-mfu-metrics": Verdict(REFUSED, RUNNER),
    "--jit-monitor-mode": Verdict(REFUSED, "no torch JIT here"),
    "--jit-monitor-verbose": Verdict(REFUSED, "no torch JIT here"),
    # SchedulerConfig: the scheduler must stay metal-cluster's (it holds requests while stages re-plan).
    "--scheduler-cls": Verdict(REFUSED, "the scheduler must be metal-cluster's, which holds requests during "
                                        "a re-plan"),
    "--disable-hybrid-kv-cache-manager": Verdict(REFUSED, "sliding-window and hybrid families need it"),
    # VllmConfig
    "--speculative-config": Verdict(WORKS, "ngram, draft_model and MTP; others are refused with their name"),
    "--spec-method": Verdict(WORKS, "as in --speculative-config"),
    "--spec-model": Verdict(WORKS, "as in --speculative-config"),
    "--spec-tokens": Verdict(WORKS, "as in --speculative-config"),
    "--structured-outputs-config": Verdict(WORKS),
    "--reasoning-config": Verdict(WORKS, "parsed in the front end"),
    "--kv-events-config": Verdict(WORKS, "published by vLLM's KV cache manager"),
    "--watermark-config": Verdict(REFUSED, "output watermarking lives in vLLM's GPU sampler; the sampler here is MLX"),
    # "options": processes the single engine here cannot be
    "--headless": Verdict(REFUSED, "the engine runs beside the API server"),
    "--api-server-count": Verdict(REFUSED, "one API server per engine here"),
    "--grpc": Verdict(REFUSED, "vLLM's gRPC front end; use the OpenAI API"),
    "--gdn-prefill-backend": Verdict(REFUSED, "the stages run their own Gated DeltaNet kernels"),
    "--kda-prefill-backend": Verdict(REFUSED, RUNNER),
    "--kda-decode-backend": Verdict(REFUSED, RUNNER),
    # Frontend: vLLM's data-parallel supervisor has no engines to supervise here.
    "--data-parallel-supervisor-port": Verdict(REFUSED, "no data parallelism here"),
    "--dp-supervisor-probe-interval-s": Verdict(REFUSED, "no data parallelism here"),
    "--dp-supervisor-probe-timeout-s": Verdict(REFUSED, "no data parallelism here"),
    "--dp-supervisor-probe-failure-threshold": Verdict(REFUSED, "no data parallelism here"),
    "--enable-scale-out": Verdict(REFUSED, "no data parallelism here"),
}

UNREVIEWED = Verdict(REFUSED, "not reviewed for metal-cluster yet")


@dataclass(frozen=True)
class Option:
    flag: str  # the long name
    dest: str
    default: object
    group: str
    verdict: Verdict


def options(parser: argparse.ArgumentParser) -> list[Option]:
    """Every option of vLLM's serve parser, in its groups' order, with its verdict."""
    found = []
    for group in parser._action_groups:  # argparse keeps groups only here
        for action in group._group_actions:
            if not action.option_strings or action.dest == "help":
                continue
            flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
            verdict = OPTIONS.get(flag) or GROUPS.get(group.title, UNREVIEWED)
            found.append(Option(flag, action.dest, action.default, group.title, verdict))
    return found


def refusal(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The line that refuses the first refused option `args` sets away from vLLM's default."""
    for option in options(parser):
        if option.verdict.status == REFUSED and getattr(args, option.dest, option.default) != option.default:
            return (f"{option.flag} is not supported by metal-cluster ({option.verdict.note}); "
                    f"remove it (README: \"vLLM's options\")")
    return None


def markdown(parser: argparse.ArgumentParser) -> str:
    rows = ["| option | here | why |", "|---|---|---|"]
    for option in options(parser):
        rows.append(f"| `{option.flag}` | {option.verdict.status} | {option.verdict.note} |")
    return "\n".join(rows)


# Request fields (completions and chat): vLLM's front end and scheduler handle all but these.
REQUEST_NOTES = {
    "watermarking": "as vLLM without --watermark-config (refused): nothing is watermarked",
    "routed_experts_prompt_start": "needs --enable-return-routed-experts, which is refused",
    "kv_transfer_params": "needs --kv-transfer-config, which is refused",
    "ec_transfer_params": "needs --ec-transfer-config, which is refused",
    "prompt_embeds": "needs --enable-prompt-embeds, which is refused",
    "mm_payload": "text only",
    "mm_processor_kwargs": "text only",
    "media_io_kwargs": "text only",
    "return_mm_kwargs": "text only",
    "vllm_xargs": "for custom logits processors, which --logits-processors would load (refused)",
}


def request_fields() -> list[tuple[str, str, str]]:
    """(field, status, note) for every field of vLLM's completion and chat requests."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from metal_cluster.coordinator.engine.vllm_platform import UNSUPPORTED_SAMPLING

    names = dict.fromkeys([*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields])
    return [(name, REFUSED if name in UNSUPPORTED_SAMPLING else WORKS,
             "400: the MLX sampler does not implement it" if name in UNSUPPORTED_SAMPLING
             else REQUEST_NOTES.get(name, "")) for name in names]


def request_markdown() -> str:
    rows = ["| request field | here | why |", "|---|---|---|"]
    rows += [f"| `{name}` | {status} | {note} |" for name, status, note in request_fields()]
    return "\n".join(rows)


def serve_parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="metal-cluster serve"))


if __name__ == "__main__":
    import os

    from metal_cluster.coordinator.engine.vllm_platform import ACTIVATE_ENV

    os.environ[ACTIVATE_ENV] = "1"  # vLLM's parser needs a platform to build its defaults
    print(markdown(serve_parser()) + "\n\n" + request_markdown())
