"""Speculative decoding (`--speculative-config`, methods ngram, draft_model and mtp): the n-gram rule,
sampling keeps its distribution (a draft model's drafts too), MTP drafts are the checkpoint's MTP
layer's, a config that cannot be served stops the server at start with one line. Greedy with
speculation equals greedy without through a server: n-grams and a draft model single node in
test_serve.py (beside its plain server), 2 and 3 stages in test_pipeline.py; MTP on 1, 2 and 3
stages here, beside a plain server of its tiny DeepSeek V3."""

import json
import subprocess
import sys
import urllib.request

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from server_process import free_port

from metal_cluster.coordinator.engine import speculation
from metal_cluster.coordinator.engine.ngram import propose
from metal_cluster.proto import pb
from metal_cluster.stage_worker.step.sampler import SampleRow, sample

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
# A random tiny model rarely repeats itself; limited to a few tokens it does, so drafts are accepted.
FEW = [5, 6, 7, 8]


def draft_model(model) -> str:
    """--speculative-config for a draft model: the target itself accepts every draft (multi-token
    accepts, the draft's KV catching up), another random model of the same vocabulary almost none
    (rollback)."""
    return json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": 3})


def test_ngram_proposals_follow_the_longest_earliest_match():
    t = np.array
    assert propose(t([1, 2, 3, 9, 1, 2, 3]), 1, 3, 2) == [9, 1]  # "1 2 3" seen before: what followed it
    assert propose(t([4, 1, 2, 5, 1, 2, 6, 2]), 1, 3, 3) == [5, 1, 2]  # only "2" matches: its first occurrence
    assert propose(t([4, 1, 2, 5, 7, 2]), 2, 3, 3) == []  # nothing as long as prompt_lookup_min
    assert propose(t([1, 2, 1, 2]), 1, 2, 5) == [1, 2]  # no more tokens follow the match than there are
    assert propose(t([3]), 1, 3, 4) == []


def accepted_drafts(url) -> float:
    return spec_counts(url)[1]


def spec_counts(url) -> tuple[float, float]:
    """vLLM's counters: draft tokens verified, and accepted."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()

    def total(name):
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))
    return total("vllm:spec_decode_num_draft_tokens_total"), total("vllm:spec_decode_num_accepted_tokens_total")


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


def test_mtp_without_mtp_layers_stops_the_server_at_start(llama_model, mtp_model, tmp_path):
    """A checkpoint with no MTP layers, or whose config names them but whose weights lost them (an
    mlx-lm conversion): one line each, before vLLM starts."""
    line = _serve_error(llama_model, MTP)
    assert "\"mtp\" needs a checkpoint with multi-token-prediction layers" in line and "(llama)" in line
    dropped = tiny_models.build_tiny_model("deepseek_v3", tmp_path / "dropped",
                                           config_overrides={"num_nextn_predict_layers": 1})
    assert "its weights do not hold them" in speculation.problem(["--speculative-config", MTP], dropped)
    assert speculation.problem(["--speculative-config", MTP], mtp_model) is None


def test_a_draft_models_drafts_keep_the_sampled_distribution(llama_model):
    """The last stage's draft model (here the target itself, so its greedy draft is the target's
    most likely token) drafts; the step after verifies with the same rule as n-gram drafts. 300
    seeded requests at temperature 1, top_k 5: the token after the most common first one follows
    the target's distribution (chi-square, df 4, p = 1e-4), and the draft is kept only as often as
    the target picks it."""
    from mlx_lm.utils import load

    from metal_cluster.proto import PROTO_VERSION
    from metal_cluster.stage_worker.step.speculative.draft import DraftModel
    from metal_cluster.stage_worker.model.model_source import resolve_model
    from metal_cluster.stage_worker.kv.paged_kv import KVPool
    from metal_cluster.stage_worker.step.runner import StageRunner
    from metal_cluster.stage_worker.model.shard import load_shard

    n, prompt = 300, [7]
    shard = load_shard(resolve_model(llama_model))
    draft = DraftModel.load(str(llama_model), 2).allocate(n + 1, 16)
    runner = StageRunner(shard, KVPool.allocate(shard.caches, n + 1, 16, shard.dtype), draft)
    first = pb.StepRequest(version=PROTO_VERSION, step_id=0)
    for i in range(n):
        first.new_requests.add(req_id=f"r{i}", prompt_token_ids=prompt, block_ids=[i + 1],
                               sampling=pb.SamplingParams(temperature=1.0, top_k=5, seed=i))
        first.scheduled.add(req_id=f"r{i}", num_tokens=len(prompt))
    out = runner.step(first)
    tokens = {r: s.token_id for r, s in out.sampled.items()}
    drafts = {d.req_id: list(d.token_ids) for d in out.spec_drafts}
    assert set(drafts) == set(tokens) and all(len(d) == 2 for d in drafts.values())
    second = pb.StepRequest(version=PROTO_VERSION, step_id=1)
    for r, token in tokens.items():
        second.cached_requests.add(req_id=r, num_computed_tokens=len(prompt), new_token_ids=[token])
        second.scheduled.add(req_id=r, num_tokens=1 + len(drafts[r]), draft_token_ids=drafts[r])
    out = runner.step(second)
    top = max(set(tokens.values()), key=list(tokens.values()).count)
    group = [r for r in tokens if tokens[r] == top]
    assert len(group) > 150
    after = np.array([(out.accepted[r] or [out.sampled[r]])[0].token_id for r in group])
    ref, _ = load(str(llama_model))
    logits = np.array(ref(mx.array([prompt + [top]]))[0, -1].astype(mx.float32))
    best = np.argsort(logits)[-5:]
    p = np.zeros(len(logits))
    p[best] = np.exp(logits[best] - logits[best].max())
    p /= p.sum()
    guess = {drafts[r][0] for r in group}
    assert guess == {int(np.argmax(logits))}  # the draft model proposed what the target likes best
    assert _chi_square(after, p) < 23.5
    kept = np.mean([bool(out.accepted[r]) for r in group])
    assert abs(kept - p[guess.pop()]) < 0.1
    assert 0 < kept < 1  # some drafts kept, some rejected: both ways through the rule


def test_a_bad_draft_model_stops_the_server_at_start(llama_model, tmp_path):
    """One line each, before vLLM starts (speculation.problem is what `serve` and `up` run)."""
    def problem(config, model=llama_model):
        return speculation.problem(["--speculative-config", json.dumps(config)], model)
    spec = {"method": "draft_model", "num_speculative_tokens": 2}
    nowhere = tmp_path / "nowhere"
    assert f"the draft model: model not found: {nowhere}" in problem({**spec, "model": str(nowhere)})
    assert "needs \"model\"" in problem(spec)
    assert "num_speculative_tokens" in problem({"method": "draft_model", "model": str(llama_model)})
    assert "draft_sample_method" in problem({**spec, "model": str(llama_model), "draft_sample_method": "probabilistic"})
    assert problem({**spec, "model": str(llama_model)}) is None
    assert problem({"model": str(llama_model), "num_speculative_tokens": 2}) is None  # vLLM's reading: a draft model
    hybrid = tiny_models.build_tiny_model("qwen3_next", tmp_path / "hybrid")
    assert "recurrent layers" in problem({**spec, "model": str(llama_model)}, hybrid)  # the target
    assert "recurrent layers" in problem({**spec, "model": str(hybrid)})  # the draft
    # A draft named as a .gguf or a folder reaches vLLM as the folder it reads.
    args = ["--max-model-len", "64", "--speculative-config=" + json.dumps({**spec, "model": str(llama_model)})]
    out = speculation.with_draft_folder(args)
    assert out[:2] == args[:2] and json.loads(out[-1])["model"] == str(llama_model) and len(out) == 4


def test_a_draft_models_drafts_reach_the_scheduler_only_for_the_history_they_follow():
    from types import SimpleNamespace

    from metal_cluster.coordinator.engine.model_drafts import ModelDrafter

    drafter = ModelDrafter(k=3, max_model_len=64)

    def request(num_tokens=10, max_tokens=20, num_output_tokens=5):
        return SimpleNamespace(request_id="a", num_tokens=num_tokens, max_tokens=max_tokens,
                               num_output_tokens=num_output_tokens)
    output = SimpleNamespace(spec_drafts={"a": (10, [4, 5, 6])})
    assert drafter.drafts(request(), output) == [4, 5, 6]
    assert drafter.drafts(request(num_tokens=11), output) == []  # vLLM kept another history
    assert drafter.drafts(request(max_tokens=7), output) == [4]  # one more token fits after this step's
    assert drafter.drafts(request(num_tokens=10), SimpleNamespace(spec_drafts=None)) == []


def test_a_gguf_draft_reaches_vllm_as_its_folder(llama_model):
    """The embedded SmolLM2 GGUF as a draft: of its own vocabulary it is served (vLLM reads the
    folder derived from it, the stage maps that back to the file); beside a tiny model it is refused."""
    from metal_cluster.stage_worker.model.model_source import default_model_gguf, resolve_model

    gguf = default_model_gguf()
    config = {"method": "draft_model", "model": str(gguf), "num_speculative_tokens": 2}
    args = ["--speculative-config", json.dumps(config)]
    target = resolve_model(None).folder
    assert speculation.problem(args, target) is None
    folder = json.loads(speculation.with_draft_folder(args)[-1])["model"]
    assert resolve_model(folder).gguf == gguf.resolve()
    assert "a draft must use the target's tokenizer" in speculation.problem(args, llama_model)


@pytest.mark.parametrize("family", tiny_models.MTP_FAMILIES)
def test_mtp_drafts_are_the_mtp_layers_over_the_whole_history(family, mtp_model, tmp_path):
    """The last stage's MTP drafter keeps its own paged KV and catches up step by step; its drafts
    must be those of the checkpoint's MTP layer run over the whole history at once (vLLM's rule,
    references.mtp_greedy_drafts): after a prompt in two chunks (the first drafts nothing), after a
    verification that accepted every draft (k + 1 positions caught up), and after one that accepted
    none (the rejected positions' KV rewritten). DeepSeek V3's MLA layer, GLM-4.5's GQA one."""
    from references import mlx_lm_greedy, mtp_greedy_drafts, mtp_reference

    from metal_cluster.proto import PROTO_VERSION
    from metal_cluster.stage_worker.kv.paged_kv import KVPool
    from metal_cluster.stage_worker.model.model_source import resolve_model
    from metal_cluster.stage_worker.model.shard import load_shard
    from metal_cluster.stage_worker.step.speculative.mtp import MTPDrafter
    from metal_cluster.stage_worker.step.runner import StageRunner

    k = 3
    if family != "deepseek_v3":
        mtp_model = tiny_models.build_tiny_model(family, tmp_path / family, mtp_layers=1)
    recycles_norm = family == "deepseek_v3"  # vLLM 0.33: DeepSeek's next guess reads the normed output
    source = resolve_model(mtp_model)
    shard = load_shard(source)
    runner = StageRunner(shard, KVPool.allocate(shard.caches, 8, 16, shard.dtype),
                         MTPDrafter.load(source, shard, k).allocate(8, 16))
    model, layer = mtp_reference(mtp_model)
    prompts = {"a": [5, 17, 300, 42, 9, 77, 101, 230, 11, 64, 3], "b": [400, 12, 88, 150, 7]}
    history = {r: list(p) for r, p in prompts.items()}
    steps = iter(range(10))

    def run(scheduled: dict, new: dict, drafts: dict) -> dict:
        step = pb.StepRequest(version=PROTO_VERSION, step_id=next(steps))
        for r, n in scheduled.items():
            if r in new:
                step.new_requests.add(req_id=r, prompt_token_ids=prompts[r], block_ids=new[r],
                                      sampling=pb.SamplingParams(temperature=0))
            else:
                state = runner.table[r]
                step.cached_requests.add(req_id=r, num_computed_tokens=computed[r],
                                         new_token_ids=history[r][len(state.token_ids):])
            step.scheduled.add(req_id=r, num_tokens=n, draft_token_ids=drafts.get(r, []))
        out = runner.step(step)
        for r in scheduled:
            computed[r] += scheduled[r] - len(drafts.get(r, []))
            if r in out.sampled:
                gained = [s.token_id for s in out.accepted.get(r, [])] + [out.sampled[r].token_id]
                computed[r] += len(gained) - 1
                history[r] += gained
        return {d.req_id: list(d.token_ids) for d in out.spec_drafts}

    computed = {"a": 0, "b": 0}
    got = run({"a": 6, "b": 5}, {"a": [1, 2], "b": [3, 4]}, {})
    assert list(got) == ["b"] and got["b"] == mtp_greedy_drafts(model, layer, history["b"], k, recycles_norm)
    computed["a"] = 6
    greedy = mlx_lm_greedy(model, history["b"], k)  # the target's own next tokens: all accepted
    got = run({"a": 5, "b": 1 + k}, {}, {"b": greedy})
    assert history["b"][-k - 1:-1] == greedy
    for r in ("a", "b"):
        assert got[r] == mtp_greedy_drafts(model, layer, history[r], k, recycles_norm), r
    wrong = [t for t in range(k + 5) if t != mlx_lm_greedy(model, history["a"], 1)[0]][:k]
    before = len(history["a"])
    got = run({"a": 1 + k, "b": 1 + k}, {}, {"a": wrong, "b": got["b"]})
    assert len(history["a"]) == before + 1  # none accepted
    for r in ("a", "b"):
        assert got[r] == mtp_greedy_drafts(model, layer, history[r], k, recycles_norm), r


# --- MTP through servers: one, two and three stages beside a plain server of the same checkpoint ------
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
MTP_ARGS = ["--gpu-memory-utilization", "0.05", "--max-model-len", "256", "--max-num-batched-tokens", "32",
            "--max-num-seqs", "8", "--served-model-name", "m"]  # 32: prompts arrive in chunks


@pytest.fixture(scope="module")
def mtp_servers(mtp_model, tmp_path_factory):
    """The four start together (server_process.running_servers): about the time of one or two."""
    from server_process import running_servers

    logs = tmp_path_factory.mktemp("mtp-servers")
    specs = {"plain": (mtp_model, MTP_ARGS, logs / "plain.log")}
    for stages in (1, 2, 3):
        specs[stages] = (mtp_model, [*MTP_ARGS, "-pp", str(stages), "--speculative-config", MTP], logs / f"{stages}.log")
    with running_servers(specs) as urls:
        yield urls


def _client(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def _mtp_greedy(client, ids, n, **extra):
    kw = {k: extra.pop(k) for k in ("stop",) if k in extra}
    return client.completions.create(model="m", prompt=ids, max_tokens=n, temperature=0, **kw,
                                     extra_body={"ignore_eos": True, "return_token_ids": True, **extra}).choices[0]


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_greedy_with_mtp_is_greedy_without(mtp_servers, mtp_model, stages):
    """The checkpoint's MTP layer drafts on the last stage; greedy output equals mlx-lm's, batched
    with requests limited to a few tokens (where a random MTP layer's drafts are often right), a
    prompt longer than a chunk among them; drafts were made and some accepted."""
    import concurrent.futures

    from references import mlx_lm_greedy, mlx_lm_masked_greedy, mtp_reference

    model, _ = mtp_reference(mtp_model)
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(mtp_model)
    prompts = [tokenizer.encode(p) for p in ("Hello world, this is a test", "Tea or coffee?",
                                             "The quick brown fox jumps over the lazy dog again and again and "
                                             "again until the dog wakes up and runs away")]
    url = mtp_servers[stages]
    client = _client(url)
    before = spec_counts(url)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        plain = [pool.submit(_mtp_greedy, client, ids, 12) for ids in prompts]
        few = [pool.submit(_mtp_greedy, client, ids, 16, allowed_token_ids=FEW) for ids in prompts]
        assert [p.result().token_ids for p in plain] == [mlx_lm_greedy(model, ids, 12) for ids in prompts]
        assert [f.result().token_ids for f in few] == [mlx_lm_masked_greedy(model, ids, 16, FEW)[0] for ids in prompts]
    drafted, accepted = (b - a for a, b in zip(before, spec_counts(url)))
    assert drafted >= 40 and accepted > 0


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_mtp_json_schema_and_stop_strings_match_plain(mtp_servers, mtp_model, stages):
    """A JSON schema's grammar masks every scored position, as on the plain server; and stop strings
    that end on a token taken from an accepted draft (the oracle knows which: a request's drafts
    follow from its history alone) end the text right there, although that step gained the token
    after it too."""
    from mlx_lm.utils import load_tokenizer

    from references import mtp_accepted_positions, mtp_reference

    plain, spec = _client(mtp_servers["plain"]), _client(mtp_servers[stages])
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red red red red", "blue"]},
                                               "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    messages = [{"role": "user", "content": 'Answer {"colour": "red red red red", "count": 4} again.'}]
    answers = [c.chat.completions.create(
        model="m", messages=messages, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}).choices[0]
        for c in (plain, spec)]
    assert answers[1].message.content == answers[0].message.content
    assert answers[1].finish_reason == answers[0].finish_reason
    assert answers[1].message.content.lstrip().startswith("{")
    tokenizer = load_tokenizer(mtp_model)
    ids, n = tokenizer.encode("The quick brown fox"), 24
    free = _mtp_greedy(plain, ids, n, allowed_token_ids=FEW).token_ids
    accepted = mtp_accepted_positions(*mtp_reference(mtp_model), ids, n, 2, FEW)
    stops = [stop for a in sorted(accepted) if a + 1 < n and (stop := _unique_stop(tokenizer, free, a))][:2]
    assert stops  # the test needs stop strings that end inside a step's accepted drafts
    before = spec_counts(mtp_servers[stages])[1]
    for text, stop in stops:
        got = [_mtp_greedy(c, ids, n, allowed_token_ids=FEW, stop=[stop]) for c in (plain, spec)]
        assert got[1].text == got[0].text == text and got[1].finish_reason == got[0].finish_reason == "stop"
    assert spec_counts(mtp_servers[stages])[1] > before


def _unique_stop(tokenizer, tokens: list[int], end: int) -> tuple[str, str] | None:
    """(the text before it, a stop string) ending on token `end` whose first occurrence is there."""
    full = tokenizer.decode(tokens)
    for first in range(end, max(end - 6, -1), -1):
        before, stop = tokenizer.decode(tokens[:first]), tokenizer.decode(tokens[first:end + 1])
        if full.find(stop) == len(before):
            return before, stop
    return None
