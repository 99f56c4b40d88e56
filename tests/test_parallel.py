"""Parallel layout: planned on CPU, applied to the real Cells, checked for consistency."""

import pytest
from mindformers.modules.transformer.transformer import TransformerOpParallelConfig, TransformerRecomputeConfig

from models.llama import LlamaConfig, LlamaForCausalLM
from models.parallel import balanced_stages, layout_problems, plan_layout

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def build(dp, tp, pp, micro=4, recompute=False, select=False, vocab_emb_dp=True, **fields):
    parallel = TransformerOpParallelConfig(
        data_parallel=dp, model_parallel=tp, pipeline_stage=pp, micro_batch_num=micro, vocab_emb_dp=vocab_emb_dp,
        recompute=TransformerRecomputeConfig(recompute=recompute, select_recompute=select))
    config = dict(vocab_size=100, hidden_size=64, num_layers=5, num_heads=8, num_kv_heads=4,
                  intermediate_size=160, seq_length=32, parallel_config=parallel)
    config.update(fields)
    return LlamaForCausalLM(LlamaConfig(**config))


def linears(net):
    for layer in net.model.layers:
        for name in COLUMN + ROW:
            cell = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
            yield name, cell


@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 2), (1, 4, 1), (4, 1, 1), (1, 2, 5)])
def test_strategies_match_degrees_and_divide_shapes(dp, tp, pp):
    net = build(dp, tp, pp, micro=max(pp, 1))
    # The vocabulary tables are padded to a multiple of 16 x TP.
    assert net.model.embed_tokens.weight.shape[0] == -(-100 // (16 * tp)) * 16 * tp
    sharded = tp > 1 or pp > 1
    for name, linear in linears(net):
        strategy = getattr(linear.matmul, "in_strategy", None)
        out_features, in_features = linear.weight.shape
        if not sharded:
            assert strategy is None
        elif name in COLUMN:
            assert strategy == ((dp, 1), (tp, 1)) and out_features % tp == 0
        else:
            assert strategy == ((dp, tp), (1, tp)) and in_features % tp == 0
    if sharded:
        core = net.model.layers[0].self_attn.core
        assert core.qk_matmul.in_strategy == ((dp, tp, 1, 1), (dp, tp, 1, 1))
        assert core.softmax.in_strategy == ((dp, tp, 1, 1),)
        assert net.lm_head.matmul.in_strategy == ((dp, 1), (tp, 1))
        assert net.lm_head.weight.shape[0] % tp == 0
        assert 8 % tp == 0 and 4 % tp == 0  # heads and KV heads split evenly


def test_every_layer_on_exactly_one_stage():
    net = build(1, 1, 2, micro=4)
    stages = [layer.pipeline_stage for layer in net.model.layers]
    assert stages == [0, 0, 0, 1, 1]
    assert net.model.embed_tokens.pipeline_stage == 0
    assert net.model.norm.pipeline_stage == 1 and net.lm_head.pipeline_stage == 1


def test_explicit_stage_counts():
    net = build(1, 1, 2, micro=4, pipeline_stage_layers=[1, 4])
    assert [layer.pipeline_stage for layer in net.model.layers] == [0, 1, 1, 1, 1]


def test_balanced_stages_favour_the_middle():
    assert balanced_stages(10, 4) == [2, 3, 3, 2]
    assert balanced_stages(80, 8) == [10] * 8
    assert balanced_stages(5, 2) == [3, 2]
    assert sum(balanced_stages(88, 6)) == 88


def test_vocab_parallel_embedding_when_not_replicated():
    net = build(2, 2, 1, vocab_emb_dp=False)
    assert net.model.embed_tokens.gather.in_strategy == ((2, 1), (2, 1))
    net = build(2, 2, 1, vocab_emb_dp=True)
    assert net.model.embed_tokens.gather.in_strategy == ((1, 1), (2, 1))


def test_recompute_flags():
    full = build(1, 1, 1, recompute=True)
    assert all(layer._has_config_recompute for layer in full.model.layers)
    selective = build(1, 1, 1, select=True)
    assert not any(layer._has_config_recompute for layer in selective.model.layers)
    assert all(layer.self_attn.core._has_config_recompute for layer in selective.model.layers)
    none = build(1, 1, 1)
    assert not any(layer._has_config_recompute or layer.self_attn.core._has_config_recompute
                   for layer in none.model.layers)


def test_tied_embeddings_share_one_table():
    net = build(1, 2, 1, tie_word_embeddings=True)
    names = [p.name for p in net.get_parameters()]
    assert "lm_head.weight" not in names
    assert net.head_matmul.in_strategy == ((1, 1), (2, 1))


def test_problems_name_their_keys():
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, num_layers=3, num_heads=8, num_kv_heads=2,
                      intermediate_size=160, seq_length=32)
    problems = layout_problems(cfg, dp=1, tp=4, pp=4, micro_batches=2, stage_layers=[1, 1, 1, 1])
    assert "parallel_config.model_parallel: 4 does not divide model.model_config.num_kv_heads (2)" in problems
    assert "parallel_config.pipeline_stage: 4 stages exceed model.model_config.num_layers (3)" in problems
    assert any(p.startswith("parallel_config.micro_batch_num: 2 is below pipeline_stage 4") for p in problems)
    assert any(p.startswith("parallel_config.stage_layers: [1, 1, 1, 1] must have") for p in problems)
    with pytest.raises(ValueError, match="does not divide"):
        plan_layout(cfg, tp=4)
