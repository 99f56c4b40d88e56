"""DeepSeek-V3's architecture (multi-head latent attention, the sigmoid group-limited router with its correction
bias and routed scaling, shared experts, dense first layers) against transformers' DeepseekV3ForCausalLM, and the
tensor list (models/shapes.py) against the real cells."""

import numpy as np
import pytest

import mindspore as ms

from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
from ascend_llm_recipes.models.shapes import STATISTICS, parameter_dtype, parameter_shapes

SIZES = dict(vocab_size=512, hidden_size=64, num_layers=3, num_heads=4, intermediate_size=128, seq_length=32)
DEEPSEEK = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, dense_layers=[0],
                router_score="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5, expert_bias=True,
                shared_expert_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=16, v_head_dim=32, rms_norm_eps=1e-6)


def deepseek_reference(q_lora_rank):
    """transformers' DeepSeek-V3 at SIZES/DEEPSEEK, random weights and a random correction bias, float32."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=SIZES["vocab_size"], hidden_size=SIZES["hidden_size"], intermediate_size=SIZES["intermediate_size"],
        moe_intermediate_size=32, num_hidden_layers=SIZES["num_layers"], num_attention_heads=SIZES["num_heads"],
        num_key_value_heads=SIZES["num_heads"], n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=16, n_group=4,
        topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, rope_interleave=False,
        max_position_embeddings=SIZES["seq_length"], initializer_range=0.1, attn_implementation="eager")
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.05)
    return model


def our_name(hf_name: str) -> str:
    """transformers' DeepSeek-V3 name -> ours (models/shapes.py); the conversion table does the same."""
    return (hf_name.replace("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias")
            .replace("mlp.shared_experts.", "mlp.shared_expert."))


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_deepseek_v3_logits_equal_transformers(q_lora_rank):
    import torch

    reference = deepseek_reference(q_lora_rank)
    cfg = LlamaConfig(**SIZES, **{**DEEPSEEK, "q_lora_rank": q_lora_rank})
    net = LlamaForCausalLM(cfg)
    state = {our_name(k): ms.Parameter(ms.Tensor(v.numpy()), name=our_name(k))
             for k, v in reference.state_dict().items()}
    not_loaded, unused = ms.load_param_into_net(net, state, strict_load=True)
    assert [n for n in not_loaded if not n.endswith(STATISTICS)] == [] and unused == []
    tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], size=(2, SIZES["seq_length"]))
    with torch.no_grad():
        expected = reference(torch.from_numpy(tokens)).logits.double().numpy()
    ours = net.logits(ms.Tensor(tokens.astype(np.int32))).asnumpy().astype(np.float64)
    assert np.abs(ours - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())


@pytest.mark.parametrize("fields", [
    DEEPSEEK, {**DEEPSEEK, "q_lora_rank": None},
    dict(num_experts=4, moe_intermediate_size=32, qk_norm=True, head_dim=32, shared_expert_intermediate_size=64,
         shared_expert_gate=True, dense_layers=[1])])
def test_the_tensor_list_is_the_real_cells_parameters(fields):
    """models/shapes.py names every weight of the MoE/MLA cells with its shape and dtype (the statistics aside)."""
    cfg = ModelConfig(**SIZES, **fields)
    net = LlamaForCausalLM(LlamaConfig(**SIZES, **fields))
    real = {p.name: tuple(p.shape) for p in net.get_parameters() if not p.name.endswith(STATISTICS)}
    assert parameter_shapes(cfg) == real
    stored = {p.name: str(p.dtype).lower() for p in net.get_parameters() if p.name in real}
    assert {n: parameter_dtype(cfg, n) for n in real} == stored


def test_the_expert_bias_moves_towards_an_even_load_after_each_step():
    """Auxiliary-loss-free balancing: bias += rate x sign(mean load - load), from the step's counted load."""
    from mindspore import nn
    from ascend_llm_recipes.training.worker.router_stats import RouterStats

    net = LlamaForCausalLM(LlamaConfig(**SIZES, **{**DEEPSEEK, "expert_bias_update_rate": 0.01}))
    step = nn.TrainOneStepCell(net, nn.AdamWeightDecay(net.trainable_params(), 1e-3))
    stats = RouterStats(step, collapse_factor=0.0)
    tokens = ms.Tensor(np.random.default_rng(1).integers(0, 512, (2, SIZES["seq_length"] + 1)).astype(np.int32))
    router = net.model.layers[1].mlp.router
    before = router.expert_bias.asnumpy().copy()
    step(tokens)
    values = stats.values()
    load = values[:8]
    stats.from_sums(values, ranks=1, tokens=2 * SIZES["seq_length"], step=1)
    assert load.sum() == 2 * SIZES["seq_length"] * 2
    expected = before + 0.01 * np.sign(load.mean() - load)
    np.testing.assert_array_equal(router.expert_bias.asnumpy(), expected.astype(np.float32))
    assert (router.expert_bias.asnumpy() != before).any()


def test_a_checkpoint_of_another_moe_or_mla_architecture_is_named_by_key():
    """A launch from a checkpoint compares the recorded architecture with the recipe's (models/conversion/ours.py):
    routing and latent-attention keys are architecture; the router loss coefficients are the recipe's choice."""
    from dataclasses import replace
    from ascend_llm_recipes.models.conversion.ours import architecture_differences

    cfg = ModelConfig(**SIZES, **DEEPSEEK)
    assert architecture_differences(cfg, replace(cfg, router_aux_loss_coef=0.01, expert_bias_update_rate=0.001)) == []
    assert architecture_differences(cfg, replace(cfg, n_group=2, kv_lora_rank=48, routed_scaling_factor=1.0)) == [
        "model.model_config.n_group: checkpoint 4, recipe 2",
        "model.model_config.routed_scaling_factor: checkpoint 2.5, recipe 1.0",
        "model.model_config.kv_lora_rank: checkpoint 32, recipe 48"]
    qwen = ModelConfig(**SIZES, num_experts=4, moe_intermediate_size=None, head_dim=None)
    spelled_out = replace(qwen, moe_intermediate_size=SIZES["intermediate_size"], head_dim=16)
    assert architecture_differences(qwen, spelled_out) == []  # an unset size and its default are the same
