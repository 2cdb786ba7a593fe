"""Pooling (vLLM's --runner pooling): the last stage returns the final-norm hidden states pooled, equal
to mlx-lm's own forward pass pooled the same way (float32, 1e-5), through the API with one and two
stages; a sequence classifier's head over them, through /v1/score and /v1/rerank."""

import math

import mlx.core as mx
import numpy as np
import httpx
import openai
import pytest
import tiny_models
from mlx_lm.utils import load, load_model
from transformers import AutoTokenizer

from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.stage_worker.model.model_source import resolve_model
from metal_cluster.stage_worker.kv.paged_kv import KVPool
from metal_cluster.stage_worker.step.runner import StageRunner
from metal_cluster.stage_worker.model.shard import load_shard
from server_process import running_servers

BLOCK_SIZE, NUM_BLOCKS = 8, 64
TEXTS = ["Hello world, this is a test", "The quick brown fox jumps over the lazy dog", "A"]


def mlx_lm_pooled(model, ids, kind):
    hidden = np.array(model.model(mx.array(ids)[None])[0].astype(mx.float32))  # after the final norm
    return {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(axis=0)}[kind]


def _runners(source, ranges):
    out = []
    for a, b in ranges:
        shard = load_shard(source, a, b)
        out.append(StageRunner(shard, KVPool.allocate(shard.caches, NUM_BLOCKS, BLOCK_SIZE, shard.dtype)))
    return out


def _run(runners, step):
    hidden = None
    for runner in runners:
        out = runner.step(step, hidden)
        hidden = out.hidden
    return out


@pytest.mark.parametrize("ranges", [[(0, 4)], [(0, 2), (2, 4)]], ids=["one-stage", "two-stages"])
def test_pooled_equals_mlx_lm(llama_model, ranges):
    """LAST, MEAN and CLS requests in one step beside a generating one; LAST once more over two
    prefill chunks."""
    ref, tokenizer = load(str(llama_model))
    prompts = [tokenizer.encode(t) for t in TEXTS]
    runners = _runners(resolve_model(llama_model), ranges)
    step = pb.StepRequest(version=PROTO_VERSION, step_id=0)
    next_block, kinds = 1, {}
    for i, ids in enumerate(prompts):
        for kind in ("LAST", "MEAN", "CLS", ""):
            req_id = f"{kind or 'gen'}-{i}"
            blocks = list(range(next_block, next_block + math.ceil(len(ids) / BLOCK_SIZE)))
            next_block += len(blocks)
            step.new_requests.add(req_id=req_id, prompt_token_ids=ids, block_ids=blocks, pooling=kind)
            step.scheduled.add(req_id=req_id, num_tokens=len(ids))
            kinds[req_id] = kind
    out = _run(runners, step)
    assert set(out.sampled) == {r for r, k in kinds.items() if not k}  # pooling requests sample nothing
    assert set(out.pooled) == {r for r, k in kinds.items() if k}
    for req_id, vector in out.pooled.items():
        kind, i = kinds[req_id], int(req_id.split("-")[1])
        np.testing.assert_allclose(vector, mlx_lm_pooled(ref, prompts[i], kind), atol=1e-5, rtol=0)
    # LAST over two chunks: nothing pooled after the first, the whole prompt's last token after the second.
    ids = prompts[1]
    chunked = pb.StepRequest(version=PROTO_VERSION, step_id=1, finished_req_ids=list(kinds))
    chunked.new_requests.add(req_id="c", prompt_token_ids=ids, block_ids=[1, 2], pooling="LAST")
    chunked.scheduled.add(req_id="c", num_tokens=5)
    assert not _run(runners, chunked).pooled
    rest = pb.StepRequest(version=PROTO_VERSION, step_id=2)
    rest.cached_requests.add(req_id="c", num_computed_tokens=5)
    rest.scheduled.add(req_id="c", num_tokens=len(ids) - 5)
    np.testing.assert_allclose(_run(runners, rest).pooled["c"], mlx_lm_pooled(ref, ids, "LAST"), atol=1e-5, rtol=0)


EMBED = ["--runner", "pooling", "--convert", "embed", "--gpu-memory-utilization", "0.05", "--max-model-len", "128",
         "--max-num-batched-tokens", "16", "--max-num-seqs", "8", "--served-model-name", "emb"]
RERANK = ["--max-model-len", "64", "--max-num-batched-tokens", "32", "--max-num-seqs", "8",
          "--gpu-memory-utilization", "0.05", "--served-model-name", "rr"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A tiny random Qwen3ForSequenceClassification with one label (a cross-encoder reranker)."""
    return tiny_models.build_tiny_classifier("qwen3", tmp_path_factory.mktemp("reranker"))


@pytest.fixture(scope="module")
def servers(llama_model, reranker, tmp_path_factory):
    """The module's servers, started together (see running_servers): embeddings of one stage and
    of two, and the reranker."""
    logs = tmp_path_factory.mktemp("pooling-servers")
    with running_servers({1: (llama_model, [*EMBED, "-pp", "1"], logs / "one-stage.log"),
                          2: (llama_model, [*EMBED, "-pp", "2"], logs / "two-stages.log"),
                          "rr": (reranker, RERANK, logs / "reranker.log")}) as urls:
        yield urls


@pytest.mark.parametrize("stages", [1, 2], ids=["one-stage", "two-stages"])
def test_embeddings_server(llama_model, servers, stages):
    """The openai client's embeddings.create against a pooling server of one stage and of two:
    vLLM's head (L2-normalised) over the last stage's pooled vector, equal to mlx-lm's; too long is
    a 400."""
    ref, tokenizer = load(str(llama_model))
    url = servers[stages]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    texts = TEXTS + ["Pipeline stages overlap instead of idling, " * 3]  # over 16 tokens: chunked
    r = client.embeddings.create(model="emb", input=texts)
    for text, item in zip(texts, r.data):
        want = mlx_lm_pooled(ref, tokenizer.encode(text), "LAST")
        np.testing.assert_allclose(item.embedding, want / np.linalg.norm(want), atol=1e-5, rtol=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 128"):
        client.embeddings.create(model="emb", input=[5] * 200)
    assert client.embeddings.create(model="emb", input="still serving").data[0].embedding
    # vLLM's bi-encoder /v1/score: the cosine similarity of the two embeddings.
    score = httpx.post(f"{url}/v1/score", json={"model": "emb", "queries": TEXTS[0], "documents": TEXTS[1]},
                       timeout=120)
    q, d = (mlx_lm_pooled(ref, tokenizer.encode(t), "LAST") for t in TEXTS[:2])
    cosine = q @ d / (np.linalg.norm(q) * np.linalg.norm(d))
    assert abs(score.json()["data"][0]["score"] - cosine) <= 1e-5, score.text


def mlx_lm_logit(folder, ids) -> float:
    """mlx-lm's forward pass (the causal LM; strict=False leaves the score head out), LAST pooling
    and the checkpoint's score head: the one label's logit."""
    model, _ = load_model(folder, strict=False)
    weight = np.array(mx.load(str(folder / "model.safetensors"))["score.weight"])
    return float((mlx_lm_pooled(model, ids, "LAST") @ weight.T)[0])


def mlx_lm_score(folder, ids) -> float:
    """The logit through the sigmoid vLLM applies to a one-label classifier."""
    return float(1 / (1 + np.exp(-mlx_lm_logit(folder, ids))))


@pytest.mark.parametrize("ranges", [[(0, 4)], [(0, 2), (2, 4)]], ids=["one-stage", "two-stages"])
def test_classifier_head_on_the_last_stage(reranker, ranges):
    """A classify request's pooled output is the score head's logits over the LAST pooled vector,
    beside an embedding request of the same prompt; only the last stage holds the head."""
    model, _ = load_model(reranker, strict=False)
    weight = np.array(mx.load(str(reranker / "model.safetensors"))["score.weight"])
    runners = _runners(resolve_model(reranker), ranges)
    assert [r.shard.classifies for r in runners] == [False] * (len(ranges) - 1) + [True]
    ids = AutoTokenizer.from_pretrained(reranker).encode(TEXTS[1])
    step = pb.StepRequest(version=PROTO_VERSION, step_id=0)
    for i, classify in enumerate((True, False)):
        step.new_requests.add(req_id=f"r{i}", prompt_token_ids=ids, block_ids=[1 + 2 * i, 2 + 2 * i],
                              pooling="LAST", classify=classify)
        step.scheduled.add(req_id=f"r{i}", num_tokens=len(ids))
    out = _run(runners, step)
    pooled = mlx_lm_pooled(model, ids, "LAST")
    np.testing.assert_allclose(out.pooled["r0"], pooled @ weight.T, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.pooled["r1"], pooled, atol=1e-5, rtol=0)


def test_placement_counts_the_score_head_not_the_embedding(reranker):
    """A classifier's last stage holds the final norm and the score head; it has no tied lm_head."""
    import json

    from metal_cluster.stage_worker.model.checkpoint_sizes import weight_bytes

    config = json.loads((reranker / "config.json").read_text())
    sizes = weight_bytes(reranker, config, float32=True)
    assert not sizes.tied and sizes.head == 2 * config["hidden_size"] * 4  # norm [hidden] + score [1, hidden]


def test_score_and_rerank(reranker, servers):
    """vLLM's /v1/score and /v1/rerank on a served sequence classifier: each pair's score equals
    mlx-lm's forward pass + LAST pooling + the score head + sigmoid (float32, 1e-5), the pair
    tokenized as vLLM's cross-encoder does (query and document as a text pair); /classify the same
    for one text; bad requests are 4xx."""
    tokenizer = AutoTokenizer.from_pretrained(reranker)
    query, docs = "Which fox is quick?", [TEXTS[1], TEXTS[0], "Pipeline stages overlap instead of idling, " * 2]
    want = [mlx_lm_score(reranker, tokenizer(text=query, text_pair=d)["input_ids"]) for d in docs]
    with httpx.Client(base_url=servers["rr"], timeout=120) as http:
        score = http.post("/v1/score", json={"model": "rr", "queries": query, "documents": docs})
        assert score.status_code == 200, score.text
        got = {d["index"]: d["score"] for d in score.json()["data"]}
        np.testing.assert_allclose([got[i] for i in range(len(docs))], want, atol=1e-5, rtol=0)
        rerank = http.post("/v1/rerank", json={"model": "rr", "query": query, "documents": docs, "top_n": 2})
        assert rerank.status_code == 200, rerank.text
        results = rerank.json()["results"]
        assert [r["index"] for r in results] == list(np.argsort(want)[::-1][:2])  # best first, top_n kept
        for r in results:
            assert r["document"]["text"] == docs[r["index"]]
            assert abs(r["relevance_score"] - want[r["index"]]) <= 1e-5
        classified = http.post("/classify", json={"model": "rr", "input": docs[0]})
        assert classified.status_code == 200, classified.text
        probs = classified.json()["data"][0]["probs"]
        assert len(probs) == 1 and abs(probs[0] - mlx_lm_score(reranker, tokenizer(docs[0])["input_ids"])) <= 1e-5
        assert http.post("/v1/rerank", json={"model": "rr", "documents": docs}).status_code == 400  # no query
        too_long = http.post("/v1/score", json={"model": "rr", "queries": query, "documents": ["fox " * 100]})
        assert too_long.status_code == 400 and "maximum context length" in too_long.text, too_long.text
        raw = http.post("/v1/score", json={"model": "rr", "queries": query, "documents": docs[:1],
                                           "use_activation": False})  # still serving; the logit itself
        logit = mlx_lm_logit(reranker, tokenizer(text=query, text_pair=docs[0])["input_ids"])
        assert abs(raw.json()["data"][0]["score"] - logit) <= 1e-5, raw.text
