"""The MoE routers' per-step numbers (training/worker/router_stats.py), read from a real model after real steps."""

import numpy as np
import pytest

import mindspore as ms
from mindspore import nn

from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
from ascend_llm_recipes.training.worker.router_stats import RouterStats

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


def test_a_collapse_is_warned_once_until_the_layer_recovers(trained, capsys):
    _, stats, _ = trained
    tokens = BATCH * SEQ
    collapsed = np.array([tokens, tokens, 0, 0, 1.5, 2.0], np.float32)  # two experts take every token
    even = np.array([tokens / 2] * EXPERTS + [1.0, 2.0], np.float32)
    assert stats.threshold() == pytest.approx(1.8)  # 3.0 capped at 90% of E / k = 2
    stats.from_sums(collapsed, 1, tokens, step=5)
    stats.from_sums(collapsed, 1, tokens, step=6)
    stats.from_sums(even, 1, tokens, step=7)
    out = capsys.readouterr().out
    assert out.count("router collapse in model.layers.1.mlp: its busiest expert takes 2.00 x the mean load") == 1
    assert "[anomaly] step 7: model.layers.1.mlp's expert load is back under the limit (1.00 x the mean)" in out
