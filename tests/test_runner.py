"""The stage runner against mlx-lm's own generation: greedy tokens must match exactly (float32)."""

import mlx.core as mx
import pytest
from mlx_lm.utils import load

from metal_cluster.stage_worker.model.model_source import resolve_model
from metal_cluster.stage_worker.kv.paged_kv import KVPool
from metal_cluster.stage_worker.step.runner import StageRunner
from metal_cluster.stage_worker.model.shard import load_shard
from references import mlx_lm_greedy, smollm2_reference
from scheduler_double import SchedulerDouble

BLOCK_SIZE = 8
NUM_BLOCKS = 96
PROMPTS = [
    "Hello world, this is a test",
    "Another prompt that is quite a bit longer than the first one, with commas, and more words",
    "Short",
    "The quick brown fox jumps over the lazy dog again and again",
    "Numbers 12345 and 67890",
    "A",
    "Pipeline stages overlap instead of idling while the other stage works on its own batch",
    "Tea or coffee?",
]


def make_runner(source, start=0, end=None, num_blocks=NUM_BLOCKS):
    shard = load_shard(source, start, end)
    pool = KVPool.allocate(shard.caches, num_blocks, BLOCK_SIZE, shard.dtype)
    return StageRunner(shard, pool)


@pytest.fixture(scope="module")
def family(tiny_model):
    ref_model, tokenizer = load(str(tiny_model))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    return resolve_model(tiny_model), ref_model, prompts


def scheduler(runner, **kw):
    return SchedulerDouble(lambda step: {r: s.token_id for r, s in runner.step(step).sampled.items()}, NUM_BLOCKS, BLOCK_SIZE, **kw)


def test_one_request(family):
    source, ref_model, prompts = family
    sched = scheduler(make_runner(source))
    sched.add("a", prompts[1], 16)
    assert sched.run()["a"] == mlx_lm_greedy(ref_model, prompts[1], 16)


def test_eight_requests_packed_in_one_batch(family):
    source, ref_model, prompts = family
    runner = make_runner(source)
    sched = scheduler(runner)
    for i, p in enumerate(prompts):
        sched.add(f"r{i}", p, 10)
    first_step, _ = sched.step()
    assert len(first_step.scheduled) == 8  # all prefills went through one forward pass
    out = sched.run()
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == mlx_lm_greedy(ref_model, p, 10), f"request {i}"
    assert len(runner.table) == 0  # finished requests leave nothing behind on the next step


def count_compiled_calls(monkeypatch, compile_on: bool) -> dict:
    """METAL_CLUSTER_COMPILE as `compile_on`, and {"compiled": calls of every compiled trace so far}.
    These count the per-layer chain's calls: on a GPU the whole-step trace would take the decode
    steps (tests/test_whole_step.py), so it is kept out."""
    import types

    from metal_cluster.stage_worker.step import runner as runner_module
    from metal_cluster.stage_worker.step.tracing import compiled, whole_step

    monkeypatch.setattr(runner_module, "COMPILE", compile_on)  # what METAL_CLUSTER_COMPILE=0 sets
    monkeypatch.setattr(whole_step.WholeStep, "applies", lambda self, batch, pool: False)
    calls = {"compiled": 0}

    def counting_compile(fn):
        traced = mx.compile(fn)

        def call(*args):
            calls["compiled"] += 1
            return traced(*args)
        return call
    monkeypatch.setattr(compiled, "mx", types.SimpleNamespace(**{**vars(mx), "compile": counting_compile}))
    return calls


@pytest.mark.parametrize("compile_on", [True, False], ids=["compiled", "METAL_CLUSTER_COMPILE=0"])
def test_decode_steps_take_the_compiled_path_and_prompt_chunks_do_not(family, monkeypatch, compile_on):
    """Pure decode batches run each layer's block but its KV writes and attention through mx.compile,
    one call per layer boundary (stage_worker/step/tracing/decode_chain.py); prompt chunks, whose shapes
    vary, run the blocks directly. Both are token-exact (the other tests here run both paths
    against mlx-lm)."""
    calls = count_compiled_calls(monkeypatch, compile_on)
    source, ref_model, prompts = family
    runner = make_runner(source)
    steps = []
    sched = scheduler(runner)
    step_fn = sched.step_fn

    def seen(step):
        before = calls["compiled"]
        out = step_fn(step)
        if step.scheduled:
            steps.append((all(s.num_tokens == 1 for s in step.scheduled), calls["compiled"] - before))
        return out
    sched.step_fn = seen
    sched.add("a", prompts[1], 6)
    assert sched.run()["a"] == mlx_lm_greedy(ref_model, prompts[1], 6)
    layers = len(runner.shard.layers)
    assert steps[0] == (False, 0)  # the prompt
    # The first layer's projections, then one call from each layer's attention to the next's.
    per_decode = layers + 1 if compile_on else 0
    assert steps[1:] and all(s == (True, per_decode) for s in steps[1:])


@pytest.mark.parametrize("compile_on", [True, False], ids=["compiled", "METAL_CLUSTER_COMPILE=0"])
def test_verification_and_a_draft_models_one_token_passes_take_the_compiled_path(llama_model, monkeypatch, compile_on):
    """Speculative steps whose shapes recur (every request verifying as many drafts; the draft
    model's proposing passes, one token a request) take the compiled path as decode steps do; a
    prompt, and the draft's catch-up over several tokens a request, do not. Greedy with the target
    as its own draft, so every draft is accepted: the tokens equal mlx-lm's."""
    from metal_cluster.proto import PROTO_VERSION, pb
    from metal_cluster.stage_worker.step.speculative.draft import DraftModel

    calls = count_compiled_calls(monkeypatch, compile_on)
    k, blocks = 2, 16
    ref_model, tokenizer = load(str(llama_model))
    prompts = {f"r{i}": tokenizer.encode(p) for i, p in enumerate(PROMPTS[:3])}
    shard = load_shard(resolve_model(llama_model))
    draft = DraftModel.load(str(llama_model), k).allocate(blocks * len(prompts) + 1, BLOCK_SIZE)
    runner = StageRunner(shard, KVPool.allocate(shard.caches, blocks * len(prompts) + 1, BLOCK_SIZE, shard.dtype), draft)
    first = pb.StepRequest(version=PROTO_VERSION, step_id=0)
    for i, (r, ids) in enumerate(prompts.items()):
        first.new_requests.add(req_id=r, prompt_token_ids=ids, block_ids=range(1 + i * blocks, 1 + (i + 1) * blocks),
                               sampling=pb.SamplingParams(temperature=0.0))
        first.scheduled.add(req_id=r, num_tokens=len(ids))
    counted = [calls["compiled"]]
    out = runner.step(first)
    counted.append(calls["compiled"])
    got = {r: [s.token_id] for r, s in out.sampled.items()}
    drafts = {d.req_id: list(d.token_ids) for d in out.spec_drafts}
    second = pb.StepRequest(version=PROTO_VERSION, step_id=1)
    for r, ids in prompts.items():
        second.cached_requests.add(req_id=r, num_computed_tokens=len(ids), new_token_ids=got[r])
        second.scheduled.add(req_id=r, num_tokens=1 + k, draft_token_ids=drafts[r])
    out = runner.step(second)
    counted.append(calls["compiled"])
    for r, ids in prompts.items():
        got[r] += [a.token_id for a in out.accepted[r]] + [out.sampled[r].token_id]
        assert got[r] == mlx_lm_greedy(ref_model, ids, 2 + k), r  # every draft accepted, then one more
    per_pass = len(shard.layers) + 1 if compile_on else 0  # as a decode step's (test above)
    # Step 0: the prompt and the draft's catch-up over it run directly; the draft's one proposing
    # pass after its first guess is compiled. Step 1: the verification (1 + k rows a request), then
    # the draft's catch-up (k + 1 tokens a request) directly and its proposing pass.
    assert (counted[1] - counted[0], counted[2] - counted[1]) == (per_pass * (k - 1), per_pass * k)


def test_chunked_prefill_mixed_with_decodes(family):
    source, ref_model, prompts = family
    sched = scheduler(make_runner(source), chunk_size=7)
    for i in (0, 1, 3):
        sched.add(f"r{i}", prompts[i], 12)
    out = sched.run()
    for i in (0, 1, 3):
        assert out[f"r{i}"] == mlx_lm_greedy(ref_model, prompts[i], 12)


def test_tokens_kept_on_the_device_one_step_ahead(family):
    """vLLM's async scheduling over one stage: each step is launched before the previous one's
    tokens are read back, and embeds those tokens from the device."""
    source, ref_model, prompts = family
    runner = make_runner(source)

    def launch(step):
        out = runner.run(step, runner.prepare(step))
        return lambda: {r: s.token_id for r, s in out.resolve().sampled.items()}

    sched = SchedulerDouble(launch, NUM_BLOCKS, BLOCK_SIZE, chunk_size=7, ahead=True)
    for i in (0, 1, 3, 5):
        sched.add(f"r{i}", prompts[i], 12)
    out = sched.run()
    for i in (0, 1, 3, 5):
        assert out[f"r{i}"] == mlx_lm_greedy(ref_model, prompts[i], 12), f"request {i}"
    assert len(runner.table) == 0


def test_shared_prefix_blocks(family):
    source, ref_model, prompts = family
    runner = make_runner(source)
    sched = scheduler(runner)
    prefix = prompts[1][: 2 * BLOCK_SIZE]
    first = sched.add("first", prompts[1], 6)
    sched.step()  # computes the whole prompt of "first"
    second_prompt = prefix + prompts[4]
    # A prefix-cache hit: the second request starts with two full blocks of the first.
    second = sched.add("second", second_prompt, 8, shared_blocks=first.block_ids[:2], num_computed=2 * BLOCK_SIZE)
    out = sched.run()
    assert second.block_ids[:2] == first.block_ids[:2]
    assert out["first"] == mlx_lm_greedy(ref_model, prompts[1], 6)
    assert out["second"] == mlx_lm_greedy(ref_model, second_prompt, 8)


def test_preempted_and_resumed(family):
    source, ref_model, prompts = family
    runner = make_runner(source)
    sched = scheduler(runner)
    sched.add("a", prompts[3], 14)
    sched.add("b", prompts[6], 14)
    for _ in range(5):
        sched.step()
    old_blocks = list(sched.reqs["a"].block_ids)
    sched.preempt("a")
    # Another request takes the freed blocks and overwrites them before "a" comes back.
    sched.add("c", prompts[1], 3)
    sched.reqs["a"] = sched.reqs.pop("a")  # like vLLM: running requests first, then the resumed one
    sched.run()
    assert set(old_blocks) & set(sched.reqs["c"].block_ids)
    out = {r.req_id: r.output for r in sched.reqs.values()}
    assert out["a"] == mlx_lm_greedy(ref_model, prompts[3], 14)
    assert out["b"] == mlx_lm_greedy(ref_model, prompts[6], 14)


def test_split_run_equals_full_model(llama_model):
    source = resolve_model(llama_model)
    full = make_runner(source)
    head, tail = make_runner(source, 0, 2), make_runner(source, 2)
    ref_model, tokenizer = load(str(llama_model))
    step = SchedulerDouble(lambda s: {}, NUM_BLOCKS, BLOCK_SIZE)
    step.add("x", tokenizer.encode(PROMPTS[1]), 1)
    step.add("y", tokenizer.encode(PROMPTS[3]), 1)
    request, _ = step.step()

    def logits_of(runner, hidden):
        captured = {}
        original = runner.shard.logits
        runner.shard.logits = lambda h: captured.setdefault("logits", original(h))
        runner.step(request, hidden)
        runner.shard.logits = original
        return captured["logits"]

    full_logits = logits_of(full, None)
    handed_over = head.step(request).hidden
    assert head.shard.is_first and not head.shard.is_last and not tail.shard.is_first
    split_logits = logits_of(tail, handed_over)
    assert split_logits.shape == full_logits.shape
    assert mx.array_equal(split_logits, full_logits)


def test_smollm2_gguf_matches_mlx_lm():
    """The embedded default, read from its Q4_1 GGUF and dequantized: same tokens as mlx-lm."""
    source, ref_model, tokenizer = smollm2_reference()
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "Once upon a time", "def fibonacci(n):")]
    sched = scheduler(make_runner(source), chunk_size=5)
    for i, p in enumerate(prompts):
        sched.add(f"r{i}", p, 12)
    out = sched.run()
    expected = mlx_lm_greedy(ref_model, prompts[0], 12)
    assert "Paris" in tokenizer.decode(expected)
    assert out["r0"] == expected
    for i in (1, 2):
        assert out[f"r{i}"] == mlx_lm_greedy(ref_model, prompts[i], 12)


def test_sliding_window_matches_mlx_lm(tmp_path):
    """Alternating sliding-window and full layers (Mistral/Gemma style), prompts longer than the window."""
    import tiny_models

    folder = tiny_models.build_tiny_model("llama", tmp_path / "swa", sliding_window=8)
    ref_model, tokenizer = load(str(folder))
    source = resolve_model(folder)
    sched = scheduler(make_runner(source), chunk_size=5)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    for i, p in enumerate(prompts):
        sched.add(f"r{i}", p, 12)
    out = sched.run()
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == mlx_lm_greedy(ref_model, p, 12), f"request {i}"


def test_a_seeded_request_resumed_on_fresh_stages_draws_what_it_would_have(llama_model):
    """A lost stage's requests reach the new plan's stages as new requests with their outputs: a
    seeded sampled one must go on with the tokens it would have drawn had nothing happened."""
    from metal_cluster.proto import PROTO_VERSION, pb

    source = resolve_model(llama_model)
    prompt, blocks = list(range(1, 12)), list(range(1, 9))
    sampling = pb.SamplingParams(temperature=1.0, seed=7)

    def generate(runner, outputs, n):
        """Start the request (prompt + `outputs` so far) on `runner`, then sample up to n tokens."""
        first = pb.StepRequest(version=PROTO_VERSION)
        first.new_requests.append(pb.NewRequest(req_id="s", prompt_token_ids=prompt, output_token_ids=outputs,
                                                block_ids=blocks, sampling=sampling))
        first.scheduled.append(pb.ScheduledTokens(req_id="s", num_tokens=len(prompt) + len(outputs)))
        tokens = list(outputs)
        step = first
        while len(tokens) < n:
            tokens.append(runner.step(step).sampled["s"].token_id)
            step = pb.StepRequest(version=PROTO_VERSION, step_id=step.step_id + 1)
            step.cached_requests.append(pb.CachedRequest(req_id="s", new_token_ids=[tokens[-1]],
                                                         num_computed_tokens=len(prompt) + len(tokens) - 1))
            step.scheduled.append(pb.ScheduledTokens(req_id="s", num_tokens=1))
        return tokens

    whole = generate(make_runner(source), [], 12)
    assert generate(make_runner(source), whole[:6], 12) == whole


def test_decode_steps_of_a_few_requests_take_one_blas_thread():
    """With OpenBLAS preloaded (as the CLI runs every stage on the CPU), a step of 4-8 packed tokens
    runs on one BLAS thread and any other on all of them (stage_worker/step/blas_threads.py), in a
    fresh process, as serve's stages are."""
    import subprocess
    import sys

    from metal_cluster.coordinator.blas import find_openblas, openblas_env

    if find_openblas() is None:
        pytest.skip("OpenBLAS is not installed here (deploy/install.sh installs it)")
    probe = (
        "import ctypes, os\n"
        "from metal_cluster.stage_worker.step.blas_threads import BlasThreads\n"
        "lib = ctypes.CDLL(next(p for p in os.environ['LD_PRELOAD'].split(':') if 'libopenblas' in p))\n"
        "blas = BlasThreads()\n"
        "seen = []\n"
        "for rows in (1, 4, 8, 9, 3, 6, 2048, 'new runner', 5, 'new runner', 1):\n"
        "    if rows == 'new runner':\n"
        "        blas = BlasThreads()\n"
        "        continue\n"
        "    blas.for_step(rows)\n"
        "    seen.append(lib.openblas_get_num_threads())\n"
        "print(seen)\n"
    )
    env = {**openblas_env(), "OPENBLAS_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # A runner made after one left a single thread set still gives a prompt every thread.
    assert out.stdout.split("\n")[-2] == "[2, 1, 1, 2, 2, 1, 2, 1, 2]"
