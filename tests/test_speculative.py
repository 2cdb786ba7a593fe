"""Speculative decoding (`--speculative-config`, method ngram): greedy output is the output without
speculation, token for token; sampling keeps its distribution; a config that cannot be served stops
the server at start with one line. The 2- and 3-stage runs are in test_pipeline.py."""

import concurrent.futures
import contextlib
import json
import subprocess
import sys
import urllib.request

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.utils import load

import tiny_models
from references import mlx_lm_greedy, mlx_lm_masked_greedy
from server_process import free_port, running_server

from metal_cluster.coordinator import speculation
from metal_cluster.coordinator.ngram import propose
from metal_cluster.proto import pb
from metal_cluster.stage_worker.sampler import SampleRow, sample

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
ARGS = ["--gpu-memory-utilization", "0.05", "--max-model-len", "512", "--max-num-batched-tokens", "64",
        "--max-num-seqs", "16", "--served-model-name", "m"]
# A random tiny model rarely repeats itself; limited to a few tokens it does, so drafts are accepted.
FEW = [5, 6, 7, 8]


def test_ngram_proposals_follow_the_longest_earliest_match():
    t = np.array
    assert propose(t([1, 2, 3, 9, 1, 2, 3]), 1, 3, 2) == [9, 1]  # "1 2 3" seen before: what followed it
    assert propose(t([4, 1, 2, 5, 1, 2, 6, 2]), 1, 3, 3) == [5, 1, 2]  # only "2" matches: its first occurrence
    assert propose(t([4, 1, 2, 5, 7, 2]), 2, 3, 3) == []  # nothing as long as prompt_lookup_min
    assert propose(t([1, 2, 1, 2]), 1, 2, 5) == [1, 2]  # no more tokens follow the match than there are
    assert propose(t([3]), 1, 3, 4) == []


@contextlib.contextmanager
def _servers(model, log_dir):
    """A plain server and an n-gram one over the same model, started side by side."""
    managers = [running_server(model, *ARGS, log_path=log_dir / "plain.log"),
                running_server(model, *ARGS, "--speculative-config", NGRAM, log_path=log_dir / "ngram.log")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = [pool.submit(m.__enter__) for m in managers]
        try:
            yield [f.result() for f in started]
        finally:
            for m, f in zip(managers, started):
                if f.exception() is None:
                    m.__exit__(None, None, None)


@pytest.fixture(scope="module")
def clients(llama_model, tmp_path_factory):
    with _servers(llama_model, tmp_path_factory.mktemp("speculative")) as urls:
        yield [openai.OpenAI(base_url=f"{u}/v1", api_key="unused", timeout=120, max_retries=0) for u in urls], urls


def _complete(client, prompt, n, **extra):
    kw = {k: extra.pop(k) for k in ("stop", "logprobs") if k in extra}
    return client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0, **kw,
                                     extra_body={"ignore_eos": True, "return_token_ids": True, **extra}).choices[0]


def accepted_drafts(url) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))


def test_greedy_with_ngram_is_greedy_without(clients, llama_model):
    (_, spec), urls = clients
    ref, tokenizer = load(str(llama_model))
    prompts = [tokenizer.encode(p) for p in ("Hello world, this is a test", "The quick brown fox jumps over",
                                             "A B A B A B A B", "Tea or coffee?")]
    before = accepted_drafts(urls[1])
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # drafting requests batched with others
        plain = [pool.submit(_complete, spec, ids, 24) for ids in prompts]
        few = [pool.submit(_complete, spec, ids, 24, allowed_token_ids=FEW, logprobs=1) for ids in prompts]
        for ids, got in zip(prompts, plain):
            assert got.result().token_ids == mlx_lm_greedy(ref, ids, 24)
        for ids, got in zip(prompts, few):
            expected, logprobs = mlx_lm_masked_greedy(ref, ids, 24, FEW)
            assert got.result().token_ids == expected
            # Logprobs of accepted drafts too: vLLM's raw logprobs (before allowed_token_ids).
            assert np.allclose(got.result().logprobs.token_logprobs, logprobs, atol=1e-4)
    assert accepted_drafts(urls[1]) - before >= 20  # the drafts were used, not only made
    status = subprocess.run([sys.executable, "-m", "metal_cluster.coordinator", "status", "--json", "--url", urls[1]],
                            capture_output=True, text=True, timeout=60)
    spec = json.loads(status.stdout)["speculative"]
    assert spec["accepted_tokens"] >= 20 and 0 < spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] > 1


def test_json_schema_and_stop_string_mid_draft_match_plain(clients, llama_model):
    (plain, spec), urls = clients
    before = accepted_drafts(urls[1])
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red red red red", "blue"]},
                                               "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    messages = [{"role": "user", "content": 'Answer {"colour": "red red red red", "count": 4} again.'}]
    answers = [c.chat.completions.create(
        model="m", messages=messages, max_tokens=60, temperature=0, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}).choices[0]
        for c in (plain, spec)]
    assert answers[1].message.content == answers[0].message.content
    assert answers[1].finish_reason == answers[0].finish_reason
    # The grammar held on every scored position (a random model may pad with whitespace until max_tokens).
    assert answers[1].message.content.lstrip().startswith("{")
    if answers[1].finish_reason == "stop":
        assert json.loads(answers[1].message.content)["colour"] in ("red red red red", "blue")
    assert [t.token for t in answers[1].logprobs.content] == [t.token for t in answers[0].logprobs.content]
    # A stop string inside a run of accepted drafts: the text ends right before it, as without drafts.
    _, tokenizer = load(str(llama_model))
    prompt = tokenizer.encode("Counting sheep")
    free = _complete(plain, prompt, 32, allowed_token_ids=FEW)
    stop = tokenizer.decode(free.token_ids[18:20])
    got = [_complete(c, prompt, 32, allowed_token_ids=FEW, stop=[stop]) for c in (plain, spec)]
    assert got[1].text == got[0].text and got[1].finish_reason == got[0].finish_reason == "stop"
    assert len(got[1].text) < len(free.text)
    assert accepted_drafts(urls[1]) > before


def _chi_square(tokens: np.ndarray, p: np.ndarray) -> float:
    expected = p * len(tokens)
    observed = np.bincount(tokens, minlength=len(p))
    if observed[expected == 0].sum():
        return float("inf")  # a token the distribution excludes
    keep = expected > 0
    return float((((observed - expected) ** 2)[keep] / expected[keep]).sum())


@pytest.mark.parametrize("draft", [2, 0, 6])  # a likely token, an unlikely one, one top_k removes
def test_verifying_a_draft_keeps_the_sampled_distribution(draft):
    """vLLM's rejection rule for drafts of probability 1 (n-grams): the token a row emits (the
    draft if kept, else a draw without it) follows the row's distribution, whatever the draft.
    20000 draws, chi-square against the exact distribution at p = 1e-4 (df 4: 23.5)."""
    logits = mx.array([[1.0, 0.2, 1.5, -0.5, 0.9, 0.4, -1.0, 0.0]])
    params = pb.SamplingParams(temperature=0.8, top_k=5, top_p=1.0)
    n = 20000
    rows = [SampleRow(params=params, num_outputs=0, draw=(i * 0x9E3779B97F4A7C15 + 12345) & (2**64 - 1), draft=draft)
            for i in range(n)]
    tokens = np.array(sample(mx.repeat(logits, n, axis=0), rows).tokens)
    scaled = np.array(logits[0]) / 0.8
    top = np.argsort(scaled)[-5:]
    p = np.zeros(8)
    p[top] = np.exp(scaled[top] - scaled[top].max())
    p /= p.sum()
    assert _chi_square(tokens, p) < 23.5
    kept = (tokens == draft).mean()
    assert abs(kept - p[draft]) < 0.02  # the draft is kept as often as the model would pick it
    # The same draws without verification (a draft always kept) are far off: the test can fail.
    assert _chi_square(np.full(n, draft), p) > 1000


def _serve_error(model, config: str) -> str:
    result = subprocess.run([sys.executable, "-m", "metal_cluster.coordinator", "serve", str(model), "--port",
                             str(free_port()), "--speculative-config", config],
                            capture_output=True, text=True, timeout=120, start_new_session=True)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("metal-cluster: error:")]
    assert len(errors) == 1 and output.strip().splitlines()[-1] == errors[0], output[-3000:]
    return errors[0]


def test_a_bad_speculative_config_stops_the_server_at_start(llama_model, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    config = json.loads((llama_model / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 7}))
    line = _serve_error(llama_model, json.dumps({"method": "draft_model", "model": str(draft),
                                                 "num_speculative_tokens": 2}))
    assert f"vocabulary of {config['vocab_size'] + 7} tokens" in line and str(config["vocab_size"]) in line
    # The rest without a process each: the same check, before vLLM starts.
    def problem(config):
        return speculation.problem(["--max-model-len", "64", "--speculative-config", config], llama_model)
    assert "method 'medusa' is not served" in problem('{"method": "medusa", "num_speculative_tokens": 2}')
    assert "num_speculative_tokens" in problem('{"method": "ngram"}')
    assert "not JSON" in problem("{method: ngram}")
    assert problem(NGRAM) is None
    assert speculation.problem(["--speculative-config=" + NGRAM], llama_model) is None
    hybrid = tiny_models.build_tiny_model("qwen3_next", tmp_path / "hybrid")
    assert "recurrent layers" in speculation.problem(["--speculative-config", NGRAM], hybrid)
