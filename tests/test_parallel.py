"""Parallel layout: planned on CPU, applied to the real Cells, checked for consistency."""

import mindspore as ms
import pytest

from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
from ascend_llm_recipes.models.parallel import balanced_stages, layout_problems, plan_layout

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def semi_auto_model(config: LlamaConfig, layout=None) -> LlamaForCausalLM:
    """The model as semi-auto parallel builds it (the loss splits the vocabulary; models/loss.py
    loss_splits_vocabulary), the context set back to stand-alone for CPU."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    try:
        return LlamaForCausalLM(config, layout)
    finally:
        ms.set_auto_parallel_context(parallel_mode="stand_alone")


def build(dp, tp, pp, micro=4, recompute=False, select=False, vocab_emb_dp=True, stage_layers=None, **fields):
    config = LlamaConfig(**{**dict(vocab_size=100, hidden_size=64, num_layers=5, num_heads=8, num_kv_heads=4,
                                   intermediate_size=160, seq_length=32), **fields})
    mode = "full" if recompute else "selective" if select else "none"
    return semi_auto_model(config, plan_layout(config, dp, tp, pp, micro, stage_layers, mode, vocab_emb_dp))


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
    for name, linear in linears(net):
        strategy = getattr(linear.matmul, "in_strategy", None)
        out_features, in_features = linear.weight.shape
        if name in COLUMN:
            assert strategy == ((dp, 1), (tp, 1)) and out_features % tp == 0
        else:
            assert strategy == ((dp, tp), (1, tp)) and in_features % tp == 0
    core = net.model.layers[0].self_attn.core
    assert core.qk_matmul.in_strategy == ((dp, tp, 1, 1), (dp, tp, 1, 1))
    assert core.softmax.in_strategy == ((dp, tp, 1, 1),)
    assert net.lm_head.matmul.in_strategy == ((dp, 1), (tp, 1))
    assert net.lm_head.weight.shape[0] % tp == 0


def test_data_parallel_only_layout_sets_explicit_strategies_on_the_real_cells():
    """DP 8 x TP 1 (the 7B recipe's layout): every operator carries a data-parallel strategy, and the constants
    with a leading dimension of 1 (the causal mask, the rotary tables) are read whole, not batch-split."""
    from ascend_llm_recipes.models.parallel import UNSHARDED_OPERATORS

    net = build(8, 1, 1)
    assert not net.whole_vocabulary_loss and not hasattr(net, "fused_loss")
    unsharded = [(cell_name, attr, prim.name) for cell_name, cell in net.cells_and_names()
                 for attr, prim in cell._primitives.items()
                 if prim is not None and getattr(prim, "in_strategy", None) is None
                 and prim.name not in UNSHARDED_OPERATORS and (cell_name, attr) != ("", "gather")]
    assert unsharded == []
    layer = net.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.q_proj.matmul.in_strategy == ((8, 1), (1, 1))
    assert attn.o_proj.matmul.in_strategy == ((8, 1), (1, 1))
    assert layer.input_layernorm.mul.in_strategy == ((8, 1, 1), (8, 1, 1))
    assert layer.add.in_strategy == ((8, 1, 1), (8, 1, 1))
    assert mlp.silu.in_strategy == ((8, 1, 1),)
    assert attn.core.mask_add.in_strategy == ((8, 1, 1, 1), (1, 1, 1, 1))   # the (1, 1, S, S) causal mask
    assert attn.rotary.mul.in_strategy == ((8, 1, 1, 1), (1, 1, 1, 1))     # the (1, 1, S, D) rotary tables
    assert net.loss.max.in_strategy == ((8, 1),)
    assert net.model.embed_tokens.gather.in_strategy == ((1, 1), (8, 1))


def test_every_layer_on_exactly_one_stage():
    net = build(1, 1, 2, micro=4)
    stages = [layer.pipeline_stage for layer in net.model.layers]
    assert stages == [0, 0, 0, 1, 1]
    assert net.model.embed_tokens.pipeline_stage == 0
    assert net.model.norm.pipeline_stage == 1 and net.lm_head.pipeline_stage == 1


def test_explicit_stage_counts():
    net = build(1, 1, 2, micro=4, stage_layers=[1, 4])
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


COVERAGE_WORKER = """
import sys
import numpy as np, mindspore as ms
ms.set_context(mode=0, device_target="CPU")
from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
from ascend_llm_recipes.models.parallel import plan_layout
config = LlamaConfig(**{**dict(vocab_size=100, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                          intermediate_size=96, seq_length=32, qkv_bias=True, document_attention=True), **FIELDS})
# Built as in semi-auto parallel (the loss then splits the vocabulary), compiled stand-alone (CPU).
ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
net = LlamaForCausalLM(config, plan_layout(config, dp=2, tp=2))
ms.set_auto_parallel_context(parallel_mode="stand_alone")
net.set_train(True)
net.compile(ms.Tensor(np.ones((2, 33), np.int32)))
"""


# multi-head latent attention (models/mla.py): one key/value head per query head, no q/k/v bias
MLA_FIELDS = dict(num_kv_heads=4, qkv_bias=False, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=16, v_head_dim=16)


@pytest.mark.parametrize("fields", [{}, MLA_FIELDS], ids=["gqa", "mla"])
def test_every_operator_of_the_compiled_tp_graph_has_a_strategy(tmp_path, fields):
    """Compile a TP 2 model's forward and loss on CPU and read the compiled graph: every operator in it carries
    an explicit in_strategy or is on the allow-list (slices written as x[..., a:b] would not: they become
    StridedSlice operators no cell holds).

    What this does not show: the compile runs in stand-alone mode (semi-auto parallel needs Ascend or GPU), so
    MindSpore's parallel pass never runs and never validates a strategy (divisibility, redistribution,
    operator support); the strategies are attributes the graph carries, checked for presence only."""
    import glob
    import os
    import re
    import subprocess
    import sys

    from ascend_llm_recipes.models.parallel import UNSHARDED_OPERATORS

    script = tmp_path / "compile.py"
    script.write_text(COVERAGE_WORKER.replace("FIELDS", repr(fields)))
    env = dict(os.environ, MS_DEV_SAVE_GRAPHS="1", MS_DEV_SAVE_GRAPHS_PATH=str(tmp_path / "ir"))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    graph = open(glob.glob(str(tmp_path / "ir" / "*_validate_*.ir"))[0], encoding="utf-8").read()
    operators = re.findall(r"= PrimFunc_(\w+)\((.*)", graph)
    missing = sorted({name for name, rest in operators
                      if "in_strategy" not in rest and name not in UNSHARDED_OPERATORS})
    assert missing == []
    sharded = {name for name, rest in operators if "in_strategy" in rest}
    # The operators issue 19 found unsharded: the mask add, transposes, rotary, SwiGLU, RMSNorm and the loss.
    assert {"Transpose", "Concat", "Neg", "SiLU", "Rsqrt", "ReduceMax", "OneHot", "Tile", "Cummax"} <= sharded


def kernel_config(**fields):
    return LlamaConfig(**{**dict(vocab_size=100, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=96, seq_length=32, document_attention=True), **fields})


ASCEND_KERNELS = dict(use_flash_attention=True, use_eod_attn_mask_compression=True, fused_rms_norm=True)


@pytest.mark.parametrize("kernels", [{}, ASCEND_KERNELS, dict(use_flash_attention=True),
                                     dict(use_flash_attention=True, use_attn_mask_compression=True)])
def test_every_primitive_of_every_cell_is_sharded_with_or_without_ascend_kernels(kernels):
    """The Ascend kernels cannot run on CPU, but the cells build: walk every Primitive the cells hold."""
    from ascend_llm_recipes.models.parallel import UNSHARDED_OPERATORS, flash_attention_strategy

    config = kernel_config(**kernels)
    net = semi_auto_model(config, plan_layout(config, dp=2, tp=2))
    # MindFormers' generation mixin (text_generator.py:94) owns a Gather our training graph never calls.
    unused = {("", "gather")}
    unsharded = [(cell_name, attr, prim.name) for cell_name, cell in net.cells_and_names()
                 for attr, prim in cell._primitives.items()
                 if prim is not None and getattr(prim, "in_strategy", None) is None
                 and prim.name not in UNSHARDED_OPERATORS and (cell_name, attr) not in unused]
    assert unsharded == []
    if kernels.get("use_flash_attention"):
        flash = net.model.layers[0].self_attn.core.flash_attention
        assert flash.in_strategy == flash_attention_strategy(net.config, 2, 2)
        assert flash.name == "FlashAttentionScore"
        layout = "TND" if kernels.get("use_eod_attn_mask_compression") else "BNSD"
        assert net.model.layers[0].self_attn.core.layout == layout
        mode = 8 if kernels.get("use_eod_attn_mask_compression") else 2 if kernels.get("use_attn_mask_compression") \
            else 0
        assert flash.attrs["sparse_mode"] == mode and flash.attrs["next_tokens"] == 0
    if kernels.get("fused_rms_norm"):
        assert net.model.norm.norm.in_strategy == ((2, 1, 1), (1,))


@pytest.mark.parametrize("q_lora_rank", [None, 32])
def test_latent_attention_is_split_as_mindformers_splits_its_mla_with_or_without_ascend_kernels(q_lora_rank):
    """DP 2 x TP 2: the up projections by heads, the output projection by rows, the down projections and the latent
    norms with whole weights, the one rotary key whole on every TP rank; FlashAttention scaled by the query/key
    head and reading the narrower value head, as MindFormers 1.9's MLA calls it."""
    from ascend_llm_recipes.models.parallel import UNSHARDED_OPERATORS, flash_attention_strategy

    for kernels in ({}, ASCEND_KERNELS):
        config = kernel_config(**{**MLA_FIELDS, "q_lora_rank": q_lora_rank, **kernels})
        net = semi_auto_model(config, plan_layout(config, dp=2, tp=2))
        unsharded = [(cell_name, attr, prim.name) for cell_name, cell in net.cells_and_names()
                     for attr, prim in cell._primitives.items()
                     if prim is not None and getattr(prim, "in_strategy", None) is None
                     and prim.name not in UNSHARDED_OPERATORS and (cell_name, attr) != ("", "gather")]
        assert unsharded == []
        attn = net.model.layers[0].self_attn
        up = [attn.kv_b_proj] + ([attn.q_proj] if q_lora_rank is None else [attn.q_b_proj])
        assert all(cell.matmul.in_strategy == ((2, 1), (2, 1)) for cell in up)
        down = [attn.kv_a_proj_with_mqa] + ([] if q_lora_rank is None else [attn.q_a_proj])
        assert all(cell.matmul.in_strategy == ((2, 1), (1, 1)) for cell in down)
        assert attn.o_proj.matmul.in_strategy == ((2, 2), (1, 2))
        assert attn.kv_a_layernorm.mul.in_strategy == ((2, 1, 1), (2, 1, 1))
        assert attn.tile.in_strategy == ((2, 1, 1, 1),) and attn.rotary_k.neg.in_strategy == ((2, 1, 1, 1),)
        assert attn.rotary_q.neg.in_strategy == ((2, 2, 1, 1),) and attn.value.slice.in_strategy == ((2, 2, 1, 1),)
        if kernels:
            flash = attn.core.flash_attention
            assert flash.in_strategy == flash_attention_strategy(config, 2, 2)
            assert flash.attrs["scale_value"] == pytest.approx(1 / (16 + 16) ** 0.5)
            assert attn.kv_a_layernorm.norm.in_strategy == ((2, 1, 1), (1,))


def test_parameter_names_and_shapes_do_not_depend_on_the_kernels():
    plain = LlamaForCausalLM(kernel_config())
    fused = LlamaForCausalLM(kernel_config(**ASCEND_KERNELS))
    assert [(p.name, p.shape) for p in plain.get_parameters()] == [(p.name, p.shape) for p in fused.get_parameters()]


def test_the_recipe_layout_reaches_the_model_through_mindformers_build(tmp_path):
    """worker_config's typed layout reaches our model through MindFormers' own model builder, with the degrees
    MindFormers uses: the recipe's in semi-auto parallel, one device's outside it (base_trainer.py:289-296)."""
    import os

    from mindformers import MindFormerConfig
    from mindformers.core.parallel_config import build_parallel_config
    from mindformers.models import build_network

    from conftest import REPO_ROOT
    from ascend_llm_recipes.training.recipe.loading import load_recipe
    from ascend_llm_recipes.training.recipe.mindformers import model_layout, worker_config

    recipe = load_recipe(os.path.join(REPO_ROOT, "recipes", "tiny_ascend.yaml"), [
        f"output_dir={tmp_path}", "parallel_config.data_parallel=1", "parallel_config.model_parallel=2",
        "parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=4",
        "parallel_config.stage_layers=[1, 3]", "recompute_config.recompute=True", "hardware.devices_per_node=4",
    ], planning=True)
    config = MindFormerConfig(**worker_config(recipe, str(tmp_path)))
    build_parallel_config(config)
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    try:
        net = build_network(config.model, default_args={"parallel_config": config.parallel_config,
                                                        "moe_config": config.moe_config})
    finally:
        ms.set_auto_parallel_context(parallel_mode="stand_alone")
    assert [layer.pipeline_stage for layer in net.model.layers] == [0, 1, 1, 1]
    assert net.model.layers[0].self_attn.q_proj.matmul.in_strategy == ((1, 1), (2, 1))
    assert "recompute_comm_op" in net.model.layers[0].self_attn.q_proj.matmul.attrs  # set by Cell.recompute
    # MindFormers turns vocab_emb_dp off under pipeline stages: the embedding table splits over TP
    assert net.model.embed_tokens.gather.in_strategy == ((2, 1), (1, 1))
    data_parallel = model_layout(load_recipe(os.path.join(REPO_ROOT, "recipes", "tiny_ascend.yaml"), [
        f"output_dir={tmp_path}", "parallel.parallel_mode=0", "parallel.full_batch=False",
        "parallel.gradients_mean=True", "parallel_config.data_parallel=8", "parallel_config.model_parallel=1",
        "parallel_config.pipeline_stage=1"], planning=True))
    assert (data_parallel.data_parallel, data_parallel.tensor_parallel, data_parallel.recompute) == (1, 1, "none")
