"""Closed-form parameter and FLOP counts, checked against published totals and real Cells."""

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
