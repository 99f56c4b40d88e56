"""models/moe.py against the reference implementations: megatron-core's router losses and transformers' MoE blocks."""

import numpy as np
import pytest
import torch
import mindspore as ms

from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
from ascend_llm_recipes.models.moe import LoadBalancingLoss, MoE, Router, ZLoss

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")

HIDDEN, EXPERTS, TOP_K, TOKENS = 32, 8, 2, 48


def moe_config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=128, hidden_size=HIDDEN, num_layers=1, num_heads=4, intermediate_size=64,
                  seq_length=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=48)
    fields.update(overrides)
    return ModelConfig(**fields)


def router_logits(seed: int) -> np.ndarray:
    # a bias towards the later experts: an uneven load, the case the loss is for (1.0 exactly when balanced)
    noise = np.random.default_rng(seed).normal(0.0, 1.0, size=(TOKENS, EXPERTS))
    return (noise + np.linspace(0.0, 2.0, EXPERTS)).astype(np.float32)


def our_router(logits: np.ndarray, top_k: int = TOP_K):
    """(combine weights, probabilities, top-k selection) of models/moe.py's Router, as numpy."""
    cell = Router(moe_config(num_experts_per_tok=top_k))
    return [t.asnumpy() for t in cell(ms.Tensor(logits))[:3]]


def megatron_moe_utils():
    from megatron.core.transformer.moe import moe_utils

    return moe_utils


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_load_balancing_loss_is_megatron_cores_and_transformers_over_top_k(top_k):
    logits = router_logits(top_k)
    _, probs, selected = our_router(logits, top_k)
    ours = float(LoadBalancingLoss(EXPERTS, top_k)(ms.Tensor(probs), ms.Tensor(selected)).asnumpy())
    assert ours > 1.2

    torch_logits = torch.tensor(logits)
    torch_probs = torch.softmax(torch_logits, -1)
    routing_map = torch.zeros_like(torch_probs).scatter(1, torch.topk(torch_probs, top_k, -1).indices, 1.0)
    assert np.array_equal(selected, routing_map.numpy())  # the same experts chosen
    megatron = megatron_moe_utils().switch_load_balancing_loss_func(
        torch_probs, routing_map.sum(0), TOKENS, top_k, EXPERTS, moe_aux_loss_coeff=1.0)
    assert ours == pytest.approx(float(megatron), rel=1e-6)

    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    hf = load_balancing_loss_func((torch_logits,), EXPERTS, top_k)  # one layer's logits
    assert ours == pytest.approx(float(hf) / top_k, rel=1e-6)


def test_load_balancing_loss_is_one_when_the_load_is_even():
    # every expert chosen by the same number of tokens, each with the same probabilities: f_e = P_e = 1/E
    logits = np.tile(np.eye(EXPERTS, dtype=np.float32) * 3.0, (TOKENS // EXPERTS, 1))
    _, probs, selected = our_router(logits, 1)
    assert float(LoadBalancingLoss(EXPERTS, 1)(ms.Tensor(probs), ms.Tensor(selected)).asnumpy()) == (
        pytest.approx(1.0, rel=1e-6))


def test_z_loss_is_megatron_cores():
    logits = router_logits(7) * 10  # large logits: the max-shifted logsumexp must not overflow
    ours = float(ZLoss()(ms.Tensor(logits)).asnumpy())
    megatron = megatron_moe_utils().z_loss_func(torch.tensor(logits), z_loss_coeff=1.0)
    assert ours == pytest.approx(float(megatron), rel=1e-6)


def copy_weights(cell, state: dict, rename: dict = None) -> None:
    """Every weight of our cell from the torch state dict (names equal, or mapped by substrings in `rename`); the
    routing statistics (models/moe.py STATISTICS) are not weights."""
    names = [p.name for p in cell.trainable_params()]
    torch_names = set(state)
    for param in cell.trainable_params():
        name = param.name
        for ours, theirs in (rename or {}).items():
            name = name.replace(ours, theirs)
        param.set_data(ms.Tensor(state[name].detach().numpy()))
        torch_names.discard(name)
    assert not torch_names, f"reference weights not copied: {sorted(torch_names)} (ours: {names})"


def reference_block(family: str, norm_topk_prob: bool = True):
    """(transformers' block, our config): the same sizes, random weights (std 0.2: routing far from uniform)."""
    torch.manual_seed(0)
    common = dict(hidden_size=HIDDEN, num_experts_per_tok=TOP_K, hidden_act="silu", num_attention_heads=4)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(num_experts=EXPERTS, moe_intermediate_size=48,
                                                      norm_topk_prob=norm_topk_prob, **common))
        ours = moe_config(norm_topk_prob=norm_topk_prob)
    elif family == "qwen2_moe":
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(num_experts=EXPERTS, moe_intermediate_size=48,
                                                      shared_expert_intermediate_size=80,
                                                      norm_topk_prob=norm_topk_prob, **common))
        ours = moe_config(norm_topk_prob=norm_topk_prob, shared_expert_intermediate_size=80,
                          shared_expert_gate=True)
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        block = MixtralSparseMoeBlock(MixtralConfig(num_local_experts=EXPERTS, intermediate_size=48, **common))
        ours = moe_config(norm_topk_prob=True)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    return block.eval(), ours


@pytest.mark.parametrize("dispatch", ["sorted", "stacked", "loop"])
@pytest.mark.parametrize("family, norm_topk_prob", [("qwen3_moe", True), ("qwen3_moe", False),
                                                    ("qwen2_moe", False), ("mixtral", True)])
def test_moe_block_equals_transformers(family, norm_topk_prob, dispatch):
    block, config = reference_block(family, norm_topk_prob)
    config.router_aux_loss_coef, config.router_z_loss_coef = 0.01, 0.001
    ms.set_seed(0)
    cell = MoE(config)
    cell.dispatch = dispatch
    rename = {".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."} if family == "mixtral" else None
    copy_weights(cell, block.state_dict(), rename)
    x = np.random.default_rng(1).normal(size=(3, TOKENS // 3, HIDDEN)).astype(np.float32)
    with torch.no_grad():
        expected, logits = block(torch.tensor(x))
    out, router_loss = cell(ms.Tensor(x))
    # 1e-5 relative to the output's scale: float32 sums in another order (elements near 0 differ by ~1e-6)
    expected = expected.numpy()
    np.testing.assert_allclose(out.asnumpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # the layer's router loss: megatron-core's two terms on the reference's router logits, with our coefficients
    moe_utils, probs = megatron_moe_utils(), torch.softmax(logits, -1)
    tokens_per_expert = torch.zeros_like(probs).scatter(1, torch.topk(probs, TOP_K, -1).indices, 1.0).sum(0)
    expected_loss = (moe_utils.switch_load_balancing_loss_func(probs, tokens_per_expert, TOKENS, TOP_K, EXPERTS, 0.01)
                     + moe_utils.z_loss_func(logits, 0.001))
    assert float(router_loss.asnumpy()) == pytest.approx(float(expected_loss), rel=1e-5)


def test_sorted_dispatch_gradients_equal_the_reference_loop_when_the_routing_is_lopsided():
    """Every token to experts 0 and 1 (a run longer than a block), no token to the others (empty runs)."""
    config = moe_config(router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    x = np.random.default_rng(2).normal(1.0, 0.5, size=(2, TOKENS // 2, HIDDEN)).astype(np.float32)
    grads = {}
    for dispatch in ("sorted", "loop"):
        ms.set_seed(0)
        cell = MoE(config)
        cell.dispatch = dispatch
        gate = cell.gate.weight.asnumpy()
        gate[:2] += 0.5  # x is positive on average: the logits of experts 0, 1 are ~16 above the rest
        cell.gate.weight.set_data(ms.Tensor(gate))
        params = cell.trainable_params()

        def loss(inputs):
            out, router_loss = cell(inputs)
            return (out * out).sum() + router_loss

        value, (d_input, d_params) = ms.value_and_grad(loss, 0, params)(ms.Tensor(x))
        grads[dispatch] = [float(value.asnumpy()), d_input.asnumpy()] + [g.asnumpy() for g in d_params]
        load = cell.expert_load.asnumpy()
    assert load[:2].tolist() == [TOKENS, TOKENS] and not load[2:].any()
    sorted_grads, loop_grads = grads["sorted"], grads["loop"]
    assert sorted_grads[0] == pytest.approx(loop_grads[0], rel=1e-6)
    for ours, reference in zip(sorted_grads[1:], loop_grads[1:]):
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max() + 1e-12)


PAD = 3


def tiny_moe(**overrides):
    """A 2-layer MoE model (dense layer 0, 4 experts top-2 in layer 1) with seed-0 weights."""
    fields = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                  seq_length=32, pad_token_id=PAD, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  dense_layers=[0])
    fields.update(overrides)
    ms.set_seed(0)
    return LlamaForCausalLM(LlamaConfig(**fields))


def cross_entropy(net, ids: np.ndarray) -> float:
    logits = torch.tensor(net.logits(ms.Tensor(ids[:, :-1])).asnumpy())
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   torch.tensor(ids[:, 1:]).reshape(-1).long(), ignore_index=PAD))


def batch(seed: int) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(4, 128, size=(2, 33)).astype(np.int32)
    ids[1, 25:] = PAD
    return ids


def test_without_router_terms_the_loss_is_the_cross_entropy_and_the_router_still_learns():
    net = tiny_moe(router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    ids = batch(0)
    gate = next(p for p in net.trainable_params() if p.name == "model.layers.1.mlp.gate.weight")
    loss, (grad,) = ms.value_and_grad(net, None, [gate])(ms.Tensor(ids))
    assert float(loss.asnumpy()) == pytest.approx(cross_entropy(net, ids), rel=1e-6)
    # no router loss: the gradient reaches the router through the combine weights of each token's top k alone
    assert np.abs(grad.asnumpy()).max() > 1e-6


def test_a_training_step_moves_the_router_and_the_loss_adds_the_router_terms():
    from mindspore import nn

    net = tiny_moe(router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    ids = batch(1)
    loss = float(net(ms.Tensor(ids)).asnumpy())
    _, router_loss = net.model(ms.Tensor(ids[:, :-1]))
    router_loss = float(router_loss.asnumpy())
    assert 0.01 * 0.9 < router_loss < 0.01 * 4 + 0.001 * 10  # load balancing near 1 (of at most E) + a small z-loss
    assert loss == pytest.approx(cross_entropy(net, ids) + router_loss, rel=1e-6)
    names = ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.0.down_proj.weight",
             "model.layers.0.mlp.down_proj.weight")
    before = {p.name: p.asnumpy().copy() for p in net.trainable_params() if p.name in names}
    step = nn.TrainOneStepCell(net, nn.SGD(net.trainable_params(), learning_rate=0.1))
    step(ms.Tensor(ids))
    after = {p.name: p.asnumpy() for p in net.trainable_params() if p.name in names}
    assert all(np.abs(after[name] - before[name]).max() > 1e-7 for name in names), (
        {name: float(np.abs(after[name] - before[name]).max()) for name in names})


SCOPE_WORKER = """
import json
import numpy as np, mindspore as ms
from mindspore.communication import get_rank, init
ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
init()
ms.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
from ascend_llm_recipes.models.moe import LoadBalancingLoss
rank = get_rank()
logits = (np.random.default_rng(rank).normal(size=(48, 8)) + np.linspace(0.0, 2.0 * (1 - rank), 8)).astype(np.float32)
probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
selected = np.zeros_like(probs)
np.put_along_axis(selected, np.argsort(-probs, -1)[:, :2], 1.0, -1)
losses = {scope: float(LoadBalancingLoss(8, 2, scope)(ms.Tensor(probs), ms.Tensor(selected)).asnumpy())
          for scope in ("global", "micro_batch")}
print("RESULT", json.dumps({"rank": rank, "probs": probs.tolist(), "selected": selected.tolist(), **losses}))
"""


def test_the_load_balancing_scope_counts_the_global_batch_or_each_ranks_micro_batch(tmp_path):
    """Two data-parallel CPU processes with differently loaded batches: "global" counts f_e over both ranks' slots
    (megatron-core's global_aux_loss, each rank's value N x its share of the sum), "micro_batch" over the rank's
    own (megatron-core's aux_loss), with megatron-core's switch_load_balancing_loss_func as the reference."""
    import json

    from clusters import msrun_workers

    lines, _ = msrun_workers(tmp_path, SCOPE_WORKER)
    ranks = [json.loads(line.split(" ", 1)[1]) for line in lines]
    probs = [torch.tensor(r["probs"]) for r in ranks]
    slots = [torch.tensor(r["selected"]).sum(0) for r in ranks]
    loss = megatron_moe_utils().switch_load_balancing_loss_func
    for r, p, s in zip(ranks, probs, slots):
        whole = loss(p, slots[0] + slots[1], 2 * TOKENS, TOP_K, EXPERTS, moe_aux_loss_coeff=1.0)
        assert r["global"] == pytest.approx(2 * float(whole), rel=1e-6)
        assert r["micro_batch"] == pytest.approx(float(loss(p, s, TOKENS, TOP_K, EXPERTS, moe_aux_loss_coeff=1.0)),
                                                 rel=1e-6)
    assert abs(ranks[0]["global"] - ranks[0]["micro_batch"]) > 0.01  # the two ranks' loads differ
