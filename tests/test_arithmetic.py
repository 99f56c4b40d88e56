"""Closed-form parameter and FLOP counts, checked against published totals and real Cells."""

import math

import pytest

from ascend_llm_recipes.models.arithmetic import flops_per_token, padded_vocab_size, param_count
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


def test_padded_vocabulary():
    assert padded_vocab_size(32000) == 32000
    assert padded_vocab_size(151655, 16, 1) == 151664
    assert padded_vocab_size(100, 16, 4) == 128


@pytest.mark.parametrize("fields", [
    dict(tie_word_embeddings=True), dict(qkv_bias=True), dict(num_kv_heads=1), dict(vocab_size=100)])
def test_count_matches_real_cells(fields):
    from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM

    base = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=96, seq_length=32)
    base.update(fields)
    cfg = LlamaConfig(**base)
    real = sum(int(p.size) for p in LlamaForCausalLM(cfg).get_parameters())
    assert real == param_count(cfg)


@pytest.mark.parametrize("fields", [dict(), dict(tie_word_embeddings=True, num_kv_heads=1), dict(qkv_bias=True)])
def test_shapes_converter_plan_and_counts_agree_with_the_cell(fields):
    """models/shapes.py is the architecture: the real Cell's parameters, the converter's plan and the counts."""
    from ascend_llm_recipes.models.config import ModelConfig
    from ascend_llm_recipes.models.convert import tensor_plan
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
