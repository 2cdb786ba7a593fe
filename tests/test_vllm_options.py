"""Every vLLM serve option and request field is in the README's table, marked works or refused, and
each refused option stops `serve` with one line naming it (checked for each in-process through the
function `serve` calls, and through the real CLI for a few)."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from metal_cluster.coordinator.commands.serve import vllm_argv
from metal_cluster.coordinator.engine import vllm_options
from metal_cluster.coordinator.engine.vllm_platform import ACTIVATE_ENV
from metal_cluster.stage_worker.model.model_source import resolve_model

README = Path(__file__).resolve().parent.parent / "README.md"
CLI = [sys.executable, "-m", "metal_cluster.coordinator"]


@pytest.fixture(scope="module")
def parser():
    import vllm.platforms

    with pytest.MonkeyPatch.context() as env:
        env.setenv(ACTIVATE_ENV, "1")  # the platform `serve` runs on builds the parser's defaults
        env.setattr(vllm.platforms, "_current_platform", None)
        yield vllm_options.serve_parser()


def test_readme_table_is_every_option_and_field_of_this_vllm(parser):
    text = README.read_text()
    table = text[text.index("<!-- vllm-options:begin -->\n") + 28:text.index("\n<!-- vllm-options:end -->")]
    expected = vllm_options.markdown(parser) + "\n\n" + vllm_options.request_markdown()
    assert table == expected, "README's options table is stale: python -m metal_cluster.coordinator.engine.vllm_options"
    flags = {o.flag for o in vllm_options.options(parser)}
    assert len(flags) > 250 and {"--logits-processors", "--watermark-config", "--max-num-seqs"} <= flags
    assert not set(vllm_options.OPTIONS) - flags, "an exception names an option vLLM no longer has"


def test_each_refused_option_given_a_value_is_refused_by_name(parser):
    defaults = parser.parse_args([])
    refused = [o for o in vllm_options.options(parser) if o.verdict.status == vllm_options.REFUSED]
    assert len(refused) > 100
    for option in refused:
        args = argparse.Namespace(**{**vars(defaults), option.dest: object()})  # anything but the default
        line = vllm_options.refusal(parser, args)
        assert line is not None and line.startswith(f"{option.flag} is not supported by metal-cluster ("), option
        assert option.verdict.note in line


def test_what_serve_passes_itself_is_not_refused(parser):
    argv = vllm_argv(resolve_model(None), "m", "127.0.0.1", 8000,
                     ["--max-num-seqs", "8", "--gpu-memory-utilization", "0.5", "-pp", "2", "--enable-lora",
                      "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                      "--watermark", "0.1", "--runner", "pooling", "--convert", "embed"])
    assert vllm_options.refusal(parser, parser.parse_args(argv)) is None


@pytest.mark.parametrize("flags,named", [
    (["--logits-processors", "my_module.MyProcessor"], "--logits-processors"),
    (["--watermark-config", '{"seed": 1}'], "--watermark-config"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
])
def test_serve_refuses_in_one_line(flags, named):
    result = subprocess.run([*CLI, "serve", *flags], capture_output=True, text=True, timeout=180)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("metal-cluster: error:")]
    assert len(lines) == 1 and lines[0].startswith(f"metal-cluster: error: {named} is not supported"), result.stderr
