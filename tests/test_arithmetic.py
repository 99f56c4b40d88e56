"""Closed-form parameter and FLOP counts, checked against published totals and real Cells."""

import math

import pytest

from ascend_llm_recipes.models.arithmetic import active_param_count, flops_per_token, padded_vocab_size, param_count
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.presets import PRESETS, PUBLISHED_PARAMETERS, preset


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_presets_match_published_parameter_counts(name):
    assert param_count(preset(name), padded=False) == PUBLISHED_PARAMETERS[name]


def test_every_preset_names_its_source():
    assert all(p["source"] for p in PRESETS.values())
    assert 90e9 < param_count(preset("dense-100b")) < 110e9


def test_flops_per_token_hand_computed():
    cfg = preset("llama2-7b")
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008
    expected = 6 * (32 * per_layer + 32000 * 4096) + 12 * 32 * 4096 * 4096
    assert flops_per_token(cfg) == expected
    assert flops_per_token(cfg) == pytest.approx(46.1e9, rel=0.01)


# Published MoE models (their config.json on the HF Hub) and their totals, rounded to 0.1B where published.
MIXTRAL_8X7B = dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    intermediate_size=14336, seq_length=4096, num_experts=8, num_experts_per_tok=2)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                     qk_norm=True, intermediate_size=6144, moe_intermediate_size=768, seq_length=4096,
                     num_experts=128, num_experts_per_tok=8)


@pytest.mark.parametrize("fields, total, active", [
    # Mistral AI, "Mixtral of experts" (2023-12-11): "46.7B total parameters but only uses 12.9B parameters per token"
    (MIXTRAL_8X7B, 46.7e9, 12.9e9),
    # Qwen/Qwen3-30B-A3B model card: "30.5B in total and 3.3B activated" (3.35B: the card truncates)
    (QWEN3_30B_A3B, 30.5e9, 3.3e9)])
def test_moe_total_and_active_parameters_match_published(fields, total, active):
    cfg = ModelConfig(**fields)
    assert param_count(cfg, padded=False) == pytest.approx(total, abs=0.05e9)
    assert active_param_count(cfg, padded=False) == pytest.approx(active, abs=0.06e9)


def test_moe_flops_per_token_count_the_active_parameters():
    cfg = ModelConfig(**MIXTRAL_8X7B, dense_layers=[0])
    attention = 2 * 4096 * 4096 + 2 * 1024 * 4096
    dense, moe = attention + 3 * 4096 * 14336, attention + 8 * 4096 + 2 * 3 * 4096 * 14336  # router + top-2 experts
    assert flops_per_token(cfg) == 6 * (dense + 31 * moe + 32000 * 4096) + 12 * 32 * 4096 * 4096
    assert active_param_count(cfg) == param_count(cfg) - 31 * 6 * 3 * 4096 * 14336


def test_padded_vocabulary():
    assert padded_vocab_size(32000) == 32000
    assert padded_vocab_size(151655, 16, 1) == 151664
    assert padded_vocab_size(100, 16, 4) == 128


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, dense_layers=[0],
           shared_expert_intermediate_size=32, shared_expert_gate=True)


@pytest.mark.parametrize("fields", [
    dict(tie_word_embeddings=True), dict(qkv_bias=True), dict(num_kv_heads=1), dict(vocab_size=100), MOE])
def test_count_matches_real_cells(fields):
    from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM

    base = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=96, seq_length=32)
    base.update(fields)
    cfg = LlamaConfig(**base)
    real = sum(int(p.size) for p in LlamaForCausalLM(cfg).trainable_params())  # not MoE's routing statistics
    assert real == param_count(cfg)


@pytest.mark.parametrize("fields", [dict(), dict(tie_word_embeddings=True, num_kv_heads=1), dict(qkv_bias=True)])
def test_shapes_converter_plan_and_counts_agree_with_the_cell(fields):
    """models/shapes.py is the architecture: the real Cell's parameters, the converter's plan and the counts."""
    from ascend_llm_recipes.models.config import ModelConfig
    from ascend_llm_recipes.models.conversion.tables import tensor_plan
    from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
    from ascend_llm_recipes.models.shapes import parameter_shapes

    cfg = ModelConfig(**{**dict(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=96, seq_length=32), **fields})
    net = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in vars(cfg).items() if k != "type"}))
    real = {p.name: tuple(p.shape) for p in net.get_parameters()}
    assert parameter_shapes(cfg) == real
    assert {p.ours: p.our_shape for p in tensor_plan(cfg)} == real
    assert param_count(cfg) == sum(math.prod(s) for s in real.values())
    plan = tensor_plan(cfg, tensor_parallel=4)  # vocabulary tables padded to 16 x TP rows, nothing else changes
    assert {p.ours: p.our_shape for p in plan} == parameter_shapes(cfg, 4)
    assert {p.ours: p.our_shape[0] for p in plan if p.hf_shape != p.our_shape} == \
        {name: 128 for name in ("model.embed_tokens.weight", "lm_head.weight") if name in real}


@pytest.mark.parametrize("fields", [dict(num_kv_heads=2), dict(tie_word_embeddings=True), dict(vocab_size=100), MOE])
def test_step_gemms_are_the_real_models_matmuls_and_its_training_flops(fields):
    """Every Linear of the real Cell (and the tied head's MatMul) has its forward, dX and dW GEMM, attention
    its six BatchMatMuls per layer; their FLOPs are the analytic training FLOPs (forward + 2 backward), plus, with
    MoE layers, those of the experts beyond each token's top k (step_gemms lists every expert on every token, as the
    stacked and loop dispatches run them; the default sorted dispatch runs about the routed ones)."""
    from collections import Counter

    from ascend_llm_recipes.models.arithmetic import step_gemms
    from ascend_llm_recipes.models.config import ModelConfig
    from ascend_llm_recipes.models.llama import Attention, LlamaConfig, LlamaForCausalLM, Linear

    cfg = ModelConfig(**{**dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96,
                                seq_length=32), **fields})
    net = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in vars(cfg).items() if k != "type"}))
    cells = [cell for _, cell in net.cells_and_names()]
    real = Counter(tuple(cell.weight.shape) for cell in cells if isinstance(cell, Linear))
    if cfg.tie_word_embeddings:
        real[tuple(net.model.embed_tokens.weight.shape)] += 1  # head_matmul(h, table), transpose_b
    batch, tokens = 3, 3 * cfg.seq_length
    gemms = step_gemms(cfg, batch)
    linear = [g for g in gemms if not g.batch]
    forward = Counter()
    for g in linear:
        if g.name.endswith("forward"):
            assert (g.m, g.form) == (tokens, "NT")
            forward[(g.n, g.k)] += g.count
    assert forward == real
    by_name = {g.name: g for g in gemms}
    for g in linear:
        if g.name.endswith("forward"):  # MatMul(transpose_b) bprop: dX = dY @ W, dW = dY^T @ X
            dx, dw = by_name[g.name.replace("forward", "dX")], by_name[g.name.replace("forward", "dW")]
            assert (dx.m, dx.n, dx.k, dx.form, dx.count) == (tokens, g.k, g.n, "NN", g.count)
            assert (dw.m, dw.n, dw.k, dw.form, dw.count) == (g.n, g.k, tokens, "TN", g.count)
    attention = [g for g in gemms if g.batch]
    layers = [cell for cell in cells if isinstance(cell, Attention)]  # BatchMatMuls over all query heads
    assert sorted(g.form for g in attention) == ["NN", "NN", "NT", "NT", "TN", "TN"]
    assert {(g.batch, g.count) for g in attention} == {((batch, layers[0].num_heads), len(layers))}
    head_dim, s = layers[0].head_dim, cfg.seq_length
    assert {tuple(sorted((g.m, g.n, g.k))) for g in attention} == {(head_dim, s, s)}
    total = sum(g.count * g.flops for g in gemms)
    idle_experts = param_count(cfg) - active_param_count(cfg)
    assert (idle_experts > 0) == bool(cfg.num_experts)
    assert total == (flops_per_token(cfg, padded=True) + 6 * idle_experts) * tokens
    padding = padded_vocab_size(cfg.vocab_size) - cfg.vocab_size
    assert total - flops_per_token(cfg) * tokens == 6 * (padding * cfg.hidden_size + idle_experts) * tokens


def test_step_gemms_of_multi_head_latent_attention_use_its_query_key_and_value_head_widths():
    from ascend_llm_recipes.models.arithmetic import step_gemms

    cfg = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96, seq_length=32,
                      q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    gemms = step_gemms(cfg, 3)
    by_name = {g.name: g for g in gemms if g.batch}
    assert (by_name["attention q k^T forward"].k, by_name["attention p v forward"].n) == (32, 16)  # not 64 / 4
    total = sum(g.count * g.flops for g in gemms)
    assert total == flops_per_token(cfg, padded=True) * 3 * cfg.seq_length
