"""Pipeline stages in separate processes (gRPC control, MLX ring data) through the OpenAI API:
greedy tokens must equal mlx-lm's own generation, whatever the batch mix."""

import concurrent.futures
import json

import openai
import pytest
from mlx_lm.utils import load

from references import mlx_lm_greedy, mlx_lm_masked_greedy, smollm2_reference
from server_process import running_server
from test_speculative import FEW, NGRAM, accepted_drafts, draft_model, spec_counts

PROMPTS = [
    "Hello world, this is a test",
    "Another prompt that is quite a bit longer than the first one, with commas, and more words in it",
    "Numbers 12345 and 67890",
    "A",
    "The quick brown fox jumps over the lazy dog again and again and again until the dog wakes up",
    "Tea or coffee?",
    "Pipeline stages overlap instead of idling",
    "Short",
]
# Small batches force chunked prefill and mix prefill chunks with decodes in one step.
ARGS = ["--gpu-memory-utilization", "0.05", "--max-model-len", "512", "--max-num-batched-tokens", "32",
        "--max-num-seqs", "16", "--served-model-name", "m"]


def greedy(client, ids, n, **extra):
    r = client.completions.create(model="m", prompt=ids, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    return r.choices[0].token_ids


def _check_stop_string_and_grammar(client, ids):
    """A stop string inside a run of accepted drafts ends the text right before it; a JSON schema
    holds on every scored position."""
    def complete(**kw):
        return client.completions.create(model="m", prompt=ids, max_tokens=24, temperature=0, **kw,
                                         extra_body={"ignore_eos": True, "allowed_token_ids": FEW}).choices[0]
    free = complete().text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    stopped = complete(stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.text == free[:free.index(stop)]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": '{"n": 11111111}'}],
                                       max_tokens=40, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text)["n"], int)


@pytest.mark.parametrize("stages", [2, 3])
def test_stages_match_mlx_lm(tiny_model, stages, tmp_path):
    """With speculation on (llama's 2-stage run has LoRA adapters instead; llama's 3-stage run drafts
    with a draft model, the target itself, qwen2's 2-stage one with a random draft model, the others
    with n-grams): the few-token prompts draft (n-grams), every request drafts with a draft model,
    and their output must still be greedy's, token for token."""
    ref_model, tokenizer = load(str(tiny_model))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = [mlx_lm_greedy(ref_model, ids, 10) for ids in prompts]
    few = [mlx_lm_masked_greedy(ref_model, ids, 16, FEW)[0] for ids in prompts[:3]]
    lora = []
    with_lora = stages == 2 and json.loads((tiny_model / "config.json").read_text())["model_type"] == "llama"
    if with_lora:  # two LoRA adapters of this model, each stage applying its own layers' part
        from lora_fixtures import build_adapters

        adapters = build_adapters(tiny_model, tmp_path / "adapters")
        lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                "--lora-modules", f"alpha={adapters['alpha']}", f"beta={adapters['beta']}"]
    # vLLM's LoRA wants --max-num-seqs x (1 + drafts) batched tokens: the LoRA run goes without drafts.
    family = json.loads((tiny_model / "config.json").read_text())["model_type"]
    drafter = {("llama", 3): "self", ("qwen2", 2): "random"}.get((family, stages))
    spec = [] if with_lora else ["--speculative-config", _speculative_config(drafter, tiny_model, tmp_path)]
    with running_server(tiny_model, *ARGS, "-pp", str(stages), *spec, *lora, log_path=tmp_path / "server.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            drafting = [pool.submit(greedy, client, ids, 16, allowed_token_ids=FEW) for ids in prompts[:3]]
            got = list(pool.map(lambda ids: greedy(client, ids, 10), prompts))
            assert [d.result() for d in drafting] == few
        assert got == expected
        drafted, accepted = spec_counts(url)
        assert with_lora or drafted > 0
        if drafter == "self":  # the target as its own draft: every draft is the target's own choice
            assert accepted >= 0.9 * drafted
        elif drafter is None:
            assert with_lora or accepted > 0
        if tiny_model.name.startswith("llama") and not with_lora:  # one family is enough for the grammar and stop strings
            _check_stop_string_and_grammar(client, prompts[0])
        # A prefix-cache hit: the long prompt again, now with more after it.
        longer = prompts[4] + prompts[1]
        assert greedy(client, longer, 8) == mlx_lm_greedy(ref_model, longer, 8)
        assert greedy(client, prompts[4], 10) == expected[4]
        if stages == 2:
            _check_sampling_across_stages(client, ref_model, prompts[1] + prompts[4])
        if with_lora:
            _check_lora_across_stages(client, tiny_model, adapters, prompts[:3], expected[:3])
        with open(tmp_path / "server.log") as log:
            text = log.read()
        assert f"{stages} local stage workers up" in text


def _speculative_config(drafter: str | None, model, tmp_path) -> str:
    """n-gram drafts, or a draft model on the last stage: the target itself (all accepted) or a
    random llama of the same vocabulary, smaller (almost all rejected)."""
    if drafter is None:
        return NGRAM
    if drafter == "self":
        return draft_model(model)
    from tiny_models import build_tiny_model

    return draft_model(build_tiny_model("llama", tmp_path / "draft", num_layers=2, seed=7))


def _check_sampling_across_stages(client, ref_model, ids):
    """The last stage samples with the request's parameters and scores its prompt chunk by chunk
    (--max-num-batched-tokens 32): prompt logprobs equal mlx-lm's log-softmax, allowed_token_ids force
    their token (vLLM refuses logit_bias with speculative decoding)."""
    import mlx.core as mx
    import numpy as np

    assert len(ids) > 32
    logits = ref_model(mx.array(ids)[None])[0].astype(mx.float32)
    expected = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    r = client.completions.create(model="m", prompt=ids, max_tokens=4, temperature=0,
                                  extra_body={"prompt_logprobs": 1, "ignore_eos": True, "return_token_ids": True,
                                              "allowed_token_ids": [9]})
    assert r.choices[0].token_ids == [9] * 4
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for pos in range(1, len(ids)):
        entry = {int(t): v["logprob"] for t, v in got[pos].items()}
        best = int(np.argmax(expected[pos - 1]))
        # float32: 1e-4, relative for unlikely tokens (whose logprobs reach -20 and beyond)
        assert abs(entry[ids[pos]] - expected[pos - 1, ids[pos]]) < 1e-4 * max(1, -expected[pos - 1, ids[pos]]), pos
        assert abs(entry[best] - expected[pos - 1, best]) < 1e-4, pos


def _check_lora_across_stages(client, model_dir, adapters, prompts, base_expected):
    """The base model and both adapters in the same batches over two stages, each equal to mlx-lm
    with that adapter fused into the weights."""
    from lora_fixtures import fused_model

    want = {"m": base_expected}
    for name, oracle in (("alpha", "alpha"), ("beta", "beta_as_mlx")):
        fused = fused_model(model_dir, adapters[oracle])
        want[name] = [mlx_lm_greedy(fused, ids, 10) for ids in prompts]
    jobs = [(model, i) for model in want for i in range(len(prompts))]

    def run(job):
        r = client.completions.create(model=job[0], prompt=prompts[job[1]], max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        return r.choices[0].token_ids

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    assert got == [want[model][i] for model, i in jobs]
    assert want["alpha"] != want["m"] and want["beta"] != want["m"]


def test_eight_streams_over_three_stages_smollm2(tmp_path):
    _, ref_model, tokenizer = smollm2_reference()
    questions = ["What is the capital of France?", "Name a colour.", "What is 2 + 2?", "Say hello.",
                 "What is water?", "Count to three.", "Name a fruit.", "What day is after Monday?"]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
             for q in questions]
    expected = [mlx_lm_greedy(ref_model, ids, 8) for ids in chats]
    args = ["--gpu-memory-utilization", "0.1", "--max-model-len", "1024", "--max-num-batched-tokens", "64"]
    with running_server(None, *args, "-pp", "3", log_path=tmp_path / "server.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)

        def stream(ids):
            chunks = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=8,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
            tokens = []
            for c in chunks:
                tokens += c.choices[0].token_ids or []
            return tokens

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(stream, chats))
    assert got == expected
