"""The MoE routers' per-step numbers (training/worker/router_stats.py), read from a real model after real steps."""

import re

import numpy as np
import pytest

import mindspore as ms
from mindspore import nn

from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
from ascend_llm_recipes.training.worker.router_stats import COLLAPSE_WINDOW, CollapseWatch, RouterStats

EXPERTS, TOP_K, BATCH, SEQ = 4, 2, 2, 32


@pytest.fixture(scope="module")
def trained():
    """A 2-layer MoE model (layer 0 dense) after one and after two train steps: (net, values of each step)."""
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                      seq_length=SEQ, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
                      dense_layers=[0], router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    net = LlamaForCausalLM(cfg)
    step = nn.TrainOneStepCell(net, nn.AdamWeightDecay(net.trainable_params(), 1e-3))
    stats = RouterStats(step, collapse_factor=3.0)
    tokens = ms.Tensor(np.random.default_rng(0).integers(0, 512, (BATCH, SEQ + 1)).astype(np.int32))
    values = []
    for _ in range(2):
        step(tokens)
        values.append(stats.values())
    return net, stats, values


def test_each_step_counts_every_routing_slot_once_and_is_zeroed_after_reading(trained):
    net, stats, values = trained
    assert [name for name, _ in stats.layers] == ["model.layers.1.mlp"]  # the dense layer has no router
    for v in values:  # [expert load (E), losses (2)] per MoE layer
        loads, losses = v[:EXPERTS], v[EXPERTS:]
        assert loads.sum() == BATCH * SEQ * TOP_K and (loads >= 0).all()
        assert losses[0] >= 1.0 - 1e-6  # E * sum f P is at least 1 (even load and probabilities)
        assert losses[1] > 0
    moe = net.model.layers[1].mlp
    assert not moe.expert_load.asnumpy().any() and not moe.router_losses.asnumpy().any()
    record = stats.from_sums(values[0], ranks=1, tokens=BATCH * SEQ, step=1)
    assert record.dropped_tokens == 0.0  # dropless
    loads = values[0][:EXPERTS]
    assert record.expert_load == [round(float(loads.max() / loads.mean()), 4)]
    assert record.load_balancing_loss == pytest.approx(float(values[0][EXPERTS]))


def test_data_parallel_sums_average_the_losses_and_count_all_ranks_slots(trained):
    _, stats, values = trained
    summed = values[0] + values[1]  # two ranks' values, as the host all-reduce sums them
    record = stats.from_sums(summed, ranks=2, tokens=2 * BATCH * SEQ, step=1)
    assert record.dropped_tokens == 0.0
    assert record.router_z_loss == pytest.approx(float(summed[EXPERTS + 1]) / 2)
    # a rank that routed nothing would show as dropped slots
    assert stats.from_sums(values[0], ranks=1, tokens=2 * BATCH * SEQ, step=1).dropped_tokens == pytest.approx(0.5)


# Each step's routing slots per expert of the MoE layer, recorded from the shipped recipes' 20-step runs
# (`bash scripts/run_distributed.sh recipes/tiny_moe_cpu.yaml`, tiny_deepseek_cpu.yaml): each step sends nearly every
# token to the same two experts, and later steps to others (tiny_deepseek's expert bias restores a spread load).
TINY_MOE_LOADS = [[123, 137, 132, 120], [131, 167, 103, 111], [181, 135, 91, 105], [91, 211, 138, 72],
                  [7, 182, 71, 252], [22, 10, 226, 254], [254, 3, 16, 239], [255, 245, 12, 0], [253, 3, 254, 2],
                  [15, 253, 244, 0], [11, 190, 226, 85], [11, 216, 30, 255], [20, 176, 65, 251], [55, 73, 130, 254],
                  [214, 0, 77, 221], [247, 77, 126, 62], [242, 162, 102, 6], [246, 98, 166, 2], [236, 61, 208, 7],
                  [233, 32, 233, 14]]
TINY_DEEPSEEK_LOADS = [
    [67, 86, 47, 31, 93, 46, 62, 80], [30, 58, 76, 83, 44, 81, 87, 53], [58, 35, 107, 59, 70, 72, 46, 65],
    [166, 107, 94, 55, 27, 10, 31, 22], [175, 60, 7, 136, 12, 55, 59, 8], [138, 226, 1, 35, 54, 7, 40, 11],
    [0, 0, 0, 85, 218, 4, 200, 5], [0, 0, 0, 0, 256, 0, 254, 2], [0, 1, 0, 30, 209, 0, 255, 17],
    [0, 1, 1, 240, 14, 0, 254, 2], [1, 0, 0, 216, 11, 0, 190, 94], [0, 0, 1, 254, 2, 0, 27, 228],
    [0, 1, 14, 235, 11, 5, 53, 193], [0, 0, 64, 249, 38, 1, 69, 91], [19, 0, 2, 243, 218, 10, 12, 8],
    [22, 0, 14, 176, 167, 9, 5, 119], [72, 1, 61, 144, 106, 3, 16, 109], [32, 0, 128, 107, 128, 4, 85, 28],
    [144, 1, 12, 40, 162, 10, 16, 127], [34, 2, 32, 169, 129, 11, 110, 25]]
RECIPE_TOKENS = 256  # batch 4 x seq_length 64


def moe_model(experts: int) -> tuple:
    """A fresh 2-layer model (layer 0 dense) with `experts` experts, top 2, and its RouterStats: (net, stats)."""
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                      seq_length=SEQ, num_experts=experts, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
                      dense_layers=[0])
    net = LlamaForCausalLM(cfg)
    return net, RouterStats(net, collapse_factor=3.0)


@pytest.mark.parametrize("loads", [TINY_MOE_LOADS, TINY_DEEPSEEK_LOADS], ids=["tiny_moe", "tiny_deepseek"])
def test_the_shipped_tiny_recipes_routing_is_no_collapse(loads, capsys):
    """Steps that each send nearly every token to two experts, but not the same two for long, train every expert."""
    _, stats = moe_model(len(loads[0]))
    for step, load in enumerate(loads, 1):
        stats.from_sums(np.array(load + [1.0, 2.0], np.float32), 1, RECIPE_TOKENS, step)
    assert "[anomaly]" not in capsys.readouterr().out


def test_a_router_forced_to_collapse_is_warned_once_until_the_layer_recovers(capsys):
    """A real router whose logits are all 0 sends every token to the same two experts, step after step."""
    net, stats = moe_model(EXPERTS)
    gate = stats.layers[0][1].gate.weight
    gate.set_data(ms.Tensor(np.zeros(gate.shape, np.float32)))
    tokens = np.random.default_rng(1).integers(0, 512, (COLLAPSE_WINDOW, BATCH, SEQ + 1)).astype(np.int32)
    for step in range(1, COLLAPSE_WINDOW + 1):
        net(ms.Tensor(tokens[step - 1]))
        values = stats.values()
        assert sorted(values[:EXPERTS]) == [0, 0, BATCH * SEQ, BATCH * SEQ]  # every token to the same two
        stats.from_sums(values, 1, BATCH * SEQ, step)
        out = capsys.readouterr().out
        assert ("router collapse" in out) == (step == COLLAPSE_WINDOW), (step, out)
    assert re.search(r"\[anomaly\] step 10: router collapse in model\.layers\.1\.mlp: its 2 busiest experts took "
                     r"2\.00 x their even share of the routing slots over the last 10 steps \(a uniform router: "
                     r"1\.0\d; limit 1\.9\d: anomaly\.collapse_factor\)", out), out
    even = np.array([BATCH * SEQ / 2] * EXPERTS + [1.0, 2.0], np.float32)
    for step in range(COLLAPSE_WINDOW + 1, 2 * COLLAPSE_WINDOW + 1):
        stats.from_sums(even, 1, BATCH * SEQ, step)
    out = capsys.readouterr().out
    assert "router collapse" not in out and out.count("expert load is back under the limit") == 1


def test_the_collapse_limit_stands_above_what_a_uniform_router_shows_by_chance():
    """With few tokens a uniform router's busiest experts take well over their even share: the limit rises above it."""
    many, few = CollapseWatch([], 64, 2, 3.0).limit(10 ** 6), CollapseWatch([], 64, 2, 3.0).limit(40)
    assert many[0] == 3.0 and many[1] == pytest.approx(1.0, abs=0.02)
    assert few[0] > 3.0 and few[0] > few[1] > 1.5
    assert CollapseWatch([], 4, 2, 3.0).limit(10 ** 6)[0] == pytest.approx(1.9, abs=0.01)  # 90% of the way to E/k
