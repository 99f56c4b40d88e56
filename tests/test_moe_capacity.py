"""models/moe.py's expert capacity (model_config.capacity_factor, token_drop_policy) against megatron-core 0.16.1's
own functions: get_capacity, topk_routing_with_score_function + apply_router_token_dropping (moe_utils.py), and
compute_routing_scores_for_aux_loss + switch_load_balancing_loss_func for the balancing loss, which reads the top k
before any drop."""

import numpy as np
import pytest
import torch
import mindspore as ms

from ascend_llm_recipes.models.arithmetic import expert_capacity
from ascend_llm_recipes.models.moe import ExpertCapacity, MoE, Router
from ascend_llm_recipes.training.worker.router_stats import RouterStats
from test_moe import EXPERTS, HIDDEN, TOKENS, TOP_K, copy_weights, megatron_moe_utils, moe_config, reference_block

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")

BATCH, SEQ = 3, TOKENS // 3


def logits_for(seed: int) -> np.ndarray:
    """(B*S, E) router logits in our token order (batch row, then position), biased towards the later experts so
    that they overflow a capacity."""
    noise = np.random.default_rng(seed).normal(0.0, 1.0, size=(TOKENS, EXPERTS))
    return (noise + np.linspace(0.0, 2.0, EXPERTS)).astype(np.float32)


def to_megatron_order(array: np.ndarray) -> np.ndarray:
    """(B*S, E) -> (S*B, E): megatron's hidden states are (S, B, hidden), its router flattens them position-major."""
    return array.reshape(BATCH, SEQ, -1).transpose(1, 0, 2).reshape(TOKENS, -1)


def from_megatron_order(array: np.ndarray) -> np.ndarray:
    return array.reshape(SEQ, BATCH, -1).transpose(1, 0, 2).reshape(TOKENS, -1)


def megatron_drop(logits: np.ndarray, factor: float, policy: str):
    """(routing map and combine weights before the drop, combine weights and routing map after it), (B*S, E) numpy
    in our order, as megatron-core's TopKRouter.routing computes them (router.py:573-595; softmax, top k
    renormalised)."""
    moe_utils = megatron_moe_utils()
    probs, routing_map = moe_utils.topk_routing_with_score_function(torch.tensor(to_megatron_order(logits)), TOP_K)
    final_probs, final_map = moe_utils.apply_router_token_dropping(probs, routing_map, TOP_K, factor, policy)
    return [from_megatron_order(t.numpy().astype(np.float32)) for t in (routing_map, probs, final_probs, final_map)]


def our_drop(logits: np.ndarray, factor: float, policy: str):
    """(combine weights, kept selection) of our Router then ExpertCapacity."""
    config = moe_config(capacity_factor=factor, token_drop_policy=policy)
    weights, _, selected, _ = Router(config)(ms.Tensor(logits))
    return [t.asnumpy() for t in ExpertCapacity(config)(weights, selected, BATCH, SEQ)]


@pytest.mark.parametrize("tokens, top_k, experts", [(48, 2, 8), (4096, 8, 64), (1000, 6, 160), (7, 1, 3)])
@pytest.mark.parametrize("factor", [0.1, 0.5, 1.0, 1.1, 1.25, 1.5, 2.0, 3.3])
def test_capacity_is_megatron_cores_get_capacity(tokens, top_k, experts, factor):
    # apply_router_token_dropping asks get_capacity with num_tokens * topk (moe_utils.py:832-836)
    assert expert_capacity(tokens, top_k, experts, factor) == megatron_moe_utils().get_capacity(
        tokens * top_k, experts, factor)


@pytest.mark.parametrize("factor, drops", [(0.5, True), (1.25, True), (4.0, False)])
def test_probs_policy_keeps_megatron_cores_assignments_and_weights(factor, drops):
    logits = logits_for(1)
    routing_map, _, megatron_weights, megatron_kept = megatron_drop(logits, factor, "probs")
    weights, kept = our_drop(logits, factor, "probs")
    assert (megatron_kept.sum() < routing_map.sum()) == drops
    assert np.array_equal(kept, megatron_kept)
    # the kept weights as they were (not renormalised), the dropped 0
    np.testing.assert_allclose(weights, megatron_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("factor, drops", [(1.0, True), (4.0, False)])
def test_position_policy_keeps_as_many_per_expert_as_megatron_core_the_earliest_in_its_order(factor, drops):
    """megatron-core picks "position"'s survivors by torch.topk over the 0/1 routing map, whose order among the 1s
    torch leaves unspecified (on CPU they are not the earliest): what it fixes is how many each expert keeps, among
    which assignments, and their weights. Which ones: the earliest in its token order, as its
    TransformerConfig.moe_token_drop_policy documents ("tokens at the end of each batch will be dropped")."""
    logits = logits_for(2)
    routing_map, probs, _, megatron_kept = megatron_drop(logits, factor, "position")
    weights, kept = our_drop(logits, factor, "position")
    assert (megatron_kept.sum() < routing_map.sum()) == drops
    np.testing.assert_array_equal(kept.sum(0), megatron_kept.sum(0))
    assert not (kept > routing_map).any()
    np.testing.assert_allclose(weights, probs * kept, rtol=1e-5, atol=1e-6)  # kept as they were, dropped 0
    ordered_kept, ordered_map = to_megatron_order(kept), to_megatron_order(routing_map)
    for e in range(EXPERTS):
        candidates = np.flatnonzero(ordered_map[:, e])
        assert np.array_equal(np.flatnonzero(ordered_kept[:, e]), candidates[:int(ordered_kept[:, e].sum())]), e


@pytest.mark.parametrize("dispatch", ["sorted", "stacked", "loop"])
def test_block_output_router_loss_and_dropped_tokens_are_megatron_cores(dispatch):
    """The MoE block with capacity_factor 1.0 on two data-parallel ranks' batches: its output is the experts'
    (transformers' Qwen3-MoE experts, our weights) combined with megatron-core's weights after the drop; its
    balancing loss megatron-core's on the top k before the drop; the step's dropped_tokens megatron-core's fraction
    of dropped assignments over both ranks."""
    moe_utils = megatron_moe_utils()
    block, config = reference_block("qwen3_moe")
    config.capacity_factor, config.router_aux_loss_coef, config.router_z_loss_coef = 1.0, 0.01, 0.001
    ms.set_seed(0)
    cell = MoE(config)
    cell.dispatch = dispatch
    copy_weights(cell, block.state_dict())
    stats = RouterStats(cell, collapse_factor=0.0)
    sums, routed, kept_total = 0.0, 0.0, 0.0
    for rank in range(2):
        x = np.random.default_rng(rank).normal(size=(BATCH, SEQ, HIDDEN)).astype(np.float32)
        out, router_loss = cell(ms.Tensor(x))
        tokens = torch.tensor(x.reshape(TOKENS, HIDDEN))
        with torch.no_grad():
            logits = block.gate(tokens)
            experts = [block.experts[e](tokens).numpy() for e in range(EXPERTS)]
        routing_map, _, weights, kept = megatron_drop(logits.numpy(), 1.0, "probs")
        assert kept.sum() < routing_map.sum()  # some assignments dropped
        expected = sum(y * weights[:, e:e + 1] for e, y in enumerate(experts))
        np.testing.assert_allclose(out.asnumpy().reshape(TOKENS, HIDDEN), expected, rtol=1e-5,
                                   atol=1e-5 * np.abs(expected).max())
        aux_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, TOP_K, "softmax")
        expected_loss = (moe_utils.switch_load_balancing_loss_func(scores, aux_map.sum(0), TOKENS, TOP_K, EXPERTS,
                                                                   0.01)
                         + moe_utils.z_loss_func(logits, 0.001))
        assert float(router_loss.asnumpy()) == pytest.approx(float(expected_loss), rel=1e-5)
        values = stats.values()
        np.testing.assert_array_equal(values[:EXPERTS], kept.sum(0))  # the assignments each expert computed
        sums, routed, kept_total = sums + values, routed + routing_map.sum(), kept_total + kept.sum()
    record = stats.from_sums(sums, ranks=2, tokens=2 * TOKENS, step=1)
    assert record.dropped_tokens == pytest.approx((routed - kept_total) / routed, rel=1e-6)
    assert record.dropped_tokens > 0.05


def test_capacity_keys_are_checked_naming_each():
    from ascend_llm_recipes.common.errors import RecipeError
    from ascend_llm_recipes.training.recipe.loading import load_recipe
    from test_recipe import TINY_RECIPE

    mc = "model.model_config."
    moe = (mc + "num_experts=4", mc + "moe_intermediate_size=32")
    with pytest.raises(RecipeError, match=rf"{mc}capacity_factor: must be >= 0, got -1\.0"):
        load_recipe(TINY_RECIPE, moe + (mc + "capacity_factor=-1.0",))
    with pytest.raises(RecipeError, match=rf"{mc}token_drop_policy: 'position' picks the assignments an expert "
                                          rf"capacity drops, but {mc}capacity_factor is 0"):
        load_recipe(TINY_RECIPE, moe + (mc + "token_drop_policy=position",))
    with pytest.raises(RecipeError, match=rf"{mc}capacity_factor: is set, but {mc}num_experts is 0"):
        load_recipe(TINY_RECIPE, (mc + "capacity_factor=1.25",))
    with pytest.raises(RecipeError, match=rf"{mc}token_drop_policy: 'tokens' is not one of 'probs', 'position'"):
        load_recipe(TINY_RECIPE, moe + (mc + "token_drop_policy=tokens",))
    cfg = load_recipe(TINY_RECIPE, moe + (mc + "capacity_factor=1.25", mc + "token_drop_policy=position"))
    assert (cfg.model.model_config.capacity_factor, cfg.model.model_config.token_drop_policy) == (1.25, "position")


def test_hugging_face_export_notes_the_capacity_it_cannot_write():
    from ascend_llm_recipes.models.conversion.hf_families import export_notes, family_for

    config = moe_config(qk_norm=True, capacity_factor=1.25)
    assert family_for(config).model_type == "qwen3_moe"
    assert export_notes(family_for(config), config) == [
        "capacity_factor: 1.25 is not exported (config.json has no key for it): transformers' MoE blocks route every "
        "token to its top k, so their outputs differ from the trained model's wherever an expert was over capacity"]
    config.capacity_factor = 0.0
    assert export_notes(family_for(config), config) == []


@pytest.mark.parametrize("dispatch", ["sorted", "stacked", "loop"])
def test_gradients_through_the_capacity_are_torch_autograds_through_megatron_cores_drop(dispatch):
    """Routing skewed to experts 0 and 1 (most of their slots dropped at capacity 1.0): the gradients of
    sum(out^2) + router loss, for the input, the router and the experts, are torch autograd's through megatron-core's
    topk_routing_with_score_function and apply_router_token_dropping with transformers' experts. No gradient
    reaches an expert through a dropped slot."""
    moe_utils = megatron_moe_utils()
    block, config = reference_block("qwen3_moe")
    config.capacity_factor, config.router_aux_loss_coef, config.router_z_loss_coef = 1.0, 0.01, 0.001
    with torch.no_grad():
        block.gate.weight[:2] += 0.5  # x is positive on average: experts 0 and 1 are most tokens' top 2
    ms.set_seed(0)
    cell = MoE(config)
    cell.dispatch = dispatch
    copy_weights(cell, block.state_dict())
    x = np.random.default_rng(3).normal(1.0, 0.5, size=(BATCH, SEQ, HIDDEN)).astype(np.float32)
    params = cell.trainable_params()

    def loss(inputs):
        out, router_loss = cell(inputs)
        return (out * out).sum() + router_loss

    value, (d_input, d_params) = ms.value_and_grad(loss, 0, params)(ms.Tensor(x))

    tokens = torch.tensor(x.reshape(TOKENS, HIDDEN), requires_grad=True)
    logits = block.gate(tokens)
    probs, routing_map = moe_utils.topk_routing_with_score_function(logits, TOP_K)
    weights, kept = moe_utils.apply_router_token_dropping(probs, routing_map, TOP_K, 1.0, "probs")
    assert kept[:, :2].sum() < routing_map[:, :2].sum() / 2
    out = sum(block.experts[e](tokens) * weights[:, e:e + 1] for e in range(EXPERTS))
    aux_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, TOP_K, "softmax")
    expected = ((out * out).sum() + moe_utils.switch_load_balancing_loss_func(scores, aux_map.sum(0), TOKENS, TOP_K,
                                                                              EXPERTS, 0.01)
                + moe_utils.z_loss_func(logits, 0.001))
    expected.backward()
    assert float(value.asnumpy()) == pytest.approx(float(expected), rel=1e-5)
    reference = dict(block.named_parameters())
    pairs = [(d_input.asnumpy().reshape(TOKENS, HIDDEN), tokens.grad.numpy(), "input")]
    pairs += [(g.asnumpy(), reference[p.name].grad.numpy(), p.name) for p, g in zip(params, d_params)]
    for ours, theirs, name in pairs:
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5 * np.abs(theirs).max(), err_msg=name)


def test_a_training_step_of_a_model_with_a_capacity_records_its_dropped_assignments():
    from mindspore import nn
    from test_moe import batch, tiny_moe

    net = tiny_moe(capacity_factor=0.5, token_drop_policy="position", router_aux_loss_coef=0.01)
    step = nn.TrainOneStepCell(net, nn.SGD(net.trainable_params(), learning_rate=0.1))
    stats = RouterStats(step, collapse_factor=0.0)
    assert [name for name, _ in stats.layers] == ["model.layers.1.mlp"]
    loss = float(step(ms.Tensor(batch(0))).asnumpy())
    record = stats.from_sums(stats.values(), ranks=1, tokens=2 * 32, step=1)
    # 64 tokens x top 2 over 4 experts at 0.5: 16 slots per expert, 64 of the 128 kept at most
    assert np.isfinite(loss) and record.dropped_tokens >= 0.5


@pytest.mark.parametrize("factor, policy", [(0.5, "probs"), (1.25, "probs"), (1.0, "position"), (4.0, "position")])
def test_the_megatron_readers_verify_reference_drops_as_megatron_core_and_as_ours(factor, policy):
    """models/conversion/megatron_reference.py's megatron_routing (the pure-torch forward --verify compares a
    converted checkpoint with) keeps megatron-core's assignments ("probs"; "position": as many per expert) and
    exactly ours."""
    from ascend_llm_recipes.models.conversion.megatron_reference import megatron_routing

    logits = logits_for(4)
    args = dict(moe_router_topk=TOP_K, moe_expert_capacity_factor=factor, moe_token_drop_policy=policy)
    reference = megatron_routing(torch.tensor(logits), args, BATCH).numpy()
    routing_map, _, megatron_weights, megatron_kept = megatron_drop(logits, factor, policy)
    weights, kept = our_drop(logits, factor, policy)
    np.testing.assert_array_equal((reference > 0).sum(0), megatron_kept.sum(0))
    if policy == "probs":
        np.testing.assert_allclose(reference, megatron_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(reference > 0, kept > 0)
    np.testing.assert_allclose(reference, weights, rtol=1e-5, atol=1e-6)
