"""`metal-cluster`: the command line. Errors a user can fix are one line on stderr, never a traceback."""

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
    blas.use_openblas_if_present()


@app.command()
def generate(
    model: str = typer.Argument(None, help="Model folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct."),
    prompt: str = typer.Option("The capital of France is", "--prompt", "-p"),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1),
    chat: bool = typer.Option(True, help="Wrap the prompt in the model's chat template."),
):
    """Generate one answer on this machine, without a server."""
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
