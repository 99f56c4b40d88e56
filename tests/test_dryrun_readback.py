"""What MindSpore compiled under DryRun, read back (training/tools/compiled.py) and held against what the project
plans: every parameter's slice (models/parallel.py strategies, the planner's per-device tensors and bytes), the
communication groups of each rank (compiled.expected_groups) and the pipeline stage of every layer
(LlamaLayout.stage_of_layer).

One layout: tiny_ascend at DP 2 x TP 2 x PP 2, 4 micro-batches, bfloat16 weights (so the pipeline's accumulators
and the float32 masters are there too). Both stages are compiled once for the module, one rank each (ranks 0 and 4),
side by side, by the command a user runs (scripts/run_distributed.sh --check --dry-run): ~150 CPU-seconds in all
(4 minutes' wall time measured on a 2-core host busy with other runs).
"""

import glob
import math
import os
import subprocess

import pytest

from ascend_llm_recipes.models.parallel import optimizer_shard_shape
from ascend_llm_recipes.models.shapes import parameter_dtype, parameter_shapes
from ascend_llm_recipes.training.checkpoint import itemsize
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.recipe.mindformers import model_layout
from ascend_llm_recipes.training.tools import compiled, dryrun, simulated_cann
from ascend_llm_recipes.training.tools.relayout import strategy_file
from ascend_llm_recipes.training.tools.planner import stage_memory
from conftest import REPO_ROOT

TINY_ASCEND = os.path.join(REPO_ROOT, "recipes", "tiny_ascend.yaml")
DENSE_LAYOUT = ("parallel_config.data_parallel=2", "parallel_config.model_parallel=2",
                "parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=4",
                "model.model_config.param_dtype=bfloat16", "model.model_config.compute_dtype=bfloat16")
# The operator MindSpore names after each weight it takes (strategy items "MatMul_<weight>") and the layout role
# whose strategy models/parallel.py gives that operator; norms' weights are multiplied in with (hidden, (1,)).
ROLES = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "gate_proj": "column", "up_proj": "column",
         "o_proj": "row", "down_proj": "row", "lm_head": "vocab_projection", "embed_tokens": "embedding"}


def _role(name: str):
    return next((role for part, role in ROLES.items() if f"{part}." in name or name.startswith(part)), None)


@pytest.fixture(scope="module")
def dense_readback(tmp_path_factory):
    """(recipe as compiled, {stage: Compiled}, the dry run's printed lines) of tiny_ascend at DENSE_LAYOUT, one rank
    per stage, compiled as a user compiles it: `scripts/run_distributed.sh --check --dry-run`, with no dataset (a
    path that does not exist) and over a stale recipe and run directory of an earlier dry run (one run directory
    per stage is left: run_dir, = glob below)."""
    missing = simulated_cann.missing_tools()
    if missing:
        pytest.skip(f"a simulated CANN for the DryRun {missing}")
    env = simulated_cann.merged_environment(simulated_cann.cached(),
                                            {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_")})
    out = tmp_path_factory.mktemp("readback")
    (out / dryrun.DRYRUN_DIR).mkdir()
    (out / dryrun.DRYRUN_DIR / "recipe.yaml").write_text("stale: true\n")
    (out / dryrun.DRYRUN_DIR / "stage0-rank0-earlier").mkdir()  # an earlier dry run's: removed by this one
    settings = (*DENSE_LAYOUT, f"output_dir={out}", f"train_dataset.data_loader.dataset_dir={out / 'absent'}")
    result = subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", "run_distributed.sh"), TINY_ASCEND, "--check",
                             "--dry-run", *(arg for item in settings for arg in ("--set", item))],
                            capture_output=True, text=True, timeout=900, cwd=out, env=env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("dry-run:")]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    recipe = dryrun.compile_recipe(load_recipe(TINY_ASCEND, settings))
    runs = {}
    for stage, rank in dryrun.roles(recipe):
        run_dir, = glob.glob(str(out / dryrun.DRYRUN_DIR / f"stage{stage}-rank{rank}-*"))
        runs[stage] = dryrun.Compiled(stage, rank, 0.0, 0, run_dir, os.path.join(run_dir, "worker.log"), None, 0)
    return recipe, runs, lines


def test_the_dry_run_prints_a_line_per_compiled_rank_with_simulated_and_planned_memory(dense_readback):
    _, _, lines = dense_readback
    assert len(lines) == 3 and "DP 2 x TP 2 x PP 2 on 8 ranks" in lines[0], lines
    assert "(1 of an earlier dry run removed)" in lines[0]
    assert sorted(line.split(" (")[0] for line in lines[1:]) == ["dry-run: stage 0, rank 0 of 8",
                                                                 "dry-run: stage 1, rank 4 of 8"]
    for line in lines[1:]:
        assert "compiled in" in line and "simulated peak" in line and "vs planned" in line
        assert "none printed" not in line and "no kernel workspaces" in line


def _stages(dense_readback):
    recipe, runs, _ = dense_readback
    return [(stage, run, compiled.read_strategy(strategy_file(run.run_dir, run.rank)))
            for stage, run in runs.items()]


def test_strategy_file_lists_every_parameter_of_the_stage(dense_readback):
    recipe, _, _ = dense_readback
    p = recipe.parallel_config
    for stage, run, strategy in _stages(dense_readback):
        planned = {name for name, _, _ in stage_memory(recipe)[stage].tensors}
        assert strategy.stage == stage
        assert set(strategy.weights()) == planned, f"rank {run.rank}"
        # every weight has AdamW's moments and, under pipeline stages, an accumulator; 16-bit ones a float32 master
        for name, layout in strategy.weights().items():
            companions = ["adam_m.", "adam_v."] + (["accu_grads."] if p.pipeline_stage > 1 else []) + \
                (["master."] if parameter_dtype(recipe.model.model_config, name) != "float32" else [])
            for prefix in companions:
                assert strategy.layouts[prefix + name] == compiled.ParameterLayout(
                    prefix + name, layout.dev_matrix, layout.tensor_map, layout.opt_shard_step, layout.opt_shard_size)


def test_every_layer_sits_on_its_planned_stage(dense_readback):
    recipe, _, _ = dense_readback
    planned = model_layout(recipe).stage_of_layer
    held = {}
    for stage, _, strategy in _stages(dense_readback):
        for name in strategy.weights():
            held.setdefault(compiled.layer_of(name), set()).add(stage)
    assert {layer: stages for layer, stages in held.items() if layer is not None} == \
        {layer: {stage} for layer, stage in enumerate(planned)}
    last = recipe.parallel_config.pipeline_stage - 1
    stage_of = {name: stage for stage, _, strategy in _stages(dense_readback) for name in strategy.weights()}
    assert (stage_of["model.embed_tokens.weight"], stage_of["model.norm.weight"], stage_of["lm_head.weight"]) == \
        (0, last, last)


def test_operators_taking_weights_have_the_layouts_strategies(dense_readback):
    recipe, _, _ = dense_readback
    layout = model_layout(recipe)
    dp = layout.data_parallel
    for _, run, strategy in _stages(dense_readback):
        for name in strategy.weights():
            role = _role(name)
            if role is None:  # an RMSNorm weight: x (B, S, H) split by DP times the whole weight
                assert strategy.operators[f"Mul_{name}"] == ((dp, 1, 1), (1,)), name
                continue
            operator = "Gather" if role == "embedding" else "MatMul"
            assert strategy.operators[f"{operator}_{name}"] == layout.strategies[role], f"rank {run.rank}: {name}"


def test_each_weight_is_sliced_as_its_strategy_says(dense_readback):
    recipe, _, _ = dense_readback
    layout = model_layout(recipe)
    whole = parameter_shapes(recipe.model.model_config, layout.tensor_parallel)
    for _, run, strategy in _stages(dense_readback):
        for name, entry in strategy.weights().items():
            role = _role(name)
            # the weight is the embedding Gather's first operand, every MatMul's second
            planned = (1,) if role is None else layout.strategies[role][0 if role == "embedding" else 1]
            assert entry.split == planned, f"rank {run.rank}: {name}"
            assert entry.slice_shape(whole[name]) == tuple(d // s for d, s in zip(whole[name], planned))


@pytest.mark.parametrize("stage", [0, 1])
def test_tensor_parallel_slices_hold_the_planners_elements(dense_readback, stage):
    recipe, _, _ = dense_readback
    whole = parameter_shapes(recipe.model.model_config, recipe.parallel_config.model_parallel)
    _, run, strategy = _stages(dense_readback)[stage]
    planned = {name: n for name, n, _ in stage_memory(recipe)[stage].tensors}
    assert {name: math.prod(entry.slice_shape(whole[name])) for name, entry in strategy.weights().items()} == planned


def test_optimizer_parallel_slices_the_weights_models_parallel_says(dense_readback):
    recipe, _, _ = dense_readback
    cfg, p = recipe.model.model_config, recipe.parallel_config
    threshold = recipe.parallel.parallel_optimizer_config.parallel_optimizer_threshold
    whole = parameter_shapes(cfg, p.model_parallel)
    sliced = set()
    for _, run, strategy in _stages(dense_readback):
        for name, entry in strategy.weights().items():
            shape = whole[name]
            expected = optimizer_shard_shape(shape, itemsize(parameter_dtype(cfg, name)), p.data_parallel, threshold)
            # the rule decides on the whole weight; MindSpore then splits the TP slice's rows over the DP copies
            copies = shape[0] // expected[0]
            assert entry.optimizer_copies == copies, f"rank {run.rank}: {name}"
            if copies > 1:
                sliced.add(name)
                assert entry.ranks_with_my_slice(run.rank, _stage_ranks(recipe, run.rank)) == \
                    compiled.expected_groups(p.data_parallel, p.model_parallel, p.pipeline_stage, run.rank)["dp"]
    assert sliced == {"model.embed_tokens.weight", "lm_head.weight"}  # the two 64 KB tables; the rest are smaller


def test_weight_bytes_per_stage_are_the_planners(dense_readback):
    recipe, _, _ = dense_readback
    cfg = recipe.model.model_config
    whole = parameter_shapes(cfg, recipe.parallel_config.model_parallel)
    memory = stage_memory(recipe)
    for stage, run, strategy in _stages(dense_readback):
        held = sum(compiled.held_bytes(entry, whole[name], itemsize(parameter_dtype(cfg, name)))
                   for name, entry in strategy.weights().items())
        planned = sum(t.bytes for t in memory[stage].terms["none"] if t.category == "weights")
        assert (stage, held) == (stage, planned)


def _stage_ranks(recipe, rank: int) -> range:
    per_stage = recipe.world_size // recipe.parallel_config.pipeline_stage
    return range(rank // per_stage * per_stage, (rank // per_stage + 1) * per_stage)


def test_tensor_parallel_weights_are_split_over_the_tp_group_and_copied_over_dp(dense_readback):
    recipe, _, _ = dense_readback
    p = recipe.parallel_config
    for _, run, strategy in _stages(dense_readback):
        groups = compiled.expected_groups(p.data_parallel, p.model_parallel, p.pipeline_stage, run.rank)
        for name, entry in strategy.weights().items():
            if _role(name) is None:
                continue
            ranks = _stage_ranks(recipe, run.rank)
            assert entry.ranks_splitting_with_me(run.rank, ranks) == groups["tp"], f"rank {run.rank}: {name}"
            assert entry.ranks_with_my_slice(run.rank, ranks) == groups["dp"], f"rank {run.rank}: {name}"


def test_groups_mindspore_created_are_the_layouts(dense_readback):
    recipe, runs, _ = dense_readback
    p = recipe.parallel_config
    for run in runs.values():
        groups = compiled.expected_groups(p.data_parallel, p.model_parallel, p.pipeline_stage, run.rank)
        created = {tuple(ranks) for ranks in compiled.created_groups(run.log).values()}
        assert created == {tuple(groups[k]) for k in ("dp", "tp", "pp", "stage")} | {(run.rank,)}, f"rank {run.rank}"


def test_collectives_run_in_the_groups_of_their_role(dense_readback):
    recipe, runs, _ = dense_readback
    p = recipe.parallel_config
    for run in runs.values():
        groups = {k: tuple(v) for k, v in
                  compiled.expected_groups(p.data_parallel, p.model_parallel, p.pipeline_stage, run.rank).items()}
        by_primitive = {}
        for op in compiled.collectives(run.run_dir, run.rank):
            by_primitive.setdefault(op.primitive, set()).add(op.ranks)
        assert by_primitive.pop("Send") == by_primitive.pop("Receive") == {groups["pp"]}, f"rank {run.rank}"
        # optimizer parallel gathers each sliced weight and scatters its gradient over the DP copies
        assert by_primitive.pop("AllGather") == {groups["dp"]}, f"rank {run.rank}"
        assert by_primitive.pop("ReduceScatter", {groups["dp"]}) == {groups["dp"]}, f"rank {run.rank}"
        reduced = by_primitive.pop("AllReduce")
        assert groups["tp"] in reduced, f"rank {run.rank}: no tensor-parallel reduction"  # after o_proj, down_proj
        assert reduced <= set(groups.values()), f"rank {run.rank}: {reduced}"
        assert not by_primitive, f"rank {run.rank}: collectives of no planned role: {by_primitive}"
