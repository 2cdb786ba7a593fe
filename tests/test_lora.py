"""LoRA adapters: both formats read and checked, several adapters in one batch on the stage runner
(each token's delta by its request's slot), equal to mlx-lm's generation with the adapter fused."""

import pytest
from mlx_lm.utils import load

from lora_fixtures import ATTENTION, fused_model, random_pairs, write_peft
from metal_cluster.coordinator.engine.lora_adapters import LoRAAdapterError, read_adapter
from metal_cluster.stage_worker.model.model_source import resolve_model
from metal_cluster.stage_worker.kv.paged_kv import KVPool
from metal_cluster.stage_worker.step.runner import StageRunner
from metal_cluster.stage_worker.model.shard import load_shard
from references import mlx_lm_greedy
from scheduler_double import SchedulerDouble

BLOCK_SIZE, NUM_BLOCKS = 8, 96
PROMPTS = ["Hello world, this is a test", "The quick brown fox jumps over the lazy dog", "Tea or coffee?"]


@pytest.fixture(scope="module")
def adapters(llama_adapters):
    return llama_adapters


@pytest.fixture(scope="module")
def expected(llama_model, adapters):
    """Each prompt under the base model and each adapter, from mlx-lm (fused weights)."""
    base, tokenizer = load(str(llama_model))
    models = {0: base, 1: fused_model(llama_model, adapters["alpha"]),
              2: fused_model(llama_model, adapters["beta_as_mlx"])}
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    return prompts, {lora: [mlx_lm_greedy(m, ids, 10) for ids in prompts] for lora, m in models.items()}


def test_adapters_change_the_text(expected):
    _, out = expected
    assert out[0] != out[1] and out[0] != out[2] and out[1] != out[2]


def _runners(llama_model, ranges):
    source = resolve_model(llama_model)
    runners = []
    for a, b in ranges:
        shard = load_shard(source, a, b)
        runners.append(StageRunner(shard, KVPool.allocate(shard.caches, NUM_BLOCKS, BLOCK_SIZE, shard.dtype)))
    return runners


@pytest.mark.parametrize("form", ["dense", "gathered"])
@pytest.mark.parametrize("ranges", [[(0, 4)], [(0, 2), (2, 4)]], ids=["one-stage", "two-stages"])
def test_mixed_batch_equals_fused_mlx_lm(llama_model, adapters, expected, ranges, form, monkeypatch):
    """Base, 'alpha' and 'beta' requests in the same steps, with two slots for the two adapters and
    then one slot (every step swaps the adapters in and out by LRU); both forms of the delta."""
    from metal_cluster.stage_worker.step import lora

    if form == "gathered":
        monkeypatch.setattr(lora, "DENSE_WIDTH", 0)
    prompts, want = expected
    for max_loras in (2, 1):
        runners = _runners(llama_model, ranges)
        for lora_id, name in ((1, "alpha"), (2, "beta")):
            adapter = read_adapter(adapters[name], name, llama_model, max_rank=8)
            for runner, (a, b) in zip(runners, ranges):
                runner.lora.add(adapter.add_request(lora_id, max_loras, 8, range(a, b)))
        loras = {}

        def step_fn(step):
            for new in step.new_requests:
                new.lora_id = loras[new.req_id]
            hidden = None
            for runner in runners:
                out = runner.step(step, hidden)
                hidden = out.hidden
            return {r: s.token_id for r, s in out.sampled.items()}

        sched = SchedulerDouble(step_fn, NUM_BLOCKS, BLOCK_SIZE, chunk_size=5)
        lora_choices = (0, 1, 2) if max_loras == 2 else (0, 1)  # one slot: one adapter per step at most
        for i, ids in enumerate(prompts):
            for choice in lora_choices:
                loras[f"r{i}-{choice}"] = choice
                sched.add(f"r{i}-{choice}", ids, 10)
        if max_loras == 1:
            got = sched.run()
        else:
            first, _ = sched.step()
            assert {n.lora_id for n in first.new_requests} == {0, 1, 2}  # all three in one batch
            got = sched.run()
        for req_id, lora_id in loras.items():
            assert got[req_id] == want[lora_id][int(req_id[1])], req_id
        assert all(r.lora.state.dense == (form == "dense") for r in runners)


def test_lru_swaps_one_slot_between_adapters(llama_model, adapters, expected):
    prompts, want = expected
    (runner,) = _runners(llama_model, [(0, 4)])
    for lora_id, name in ((1, "alpha"), (2, "beta")):
        runner.lora.add(read_adapter(adapters[name], name, llama_model, 8).add_request(lora_id, 1, 8, range(4)))
    for lora in (1, 2, 1):  # one after the other: each takes the one slot from the other
        sched = SchedulerDouble(lambda step: _tag_and_step(runner, step, lora), NUM_BLOCKS, BLOCK_SIZE)
        sched.add(f"x{lora}", prompts[0], 10)
        assert sched.run()[f"x{lora}"] == want[lora][0]
        assert list(runner.lora.resident) == [lora]


def _tag_and_step(runner, step, lora):
    for new in step.new_requests:
        new.lora_id = lora
    return {r: s.token_id for r, s in runner.step(step).sampled.items()}


def test_bad_adapters_are_named(llama_model, adapters, tmp_path):
    with pytest.raises(LoRAAdapterError, match="rank 8 is over --max-lora-rank 4"):
        read_adapter(adapters["beta"], "beta", llama_model, max_rank=4)
    with pytest.raises(LoRAAdapterError, match="no such folder"):
        read_adapter(tmp_path / "nowhere", "gone", llama_model, max_rank=8)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    with pytest.raises(LoRAAdapterError, match="neither adapter_model.safetensors"):
        read_adapter(tmp_path / "empty", "empty", llama_model, max_rank=8)
    pairs = random_pairs(llama_model, ATTENTION, 4, seed=3)
    pairs["model.layers.0.self_attn.w_proj"] = pairs["model.layers.0.self_attn.q_proj"]
    write_peft(tmp_path / "odd", pairs, 4, 8.0, ATTENTION)
    with pytest.raises(LoRAAdapterError, match="targets self_attn.w_proj of layer 0, which the model does not have"):
        read_adapter(tmp_path / "odd", "odd", llama_model, max_rank=8)


def test_a_vision_language_models_adapter_reads_as_its_text_models(tmp_path):
    """PEFT adapters of Qwen3.5 name its decoder layers model.language_model.layers.N (the checkpoint's
    own names): they read exactly as the same weights under the text model's names."""
    import tiny_models

    folder = tiny_models.build_tiny_model("qwen3_5", tmp_path / "qwen3_5")
    modules = ["self_attn.q_proj", "linear_attn.in_proj_qkv", "mlp.down_proj"]
    pairs = random_pairs(folder, modules, 4, seed=5)
    assert {k.split(".")[3] for k in pairs} == {"linear_attn", "self_attn", "mlp"}  # both kinds of layer
    nested = {k.replace("model.layers.", "model.language_model.layers.", 1): v for k, v in pairs.items()}
    plain = read_adapter(write_peft(tmp_path / "plain", pairs, 4, 8.0, modules), "plain", folder, max_rank=8)
    got = read_adapter(write_peft(tmp_path / "nested", nested, 4, 8.0, modules), "nested", folder, max_rank=8)
    assert got.weights.keys() == plain.weights.keys() and len(got.weights) == len(pairs)
    for key, (a, b) in plain.weights.items():
        assert (got.weights[key][0] == a).all() and (got.weights[key][1] == b).all()


def test_a_bad_lora_module_at_start_is_one_line(llama_model, tmp_path, capsys, monkeypatch):
    from types import SimpleNamespace

    from metal_cluster.coordinator.commands import serve
    from metal_cluster.coordinator.api.http_routes import LORA_CHECK_ENV

    monkeypatch.setenv(LORA_CHECK_ENV, "")  # restored after: the check sets it for the API server
    args = SimpleNamespace(model=str(llama_model), max_lora_rank=8,
                           lora_modules=[SimpleNamespace(name="gone", path=str(tmp_path / "gone"))])
    with pytest.raises(SystemExit) as exit_:
        serve._check_lora_modules(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("metal-cluster: error: --lora-modules: LoRA adapter 'gone'") and "no such folder" in err
