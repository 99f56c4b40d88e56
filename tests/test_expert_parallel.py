"""The Ascend MoE path (models/expert_parallel.py): MindFormers 1.9's own MoELayer built in our decoder, on CPU.

Its forward needs Ascend (TopkExt, GroupedMatmul, AllToAll have no CPU kernels); what runs here is everything
before that: MindFormers' config class and converter making the TransformerConfig from our recipe, the real cells
built from it inside our model (names, shapes), the checkpoint layout against MindFormers' own converter, and the
whole training graph compiled on CPU up to the first Ascend-only kernel.
"""

import os

import numpy as np
import pytest
import mindspore as ms

from ascend_llm_recipes.common.errors import RecipeError
from ascend_llm_recipes.common.schema import to_plain
from ascend_llm_recipes.models.conversion.ours import stack_moe_layers, stacked_shapes, unstack_moe_layers
from ascend_llm_recipes.models.expert_parallel import MindFormersMoE
from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
from ascend_llm_recipes.models.parallel import plan_layout
from ascend_llm_recipes.models.shapes import STATISTICS, parameter_shapes
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.recipe.mindformers_mcore_export import moe_transformer_config

from conftest import REPO_ROOT

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
MOE_RECIPE = os.path.join(REPO_ROOT, "recipes", "tiny_moe_cpu.yaml")


# Qwen2-MoE's gated shared expert, so that every kind of MoE tensor is in the tables
SHARED_EXPERT = ("model.model_config.shared_expert_intermediate_size=32", "model.model_config.shared_expert_gate=True")


def moe_recipe(tmp_path, *overrides):
    # tiny_moe_cpu.yaml without its router z-loss, which MindFormers' router does not have
    return load_recipe(MOE_RECIPE, [f"output_dir={tmp_path}", "model.model_config.router_z_loss_coef=0",
                                    *overrides], planning=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(recipe, our CPU model, the same model with MindFormers' MoELayer as its MoE layers)."""
    recipe = moe_recipe(tmp_path_factory.mktemp("ep"), *SHARED_EXPERT)
    cfg = recipe.model.model_config
    layout = plan_layout(cfg)
    layout.experts = moe_transformer_config(recipe, MOE_RECIPE)
    ms.set_seed(0)
    return recipe, LlamaForCausalLM(LlamaConfig(**to_plain(cfg))), LlamaForCausalLM(LlamaConfig(**to_plain(cfg)),
                                                                                     layout)


def shapes(net) -> dict:
    return {p.name: tuple(p.shape) for p in net.get_parameters()}


def test_the_transformer_config_is_the_recipe_read_by_mindformers_own_classes(models):
    recipe, _, net = models
    cfg, tc = recipe.model.model_config, net.model.layers[1].mlp.config
    assert isinstance(net.model.layers[1].mlp, MindFormersMoE) and not isinstance(net.model.layers[0].mlp,
                                                                                    MindFormersMoE)
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size, tc.hidden_size) == (
        cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_size, cfg.hidden_size)
    assert (tc.moe_router_score_function, tc.norm_topk_prob, tc.moe_aux_loss_coeff) == (
        cfg.router_score, cfg.norm_topk_prob, cfg.router_aux_loss_coef)
    assert tc.moe_grouped_gemm and tc.moe_token_dispatcher_type == "alltoall"
    # outside semi-auto parallel MindFormers builds every degree at 1, as here on CPU
    assert (tc.data_parallel_size, tc.tensor_model_parallel_size, tc.expert_model_parallel_size) == (1, 1, 1)


def test_a_layout_holding_mindformers_transformer_config_prints():
    """MindFormers pprints the whole run config (trainer/base_trainer.py:1671-1672), our layout inside it; the
    TransformerConfig of its MoE layer holds MindSpore dtypes, whose type's __repr__ pprint cannot hash."""
    import io
    import pprint

    recipe = load_recipe(os.path.join(REPO_ROOT, "recipes", "tiny_moe_ascend.yaml"), planning=True)
    layout = plan_layout(recipe.model.model_config)
    layout.experts = moe_transformer_config(recipe, "tiny_moe_ascend.yaml")
    printed = io.StringIO()
    pprint.pprint({"model": {"model_config": {"layout": layout}}}, stream=printed)
    assert "LlamaLayout(" in printed.getvalue() and "TransformerConfig" not in printed.getvalue()


def test_its_parameters_are_ours_stacked_as_mindformers_converter_stacks_them(models):
    recipe, ours, theirs = models
    cfg = recipe.model.model_config
    ours_stacked = {name: value.shape for name, value in stack_moe_layers(
        {p.name: np.zeros(p.shape, np.float32) for p in ours.get_parameters()}, cfg).items()
        if not name.endswith(STATISTICS)}
    their_weights = {name: shape for name, shape in shapes(theirs).items() if not name.endswith(STATISTICS)}
    assert their_weights == ours_stacked
    # the shape-level variant (the converter's plan, the load check) from models/shapes.py's description
    assert stacked_shapes(parameter_shapes(cfg), cfg) == their_weights


def test_stacked_experts_equal_mindformers_experts_convert_op(models):
    """MindFormers' own Hugging Face -> MindFormers converters (ExpertsConvertOp, ConcatConvertOp) are the
    reference layout."""
    from mindformers.checkpoint.converter.convert_op import ConcatConvertOp, ExpertsConvertOp

    recipe, ours, theirs = models
    cfg, tc = recipe.model.model_config, theirs.model.layers[1].mlp.config
    rng = np.random.default_rng(0)
    tensors = {p.name: rng.normal(size=p.shape).astype(np.float32) for p in ours.get_parameters()}
    stacked = stack_moe_layers(tensors, cfg)
    expert = "model.layers.1.mlp.experts.{e}.{p}.weight"
    per_expert = {p: np.concatenate([tensors[expert.format(e=e, p=p)] for e in range(cfg.num_experts)])
                  for p in ("gate_proj", "up_proj", "down_proj")}
    fc1 = ExpertsConvertOp(hf_names=["a.{}", "b.{}"], mf_names=["w1"])
    fc2 = ExpertsConvertOp(hf_names=["c.{}"], mf_names=["w2"])
    for op in (fc1, fc2):
        op.set_model_config(tc)
        op.optimizer_parallel_size = 1  # one device: no optimizer slicing of the stacked weights
    np.testing.assert_array_equal(stacked["model.layers.1.mlp.experts.weight1"],
                                  fc1._hf_to_mf([per_expert["gate_proj"], per_expert["up_proj"]])[0])
    np.testing.assert_array_equal(stacked["model.layers.1.mlp.experts.weight2"],
                                  fc2._hf_to_mf([per_expert["down_proj"]])[0])
    shared = ConcatConvertOp(hf_names=["g", "u"], mf_names=["fc1"], dim=0)  # SharedExpertMLPInterleaved's fc1
    np.testing.assert_array_equal(stacked["model.layers.1.mlp.shared_experts.linear_fc1.weight"], shared._hf_to_mf(
        [tensors[f"model.layers.1.mlp.shared_expert.{p}.weight"] for p in ("gate_proj", "up_proj")])[0])
    np.testing.assert_array_equal(stacked["model.layers.1.mlp.router.weight"],
                                  tensors["model.layers.1.mlp.gate.weight"])
    back = unstack_moe_layers(stacked, cfg)
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value)


def test_what_its_cells_save_loads_for_an_ascend_recipe_and_reads_back_expert_by_expert(models, tmp_path):
    """A checkpoint of the real cells (as a run on Ascend saves it: stacked experts, the router's counters) passes the
    load check of the recipe run on Ascend, and the exports' reader (--to-hf, --to-megatron) splits it into the
    tensors our CPU model has, the counters set aside."""
    from ascend_llm_recipes.models.conversion.ours import (CHECKPOINT_FILE, MODEL_SECTION_FILE, OurCheckpoint,
                                                           model_section_yaml)
    from ascend_llm_recipes.models.conversion.tables import IGNORED_OURS, check_tensors
    from ascend_llm_recipes.training.worker.train import check_checkpoint_parameters

    recipe, _, theirs = models
    cfg = recipe.model.model_config
    ms.save_checkpoint(theirs, str(tmp_path / CHECKPOINT_FILE), format="safetensors")
    (tmp_path / MODEL_SECTION_FILE).write_text(model_section_yaml(cfg, "the cells' own checkpoint"))
    recipe = moe_recipe(tmp_path, *SHARED_EXPERT, f"load_checkpoint={tmp_path}", "load_ckpt_format=safetensors",
                        "context.device_target=Ascend")
    check_checkpoint_parameters(recipe, 0)
    ckpt = OurCheckpoint(str(tmp_path / CHECKPOINT_FILE), cfg)
    ignored = check_tensors({name: info[1] for name, info in ckpt.tensors.items()},
                            ckpt.expected(parameter_shapes(cfg)), IGNORED_OURS, "the cells' checkpoint")
    assert "model.layers.1.mlp.router.fi_accu" in ignored
    assert sorted(ignored) == sorted(p.name for p in theirs.get_parameters() if p.name.endswith(STATISTICS))
    weights = unstack_moe_layers({p.name: p.asnumpy() for p in theirs.get_parameters()
                                  if not p.name.endswith(STATISTICS)}, cfg)
    assert weights.keys() == parameter_shapes(cfg).keys()
    for name, value in weights.items():
        np.testing.assert_array_equal(ckpt.read(name), value, err_msg=name)


def test_the_training_graph_compiles_on_cpu_up_to_the_first_ascend_only_kernel(models, tmp_path, monkeypatch):
    """Every shape and dtype through our decoder and MindFormers' MoELayer is inferred by MindSpore's compiler;
    the CPU backend then stops at the router's TopkExt, which only Ascend has (the acceptance kit runs it)."""
    _, _, net = models
    monkeypatch.chdir(tmp_path)  # MindSpore writes rank_0/om/analyze_fail.ir where it runs
    with pytest.raises(RuntimeError, match=r"Unsupported op \[TopkExt\] on CPU"):
        net(ms.Tensor(np.zeros((2, net.config.seq_length + 1), np.int32)))


def test_what_mindformers_moe_layer_computes_differently_is_refused_by_key(tmp_path):
    recipe = moe_recipe(tmp_path, "model.model_config.router_z_loss_coef=0.01")
    with pytest.raises(RecipeError, match="router_z_loss_coef: 0.01: MindFormers 1.9's training graph has no router"):
        moe_transformer_config(recipe, MOE_RECIPE)
    recipe = moe_recipe(tmp_path, "model.model_config.num_experts_per_tok=1")
    with pytest.raises(RecipeError, match="norm_topk_prob: True with one expert per token"):
        moe_transformer_config(recipe, MOE_RECIPE)


def test_the_load_balancing_scope_is_mindformers_balancing_type_at_any_passes_per_step(tmp_path):
    """router_aux_loss_scope global is gbs_aux_loss (f over every data-parallel block, and over the step's passes so
    far when there are several), micro_batch seq_aux_loss (mindformers_moe.py LOAD_BALANCING)."""
    recipe = moe_recipe(tmp_path, "use_parallel=True", "parallel_config.data_parallel=2")
    assert moe_transformer_config(recipe, MOE_RECIPE).moe_router_load_balancing_type == "gbs_aux_loss"
    recipe.runner_config.gradient_accumulation_steps = 2  # (semi-auto parallel only: a check this skips)
    assert moe_transformer_config(recipe, MOE_RECIPE).moe_router_load_balancing_type == "gbs_aux_loss"
    recipe = moe_recipe(tmp_path, "use_parallel=True", "parallel_config.data_parallel=2",
                        "model.model_config.router_aux_loss_scope=micro_batch")
    assert moe_transformer_config(recipe, MOE_RECIPE).moe_router_load_balancing_type == "seq_aux_loss"


def test_router_stats_zero_mindformers_counters_and_move_its_correction_bias(tmp_path):
    """What MindFormers' callbacks do for its own models after a step, done on its real router cells."""
    from ascend_llm_recipes.training.worker.router_stats import MindFormersRouterStats, router_stats

    recipe = moe_recipe(tmp_path, "model.model_config.router_score=sigmoid", "model.model_config.expert_bias=True",
                        "model.model_config.expert_bias_update_rate=0.01", "use_parallel=True",
                        "parallel_config.data_parallel=2")
    cfg = recipe.model.model_config
    layout = plan_layout(cfg)
    layout.experts = moe_transformer_config(recipe, MOE_RECIPE)
    net = LlamaForCausalLM(LlamaConfig(**to_plain(cfg)), layout)
    stats = router_stats(net, collapse_factor=1.5)
    assert isinstance(stats, MindFormersRouterStats) and [name for name, _ in stats.layers] == ["model.layers.1.mlp"]
    router = net.model.layers[1].mlp.router
    load = np.array([0.5, 0.3, 0.1, 0.1], np.float32)    # fractions of the routing slots (router.py:371-377)
    router.expert_load.set_data(ms.Tensor(load))
    router.fi_accu.set_data(ms.Tensor(np.ones(4, np.float32)))
    values = stats.values()
    np.testing.assert_array_equal(values, load)
    assert not router.expert_load.asnumpy().any() and not router.fi_accu.asnumpy().any()
    record = stats.from_sums(values * 2, ranks=2, tokens=128, step=3)   # the host all-reduce of two ranks
    assert record.expert_load == [2.0] and record.load_balancing_loss is None
    np.testing.assert_allclose(router.expert_bias.asnumpy(), [-0.01, -0.01, 0.01, 0.01])


SEMI_AUTO_WORKER = """
import json, os
import mindspore as ms
from mindspore.communication import get_rank, init
ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
init()
ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=2, full_batch=True)
from ascend_llm_recipes.common.schema import to_plain
from ascend_llm_recipes.models.expert_parallel import MindFormersMoE
from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.recipe.mindformers import model_layout
for case, (path, overrides) in json.loads(os.environ["CASES"]).items():
    recipe = load_recipe(path, ["output_dir=" + os.getcwd(), "hardware.devices_per_node=2", *overrides],
                         planning=True)
    net = LlamaForCausalLM(LlamaConfig(**to_plain(recipe.model.model_config)), model_layout(recipe))
    moe = [layer.mlp for layer in net.model.layers if isinstance(layer.mlp, MindFormersMoE)]
    attn = net.model.layers[0].self_attn
    print("RESULT", json.dumps({
        "recipe": case, "rank": get_rank(), "moe_layers": len(moe), "sequence_parallel": moe[0].use_seq_parallel,
        "ep": [m.config.expert_model_parallel_size for m in moe],
        "experts_sharded": all("in_layout" in m.experts.morphed_forward.attrs for m in moe),
        "transposes": [list(map(list, m.to_sequence_first.in_strategy)) for m in moe],
        "attention": {name: list(map(list, getattr(attn, name).matmul.in_strategy))
                      for name in ("q_proj", "q_a_proj", "kv_b_proj") if getattr(attn, name, None) is not None},
        "weights": sorted(p.name for p in moe[0].get_parameters())}), flush=True)
"""


def test_mindformers_moe_layer_is_built_with_expert_parallel_in_two_real_processes(tmp_path):
    """Under semi-auto parallel with communication initialised (msrun, 2 CPU processes: DP 2 x EP 2, and TP 2 x
    EP 2), MindFormers' MoELayer (Qwen3-MoE's, and DeepSeek-V3's with our multi-head latent attention) creates its
    expert-parallel groups and sets its shard layouts, inside our model with its strategies; with tensor parallel
    it runs sequence parallel, our block handing it the sequence split over TP.
    (Its compile and forward need Ascend; this is everything before them.)"""
    import json

    from clusters import msrun_workers

    dp2_ep2 = ["parallel_config.data_parallel=2", "parallel_config.expert_parallel=2"]
    tp2_ep2 = ["parallel_config.data_parallel=1", "parallel_config.model_parallel=2",
               "parallel_config.expert_parallel=2"]
    recipe = {name: os.path.join(REPO_ROOT, "recipes", f"{name}.yaml") for name in ("tiny_moe_ascend",
                                                                                    "tiny_deepseek_ascend")}
    cases = {"deepseek": (recipe["tiny_deepseek_ascend"], dp2_ep2), "qwen3": (recipe["tiny_moe_ascend"], dp2_ep2),
             "qwen3_tp2": (recipe["tiny_moe_ascend"], tp2_ep2)}
    lines, _ = msrun_workers(tmp_path, SEMI_AUTO_WORKER, {"CASES": json.dumps(cases)})
    results = {}
    for line in lines:
        r = json.loads(line.split(" ", 1)[1])
        results.setdefault(r["recipe"], []).append(r)
    assert {case: sorted(r["rank"] for r in rs) for case, rs in results.items()} == {case: [0, 1] for case in cases}
    for r in [r for rs in results.values() for r in rs]:
        assert r["moe_layers"] == 3 and r["ep"] == [2, 2, 2] and r["experts_sharded"]
    for r in results["qwen3"] + results["deepseek"]:   # DP 2: the batch split, the sequence whole
        assert r["transposes"] == [[[2, 1, 1]]] * 3 and not r["sequence_parallel"]
    for r in results["qwen3"]:
        assert r["attention"] == {"q_proj": [[2, 1], [1, 1]]}
        assert r["weights"] == ["model.layers.1.mlp.experts.weight1", "model.layers.1.mlp.experts.weight2",
                                "model.layers.1.mlp.router.fi_accu", "model.layers.1.mlp.router.weight"]
    for r in results["deepseek"]:  # multi-head latent attention (models/mla.py) with its strategies, DeepSeek's MoE
        assert r["attention"] == {"q_a_proj": [[2, 1], [1, 1]], "kv_b_proj": [[2, 1], [1, 1]]}
        assert "model.layers.1.mlp.router.expert_bias" in r["weights"]
        assert "model.layers.1.mlp.shared_experts.linear_fc1.weight" in r["weights"]
    for r in results["qwen3_tp2"]:  # TP 2: our heads split; MindFormers' MoE layer sequence parallel, S over TP
        assert r["attention"] == {"q_proj": [[1, 1], [2, 1]]} and r["sequence_parallel"]
        assert r["transposes"] == [[[1, 2, 1]]] * 3
