"""What MindSpore compiled under DryRun for the tiny MoE and MLA Ascend recipes, read back (training/tools/compiled.py)
and held against the plan: the expert-parallel groups, the experts' slices, the router loss across pipeline stages
(audit #3 F9), gradient accumulation with MindFormers' MoE layer, and multi-head latent attention at TP 2.

Four ranks compiled side by side, once for the module (COMPILES):
- tiny_moe_ascend at DP 4 x PP 2, EP 2, 2 micro-batches, both stages (ranks 0 and 4). Gradient accumulation is not
  added: under pipeline stages MindFormers resets it to 1 (mindformers/trainer/base_trainer.py:313-319).
- tiny_moe_ascend at DP 8, EP 2 with 2 accumulation steps: MindFormers' GradAccumulationCell inside
  MFPipelineWithLossScaleCell (base_trainer.py:375, 510-511).
- tiny_deepseek_ascend at DP 4 x TP 2, EP 8.
Alone on a 2-core host busy with other runs a compile took 190-265 s, two side by side as long; the four together
took 400 s of wall time there: about two compiles'.
"""

import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from ascend_llm_recipes.models.conversion.ours import stacked_names, stacked_shapes
from ascend_llm_recipes.models.shapes import STATISTICS, parameter_shapes
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.recipe.mindformers import model_layout
from ascend_llm_recipes.training.tools import compiled, dryrun, simulated_cann
from ascend_llm_recipes.training.tools.relayout import strategy_file
from ascend_llm_recipes.training.tools.planner import stage_memory
from conftest import REPO_ROOT

TINY_MOE = os.path.join(REPO_ROOT, "recipes", "tiny_moe_ascend.yaml")
TINY_DEEPSEEK = os.path.join(REPO_ROOT, "recipes", "tiny_deepseek_ascend.yaml")
PIPELINE = ("parallel_config.data_parallel=4", "parallel_config.pipeline_stage=2",
            "parallel_config.micro_batch_num=2", "parallel_config.expert_parallel=2")
ACCUMULATION = ("parallel_config.expert_parallel=2", "runner_config.gradient_accumulation_steps=2")
MLA_TP2 = ("parallel_config.data_parallel=4", "parallel_config.model_parallel=2")
# (name, recipe, its settings, the stages compiled: one rank each, the first of the stage)
COMPILES = (("pipeline", TINY_MOE, PIPELINE, (0, 1)), ("accumulation", TINY_MOE, ACCUMULATION, (0,)),
            ("mla", TINY_DEEPSEEK, MLA_TP2, (0,)))


@pytest.fixture(scope="module")
def moe_readback(tmp_path_factory):
    """{name: (recipe as compiled, {stage: Compiled})} of COMPILES, every rank compiled at once."""
    missing = simulated_cann.missing_tools()
    if missing:
        pytest.skip(f"a simulated CANN for the DryRun {missing}")
    root = simulated_cann.cached()
    merged = simulated_cann.merged_environment(root)
    env = {key: merged[key] for key in simulated_cann.environment(root)}  # the tree's variables, nothing else
    recipes = {name: dryrun.compile_recipe(load_recipe(path, settings)) for name, path, settings, _ in COMPILES}
    base = str(tmp_path_factory.mktemp("moe-readback"))
    jobs = [(name, path, stage, rank) for name, path, _, stages in COMPILES
            for stage, rank in dryrun.roles(recipes[name]) if stage in stages]
    with ThreadPoolExecutor(len(jobs)) as pool:
        runs = {(name, stage): pool.submit(dryrun.compile_rank, recipes[name], path, stage, rank, 0,
                                           os.path.join(base, name), 900, env)
                for name, path, stage, rank in jobs}
        runs = {key: run.result() for key, run in runs.items()}
    for (name, _), run in runs.items():
        assert run.ok, f"{name} rank {run.rank} did not compile ({run.seconds:.0f} s): {dryrun.failure_line(run.log)}"
    return {name: (recipes[name], {stage: run for (n, stage), run in runs.items() if n == name}) for name in recipes}


def _strategy(run) -> compiled.StrategyFile:
    return compiled.read_strategy(strategy_file(run.run_dir, run.rank))


def _groups(recipe, rank: int) -> dict:
    p = recipe.parallel_config
    groups = compiled.expected_groups(p.data_parallel, p.model_parallel, p.pipeline_stage, rank, p.expert_parallel)
    groups["expert_copies"] = compiled.expert_copies(p.data_parallel, p.model_parallel, p.pipeline_stage, rank,
                                                     p.expert_parallel)
    return {key: tuple(ranks) for key, ranks in groups.items()}


def _moe_runs(moe_readback):
    return [(recipe, stage, run) for name in ("pipeline", "accumulation")
            for recipe, runs in [moe_readback[name]] for stage, run in runs.items()]


def test_each_rank_holds_its_stage(moe_readback):
    for name, (recipe, runs) in moe_readback.items():
        for stage, run in runs.items():
            assert _strategy(run).stage == stage, f"{name} rank {run.rank}"


def test_the_first_stages_router_loss_reaches_the_last_stage(moe_readback):
    """F9: MoE layer 1 is on stage 0, the loss on stage 1. The router loss passes from layer to layer as a (1,)
    tensor (models/llama.py LlamaModel), so per micro-batch stage 0 sends it to stage 1 beside the hidden states
    and receives its gradient back. Summed outside the layers as a 0-d tensor, neither stage compiled: stage 1 got
    it as a scalar ("For Operator[Add], input's type 'Float32' does not match expected type 'Tensor'")."""
    recipe, runs = moe_readback["pipeline"]
    cfg, micro_batches = recipe.model.model_config, recipe.parallel_config.micro_batch_num
    assert model_layout(recipe).stage_of_layer[1] == 0 and cfg.is_moe_layer(1)
    for stage, run in runs.items():
        pp = _groups(recipe, run.rank)["pp"]
        moved = {}
        for op in compiled.collectives(run.run_dir, run.rank):
            if op.primitive in ("Send", "Receive"):
                assert op.ranks == pp, f"rank {run.rank}: {op}"
                moved.setdefault(op.primitive, []).append(op.output_shape)
        forward, backward = ("Send", "Receive") if stage == 0 else ("Receive", "Send")
        for primitive in (forward, backward):  # the hidden states and the router loss; back, their gradients
            shapes = moved.pop(primitive)
            assert shapes.count("(1)") == micro_batches, f"rank {run.rank} {primitive}: {shapes}"
            hidden = [shape for shape in shapes if shape != "(1)"]  # (B, S, hidden) of a micro-batch
            assert len(hidden) == micro_batches and all(shape.endswith(f", {cfg.seq_length}, {cfg.hidden_size})")
                                                        for shape in hidden), f"rank {run.rank} {primitive}: {shapes}"
        assert not moved


def test_expert_parallel_groups_are_the_layouts(moe_readback):
    for recipe, _, run in _moe_runs(moe_readback):
        groups = _groups(recipe, run.rank)
        created = {tuple(ranks) for ranks in compiled.created_groups(run.log).values()}
        dispatch = {op.ranks for op in compiled.collectives(run.run_dir, run.rank) if op.primitive == "AlltoAllV"}
        assert dispatch == {groups["ep"]}, f"rank {run.rank}: AlltoAllV over {dispatch}"
        assert {groups["ep"], groups["expert_copies"]} <= created, f"rank {run.rank}: {created}"
        if recipe.parallel_config.pipeline_stage > 1:  # TP 1: the TP group is the rank alone, the DP group the stage
            assert created == {groups[k] for k in ("ep", "expert_copies", "pp", "stage", "tp")}, f"rank {run.rank}"


def test_experts_are_split_over_expert_parallel_as_planned(moe_readback):
    for recipe, stage, run in _moe_runs(moe_readback):
        cfg, p = recipe.model.model_config, recipe.parallel_config
        groups = _groups(recipe, run.rank)
        ranks = range(groups["stage"][0], groups["stage"][-1] + 1)
        whole = stacked_shapes(parameter_shapes(cfg, p.model_parallel), cfg)
        planned = {name: n for name, n, _ in stage_memory(recipe)[stage].tensors}
        weights = _strategy(run).weights()
        stacks = {name: parts for name, parts in stacked_names(cfg).items() if name in weights}
        assert stacks and all(compiled.layer_of(name) in
                              [i for i, s in enumerate(model_layout(recipe).stage_of_layer) if s == stage]
                              for name in stacks)
        for name, parts in stacks.items():
            entry = weights[name]
            if ".experts." in name:  # (E x rows, columns): split by experts, over the EP group, copied over the rest
                assert entry.split == (p.expert_parallel, 1), f"rank {run.rank}: {name}"
                assert tuple(entry.ranks_splitting_with_me(run.rank, ranks)) == groups["ep"], name
                assert tuple(entry.ranks_with_my_slice(run.rank, ranks)) == groups["expert_copies"], name
            else:  # the router, whole on every rank
                assert entry.split == (1, 1), f"rank {run.rank}: {name}"
            # the planner counts each expert at 1/EP of its elements: the same per-device total
            assert math.prod(entry.slice_shape(whole[name])) == sum(planned[part] for part in parts), name


def test_accumulation_wraps_the_moe_model_and_keeps_an_accumulator_per_weight(moe_readback):
    recipe, runs = moe_readback["accumulation"]
    run = runs[0]
    with open(run.log, encoding="utf-8", errors="replace") as f:
        assert "GradAccumulationCell is wrapped on network" in f.read()  # mindformers/trainer/base_trainer.py:511
    layouts = _strategy(run).layouts
    weights = {name: entry for name, entry in _strategy(run).weights().items() if not name.endswith(STATISTICS)}
    for name, entry in weights.items():  # mindformers/wrapper/wrapper.py:849: a clone of each weight, laid out like it
        accumulator = layouts["accu_grads." + name]
        assert (accumulator.dev_matrix, accumulator.tensor_map) == (entry.dev_matrix, entry.tensor_map), name


def test_latent_attention_at_tp2_is_split_as_planned(moe_readback):
    recipe, runs = moe_readback["mla"]
    run, layout = runs[0], model_layout(recipe)
    strategy, groups = _strategy(run), _groups(recipe, run.rank)
    dp, down = layout.data_parallel, ((layout.data_parallel, 1), (1, 1))
    roles = {"q_a_proj": down, "kv_a_proj_with_mqa": down, "q_b_proj": layout.strategies["column"],
             "kv_b_proj": layout.strategies["column"], "o_proj": layout.strategies["row"]}
    ranks = range(groups["stage"][0], groups["stage"][-1] + 1)
    for layer in range(recipe.model.model_config.num_layers):
        for part, planned in roles.items():
            name = f"model.layers.{layer}.self_attn.{part}.weight"
            assert strategy.operators[f"MatMul_{name}"] == planned, name
            assert strategy.layouts[name].split == planned[1], name
            if planned[1] != (1, 1):  # split by heads (up) or by rows (output): over the TP group
                assert tuple(strategy.layouts[name].ranks_splitting_with_me(run.rank, ranks)) == groups["tp"], name
        for norm in ("q_a_layernorm", "kv_a_layernorm"):
            assert strategy.operators[f"Mul_model.layers.{layer}.self_attn.{norm}.weight"] == ((dp, 1, 1), (1,))
    reduced = {op.ranks for op in compiled.collectives(run.run_dir, run.rank) if op.primitive == "AllReduce"}
    assert groups["tp"] in reduced  # after the output projection
    created = {tuple(ranks) for ranks in compiled.created_groups(run.log).values()}
    assert {groups["tp"], groups["dp"], groups["ep"]} <= created
