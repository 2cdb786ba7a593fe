"""Placement: layers follow memory, KV headroom counts, refusals name the host and the shortfall."""

import pytest

from metal_cluster.coordinator.cluster.placement import GIB, Host, ModelCost, PlacementError, plan

# Roughly a 1B model in float32: 16 layers of ~0.2 GiB, a 0.5 GiB embedding.
COST = ModelCost.uniform(num_layers=16, layer_bytes=int(0.2 * GIB), embed_bytes=int(0.5 * GIB),
                         head_bytes=int(0.5 * GIB), kv_bytes_per_token_per_layer=16 * 1024,
                         activation_bytes=int(0.25 * GIB))


def layers(stages):
    return [(s.host.name, s.start, s.end) for s in stages]


def test_one_host_takes_everything():
    stages = plan([Host("solo", "a:1", 16 * GIB, local=True)], COST, 0.5, 4096)
    assert layers(stages) == [("solo", 0, 16)]


def test_heterogeneous_memory_gets_different_layer_counts():
    hosts = [Host("small", "s:1", 8 * GIB), Host("big", "b:1", 32 * GIB), Host("me", "m:1", 16 * GIB, local=True)]
    stages = plan(hosts, COST, 0.5, 4096)
    names = [s.host.name for s in stages]
    assert names == ["me", "big", "small"]  # the coordinator first, then by memory
    counts = {s.host.name: s.end - s.start for s in stages}
    assert counts["big"] > counts["me"] > counts["small"] >= 1
    assert sum(counts.values()) == 16 and stages[0].start == 0 and stages[-1].end == 16
    assert all(a.end == b.start for a, b in zip(stages, stages[1:]))


def test_wired_hosts_come_before_wifi():
    hosts = [Host("wifi", "w:1", 64 * GIB, wired=False), Host("wired", "e:1", 16 * GIB)]
    assert [s.host.name for s in plan(hosts, COST, 0.5, 1024)] == ["wired", "wifi"]


def test_kv_headroom_is_respected():
    hosts = [Host("a", "a:1", 8 * GIB, local=True), Host("b", "b:1", 8 * GIB)]
    few_tokens = plan(hosts, COST, 0.9, 1024)
    assert layers(few_tokens)[-1][2] == 16
    # With a long context each layer also needs 2 GiB of KV: weights alone would fit, KV does not.
    with pytest.raises(PlacementError) as err:
        plan(hosts, COST, 0.9, 131072)
    assert "KV for 131072 tokens" in str(err.value)


def test_a_model_that_does_not_fit_names_host_and_shortfall():
    with pytest.raises(PlacementError) as err:
        plan([Host("tiny-mac", "t:1", 2 * GIB, local=True)], COST, 0.5, 1024)
    message = str(err.value)
    assert "tiny-mac" in message and "lacks" in message and "GiB" in message


def test_cost_from_a_config():
    config = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
              "num_hidden_layers": 30, "vocab_size": 49152}
    cost = ModelCost.from_config(config)
    assert cost.num_layers == 30
    assert all(13e6 < b < 15e6 for b in cost.layer_bytes)  # ~3.5M parameters a layer in float32
    assert cost.kv_bytes_per_token == [2 * 3 * 64 * 4] * 30


def test_cost_on_gpus_follows_the_checkpoint():
    config = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
              "num_hidden_layers": 30, "vocab_size": 49152, "torch_dtype": "bfloat16"}
    cpu, gpu = ModelCost.from_config(config), ModelCost.from_config(config, on_gpu=True)
    assert gpu.layer_bytes[0] * 2 == cpu.layer_bytes[0]  # bf16 kept on a GPU, float32 on a CPU
    assert gpu.kv_bytes_per_token[0] * 2 == cpu.kv_bytes_per_token[0]
    four_bit = ModelCost.from_config({**config, "quantization": {"group_size": 64, "bits": 4}}, on_gpu=True)
    assert four_bit.layer_bytes[0] / cpu.layer_bytes[0] == pytest.approx((0.5 + 4 / 64) / 4)
    assert four_bit.kv_bytes_per_token == gpu.kv_bytes_per_token
    # A 4-bit model that fits GPU hosts only as stored.
    hosts = [Host("mac", "m:1", 1 * GIB, local=True, gpu=True)]
    fits = ModelCost.from_config({**config, "quantization": {"group_size": 64, "bits": 4}, "num_hidden_layers": 60},
                                 on_gpu=True, activation_bytes=0)
    assert layers(plan(hosts, fits, 0.5, 1024)) == [("mac", 0, 60)]
    with pytest.raises(PlacementError):
        plan(hosts, ModelCost.from_config({**config, "num_hidden_layers": 60}, activation_bytes=0), 0.5, 1024)


def test_moe_layers_cost_what_their_headers_say(tmp_path):
    """A MoE checkpoint: its first two layers dense, the rest holding experts. Per-layer bytes come
    from the safetensors headers, so the plan gives the host with more room more of the heavy layers
    and never more than it holds."""
    import json

    import tiny_models

    folder = tiny_models.build_tiny_model("qwen3_moe", tmp_path / "moe", num_layers=6)
    config = json.loads((folder / "config.json").read_text())
    cost = ModelCost.of_model(folder, config, activation_bytes=0)
    dense, moe = cost.layer_bytes[0], cost.layer_bytes[2]
    assert cost.layer_bytes[1] == dense and set(cost.layer_bytes[2:]) == {moe}
    # 8 experts of 3 x 64 x 32 weights and a router, against one 3 x 64 x 128 MLP, all float32.
    attention_and_norms = dense - 3 * 64 * 128 * 4
    assert moe - attention_and_norms == (8 * 3 * 64 * 32 + 8 * 64) * 4
    assert ModelCost.from_config(config).layer_bytes[2] < moe  # config arithmetic misses the experts
    assert cost.embed_bytes == config["vocab_size"] * 64 * 4 and not cost.head_bytes < cost.embed_bytes
    # Room for the embedding and head plus about half the layers' bytes on each of two hosts.
    half = sum(cost.layer_bytes) // 2 + 2 * moe
    hosts = [Host("me", "m:1", 2 * (cost.embed_bytes + half), local=True),
             Host("other", "o:1", 2 * (cost.head_bytes + half))]
    stages = plan(hosts, cost, 0.5, 0)
    assert [(s.start, s.end) for s in stages][-1][1] == 6
    for s, host in zip(stages, hosts):
        fixed = cost.embed_bytes if s.start == 0 else cost.head_bytes
        assert sum(cost.layer_bytes[s.start:s.end]) + fixed <= 0.5 * host.memory_total


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_recurrent_layers_cost_one_state_whatever_the_context(family, tmp_path):
    """Qwen3-Next and Qwen3.5 (its config under text_config): Gated DeltaNet layers hold no K/V but
    one state per request, which a longer context does not grow; attention layers hold K/V per token."""
    import json

    import tiny_models

    from metal_cluster.stage_worker.families import REGISTRY
    from metal_cluster.stage_worker.model.model_source import text_config

    config = json.loads((tiny_models.build_tiny_model(family, tmp_path, num_layers=6) / "config.json").read_text())
    cost = ModelCost.from_config(config)
    recurrent = [i for i, c in enumerate(REGISTRY[family].layer_caches(text_config(config))) if c.state_shapes]
    assert recurrent and all(cost.state_bytes[i] > 0 and cost.kv_bytes_per_token[i] == 0 for i in recurrent)
    assert all(cost.state_bytes[i] == 0 and cost.kv_bytes_per_token[i] > 0 for i in range(6) if i not in recurrent)
    need = sum(cost.layer_bytes) + sum(cost.state_bytes) + 100 * sum(cost.kv_bytes_per_token)
    roomy, tight = (Host(n, f"{n}:1", int((need + cost.activation_bytes + cost.embed_bytes + cost.head_bytes) / 0.5)
                         + extra) for n, extra in (("a", 1 << 20), ("b", -(1 << 10))))
    assert plan([roomy], cost, 0.5, 100)[0].end == 6
    with pytest.raises(PlacementError):  # the states are counted: without them it would fit
        plan([tight], cost, 0.5, 100)


def test_a_vision_language_checkpoint_costs_its_text_model(tmp_path):
    """Qwen3.5: the layers under model.language_model are counted per layer, the head at the top,
    and neither the vision tower nor the MTP head (no stage holds them)."""
    import tiny_models

    from metal_cluster.stage_worker.model.checkpoint_sizes import read_headers
    from metal_cluster.stage_worker.model.model_source import resolve_model

    folder = tiny_models.build_tiny_model("qwen3_5_moe", tmp_path, num_layers=6)
    cost = ModelCost.of_model(folder, resolve_model(folder).config)
    tensors = read_headers(folder)

    def stored(prefix):
        return sum(t["data_offsets"][1] - t["data_offsets"][0] for n, t in tensors.items() if n.startswith(prefix))

    assert cost.layer_bytes == [stored(f"model.language_model.layers.{i}.") for i in range(6)]
    assert cost.embed_bytes == stored("model.language_model.embed_tokens.")
    assert cost.head_bytes == stored("lm_head.") + stored("model.language_model.norm.")
    assert stored("mtp.") and stored("model.visual.")  # there, and not counted
    estimate = ModelCost.from_config(resolve_model(folder).config)  # no intermediate_size: all experts and the shared one
    assert 0.5 < sum(estimate.layer_bytes) / sum(cost.layer_bytes) < 2


@pytest.mark.parametrize("drafter", ["draft_model", "mtp"])
def test_the_last_host_holds_the_speculative_drafter(drafter, tmp_path):
    """With speculative decoding the last stage also holds its drafter (a draft model run whole, or the
    checkpoint's first MTP layer) and the drafter's own KV pool: placement charges what the stage
    will hold to the last host, and moves layers off it to make room."""
    import tiny_models

    from metal_cluster.coordinator.cluster.placement import with_drafter
    from metal_cluster.stage_worker.model.model_source import resolve_model
    from metal_cluster.stage_worker.model.shard import load_shard
    from metal_cluster.stage_worker.step.speculative.draft import DraftModel
    from metal_cluster.stage_worker.step.speculative.mtp import MTPDrafter

    if drafter == "mtp":
        folder = tiny_models.build_tiny_model("deepseek_v3", tmp_path / "target", mtp_layers=2)
        source = resolve_model(folder)
        held = MTPDrafter.load(source, load_shard(source), k=2)
        cost = with_drafter(ModelCost.of_model(folder, source.config), folder, source.config, mtp=True)
    else:
        folder = tiny_models.build_tiny_model("qwen3", tmp_path / "target", num_layers=6)
        draft = tiny_models.build_tiny_model("llama", tmp_path / "draft", num_layers=2)
        source = resolve_model(folder)
        held = DraftModel.load(str(draft), k=2)
        cost = with_drafter(ModelCost.of_model(folder, source.config), folder, source.config, draft_folder=str(draft))
    # What the stage reports holding (weights; KV per block of 16 tokens), on this CPU in float32.
    assert cost.drafter_bytes == held.weights_bytes > 0
    assert cost.drafter_kv_bytes_per_token * 16 == held.bytes_per_block(16) > 0

    plain = ModelCost.of_model(folder, source.config, activation_bytes=0)
    cost = with_drafter(plain, folder, source.config, draft_folder=None if drafter == "mtp" else str(draft),
                        mtp=drafter == "mtp")
    kv_tokens = 64
    per_layer = [w + kv * kv_tokens for w, kv in zip(plain.layer_bytes, plain.kv_bytes_per_token)]
    # Two equal hosts with room for the ends and a little over half the layers each: without the
    # drafter the layers split evenly; with it the last host takes fewer, and still has room.
    room = sum(per_layer) // 2 + max(per_layer) + plain.embed_bytes + plain.head_bytes + cost.drafter_bytes \
        + cost.drafter_kv_bytes_per_token * kv_tokens
    hosts = [Host("first", "f:1", 2 * room, local=True), Host("last", "l:1", 2 * room)]
    without, with_it = plan(hosts, plain, 0.5, kv_tokens), plan(hosts, cost, 0.5, kv_tokens)
    last = with_it[-1]
    assert last.end - last.start < without[-1].end - without[-1].start
    charged = sum(per_layer[last.start:last.end]) + cost.head_bytes + cost.drafter_bytes \
        + cost.drafter_kv_bytes_per_token * kv_tokens
    assert charged <= room
