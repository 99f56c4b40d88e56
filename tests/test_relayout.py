"""Checkpoints across parallel layouts (training/tools/relayout.py), checked on CPU where they can be.

Semi-auto parallel does not run on CPU, so no strategy file can be written here: these tests check
the MindFormers config that asks for them, the decisions and refusals on a real data-parallel run
directory, and the acceptance kit's report on real CPU run directories.
"""

import json
import os
import shutil

import pytest

from conftest import DP_STEPS, DP2_RECIPE, REPO_ROOT, TINY_RECIPE
from ascend_llm_recipes.common.errors import ConversionError, LaunchError, RecipeError
from ascend_llm_recipes.training.recipe.loading import load_recipe

TINY_ASCEND = os.path.join(REPO_ROOT, "recipes", "tiny_ascend.yaml")
TP_PP = ["parallel_config.data_parallel=2", "parallel_config.model_parallel=2", "parallel_config.pipeline_stage=2",
         "parallel_config.micro_batch_num=4"]
# The DP2 CPU run's model and global batch (2 x 2), at another layout of its 2 devices.
AS_TP2 = ["use_parallel=True", "parallel.parallel_mode=1", "parallel.full_batch=True", "parallel.gradients_mean=False",
          "parallel_config.data_parallel=1", "parallel_config.model_parallel=2", "runner_config.batch_size=4"]


@pytest.fixture(scope="module")
def dp2_run(data_parallel_runs, tmp_path_factory):
    """The shared real data-parallel run (2 msrun workers, checkpoint at its last step) and its --to-hf export."""
    from ascend_llm_recipes.training.tools.export import to_hf

    _, run = data_parallel_runs
    hf = str(tmp_path_factory.mktemp("relayout") / "hf")
    to_hf(run, hf, show_progress=False)
    return run, hf


def as_tp2(run: str, tmp_path) -> str:
    """A copy of the run whose recipe.yaml says DP1 x TP2 (written by the recipe loader), as an Ascend run's would."""
    copy = str(tmp_path / "tp2_run")
    shutil.copytree(run, copy)
    overrides = [f"output_dir={copy}", "context.device_target=Ascend", *AS_TP2]
    recipe = load_recipe(os.path.join(run, "recipe.yaml"), overrides, planning=True)
    with open(os.path.join(copy, "recipe.yaml"), "w", encoding="utf-8") as f:
        f.write(recipe.to_yaml())
    return copy


def test_semi_auto_config_saves_every_ranks_strategy_file_in_the_run_dir(tmp_path, tiny_dataset, monkeypatch):
    """The generated config, through MindFormers' own set_strategy_save_path and parallel-context setter."""
    import mindspore as ms
    from mindformers.core.context.parallel import ParallelOperator
    from mindformers.tools.utils import PARALLEL_MODE
    from mindformers.utils.file_utils import set_strategy_save_path
    from ascend_llm_recipes.training.worker.train import mindformers_config

    data = f"train_dataset.data_loader.dataset_dir={tiny_dataset}"
    recipe = load_recipe(TINY_ASCEND, [f"output_dir={tmp_path}", data, *TP_PP], planning=True)
    monkeypatch.setenv("RANK_ID", "3")
    monkeypatch.setenv("LOCAL_DEFAULT_PATH", str(tmp_path))  # the worker's output root is its run directory
    config = mindformers_config(recipe, str(tmp_path))
    assert config["auto_trans_ckpt"] is False and "src_strategy_path_or_dir" not in config
    parallel = dict(config["parallel"])
    parallel["parallel_mode"] = PARALLEL_MODE[parallel["parallel_mode"]]  # as core/context/validators.py:60 does
    set_strategy_save_path(parallel)
    try:
        ParallelOperator._set_ms_auto_parallel_context(**parallel)
        saved = ms.get_auto_parallel_context("strategy_ckpt_config")
        expected = os.path.join(os.path.realpath(tmp_path), "strategy", "ckpt_strategy_rank_3.ckpt")
        assert saved["save_file"] == expected and saved["only_trainable_params"] is False
        assert ms.get_auto_parallel_context("strategy_ckpt_save_file") == expected
    finally:
        ms.reset_auto_parallel_context()
    # A data-parallel run has no strategy (MindSpore writes none): its config asks for no file.
    dp = load_recipe(DP2_RECIPE, [f"output_dir={tmp_path}", data])
    config = mindformers_config(dp, str(tmp_path))
    assert not {"strategy_ckpt_config", "strategy_ckpt_save_file"} & set(config["parallel"])
    assert config["auto_trans_ckpt"] is False


def test_exported_mindformers_config_carries_the_strategy_config(tmp_path):
    import yaml
    from ascend_llm_recipes.training.recipe.mindformers import to_mindformers

    path = tmp_path / "tp_pp.yaml"
    recipe = load_recipe(TINY_ASCEND, [f"output_dir={tmp_path}", *TP_PP], planning=True)
    path.write_text(recipe.to_yaml())
    text, _ = to_mindformers(str(path))
    assert yaml.safe_load(text)["parallel"]["strategy_ckpt_config"] == \
        {"save_file": "./ckpt_strategy.ckpt", "only_trainable_params": False}


def test_auto_trans_ckpt_is_refused_on_cpu_by_name(tmp_path):
    with pytest.raises(RecipeError, match=r"auto_trans_ckpt: re-slices a checkpoint with the parallel strategy files.*"
                                          r"written only by a semi-auto-parallel compile, which does not run on CPU"):
        load_recipe(TINY_RECIPE, [f"output_dir={tmp_path}", "auto_trans_ckpt=True"])


def test_resume_at_another_layout_is_decided_on_a_real_run_dir(dp2_run, tmp_path):
    """Data-parallel-mode changes need nothing; a semi-auto checkpoint needs auto_trans_ckpt and its strategy files."""
    from ascend_llm_recipes.training.launcher.resume import saved_recipe
    from ascend_llm_recipes.training.tools.relayout import check_relayout, keep_source_strategy, pending_source_strategy

    run, _ = dp2_run
    # MindFormers makes the folder; data parallel writes none, and the launcher removes it empty
    assert not os.path.exists(os.path.join(run, "strategy"))
    step_dir = os.path.join(run, "checkpoints", f"step_{DP_STEPS:08d}")
    previous = saved_recipe(run)
    recipe_yaml = os.path.join(run, "recipe.yaml")
    check_relayout(previous, load_recipe(recipe_yaml, planning=True), run, step_dir)  # same layout
    dp1 = load_recipe(recipe_yaml, ["parallel_config.data_parallel=1", "runner_config.batch_size=4",
                                    "hardware.devices_per_node=1"])
    check_relayout(previous, dp1, run, step_dir)  # data-parallel mode: whole tensors in every rank's file
    tp2 = load_recipe(recipe_yaml, [*AS_TP2, "auto_trans_ckpt=True"], planning=True)
    with pytest.raises(LaunchError, match=r"(?s)saved at DP2 x TP1 x PP1 \(data-parallel mode\) \(2 devices\), this "
                                          r"recipe runs DP1 x TP2 x PP1; its ranks' files hold whole tensors.*start a "
                                          r"new run from one rank's file"):
        check_relayout(previous, tp2, run, step_dir)
    # The same shards recorded as a semi-auto DP1 x TP2 run's (recipe.yaml written by the loader), resumed at DP2.
    tp_run = as_tp2(run, tmp_path)
    tp_step = os.path.join(tp_run, "checkpoints", f"step_{DP_STEPS:08d}")
    tp_previous = saved_recipe(tp_run)
    semi_dp2 = [*AS_TP2, "parallel_config.data_parallel=2", "parallel_config.model_parallel=1",
                "runner_config.batch_size=2"]
    dp2 = load_recipe(recipe_yaml, semi_dp2, planning=True)
    with pytest.raises(LaunchError, match=r"(?s)saved at DP1 x TP2 x PP1 \(2 devices\), this recipe runs DP2 x TP1 x "
                                          r"PP1; each rank's file holds its slice.*set auto_trans_ckpt: True"):
        check_relayout(tp_previous, dp2, tp_run, tp_step)
    dp2 = load_recipe(recipe_yaml, [*semi_dp2, "auto_trans_ckpt=True"], planning=True)
    with pytest.raises(LaunchError, match=r"strategy file of every rank of DP1 x TP2 x PP1, and 2 are missing: .*"
                                          r"tp2_run/strategy/ckpt_strategy_rank_0\.ckpt"):
        check_relayout(tp_previous, dp2, tp_run, tp_step)
    tp2_pp2 = load_recipe(recipe_yaml, [*AS_TP2, "parallel_config.pipeline_stage=2", "runner_config.batch_size=2",
                                        "parallel_config.micro_batch_num=2", "hardware.devices_per_node=4",
                                        "auto_trans_ckpt=True"], planning=True)
    with pytest.raises(LaunchError, match=r"this recipe runs DP1 x TP2 x PP2; a relayout keeps the device count \(2\)"):
        check_relayout(tp_previous, tp2_pp2, tp_run, tp_step)
    with pytest.raises(LaunchError, match=r"re-slicing loads into a semi-auto-parallel graph"):
        check_relayout(tp_previous, load_recipe(recipe_yaml, ["auto_trans_ckpt=True"], planning=True), tp_run, tp_step)
    dp2.planning = False  # as executed here (CPU): said before anything else
    dp2.context.device_target = "CPU"
    with pytest.raises(LaunchError, match=r"re-slicing needs the strategy files .*none can exist on this machine"):
        check_relayout(tp_previous, dp2, tp_run, tp_step)
    # Nothing was moved or marked, and no launch re-slices anything.
    dp2.load_checkpoint, dp2.resume_training = tp_step, True
    assert pending_source_strategy(dp2) is None and not os.path.exists(os.path.join(tp_step, "strategy"))
    dp1.auto_trans_ckpt = True
    keep_source_strategy(previous, dp1, run, step_dir)
    assert not os.path.exists(os.path.join(step_dir, "layout.json"))


def test_to_hf_of_a_data_parallel_run_is_unchanged_and_a_tp_run_needs_its_strategy_files(dp2_run, tmp_path):
    from ascend_llm_recipes.training.tools.relayout import export_source

    run, _ = dp2_run
    assert export_source(run) == (run, None)
    tp_run = as_tp2(run, tmp_path)
    with pytest.raises(ConversionError, match=rf"step_{DP_STEPS:08d}: a DP1 x TP2 x PP1 checkpoint holds "
                                              r"each rank's slice .*"
                                              r"2 are missing: .*tp2_run/strategy/ckpt_strategy_rank_0\.ckpt"):
        export_source(tp_run)
    assert not os.path.exists(os.path.join(tp_run, "merged_checkpoint"))
    import subprocess
    import sys
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts", "convert_checkpoint.py"), "--to-hf",
                             tp_run, "--output", str(tmp_path / "hf")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "strategy/ckpt_strategy_rank_1.ckpt" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "hf").exists()


def test_acceptance_report_from_real_run_directories(dp2_run, tmp_path):
    """evaluate() + write_report() on CPU runs standing in for the kit's run directories."""
    from ascend_llm_recipes.training.tools import acceptance

    run, hf = dp2_run
    out = tmp_path / "out"
    out.mkdir()
    for name in [*acceptance.LAYOUTS, "killed", f"float32_{acceptance.BF16_STEPS}",
                 f"bfloat16_{acceptance.BF16_STEPS}", *(f"relayout_{t}" for t in acceptance.RELAYOUT_TARGETS),
                 "dp8_opt", "killed_dp_opt", *(f"{p}_s{acceptance.FUSED_SEQ}" for p in acceptance.FUSED_PATHS)]:
        os.symlink(run, out / name)
    os.symlink(hf, out / acceptance.HF_EXPORT)
    codes = {check: 0 for check, _, _ in acceptance.plan_commands(str(out))}
    results = acceptance.evaluate(str(out), codes)
    acceptance.write_report(str(out), results)
    report = json.loads((out / "acceptance.json").read_text())
    assert set(report) == set(results) and all(r["status"] in ("PASS", "FAIL") for r in report.values())
    assert report["layout_dp2_tp2_pp2_vs_dp8"]["status"] == "PASS"  # the same losses: difference 0
    assert report["layout_dp2_tp2_pp2_vs_dp8"]["max_relative_difference"] == 0.0
    assert report["kill_resume_tp_pp"]["steps"] == [DP_STEPS] * 2
    # Losses agree, but no checkpoint was re-sliced by MindFormers: not a pass.
    relayout = report["resume_dp8_from_dp2_tp2_pp2"]
    assert relayout["status"] == "FAIL" and relayout["transformed_files"] == 0
    assert relayout["max_relative_difference"] == 0
    # The export loads in transformers and matches our model on the checkpoint it read; it was not merged from
    # shards (a data-parallel run), so it does not pass the TP/PP claim.
    export = report["to_hf_tp_pp"]
    assert export["max_abs_delta"] <= export["max_abs_tolerance"] and export["kl"] <= export["kl_tolerance"]
    assert export["merged_from_shards"] is False and export["status"] == "FAIL" and export["not_loaded"] == []
    assert acceptance.hf_export_result(hf)["status"] == "PASS"
    assert report["memory_llama2_7b_8dev"]["measured_peak_gb"] is None  # no device memory on CPU
    assert report["fused_kernels_vs_math"]["status"] == "PASS"
    # The same losses, but the stand-in never resumed (resumed_from_step 0): a silent restart is not a resume.
    assert report["kill_resume_dp_opt"]["status"] == "FAIL" and report["kill_resume_dp_opt"]["resumed_from_step"] == 0
    # The run's rank 0 file: weights and AdamW moments at the shapes the rank holds, counters, nothing else.
    size = report["checkpoint_size_dp8_opt"]
    assert size["status"] == "PASS" and size["rank_shapes_checked"] and size["not_needed_bytes_by_prefix"] == {}
    assert size["needed_bytes"] <= size["file_bytes"] <= size["needed_bytes"] * 1.01 + (1 << 20)
    assert report["checkpoint_size_startup_llama2_7b_8dev"]["status"] == "FAIL"  # no run directory: no checkpoint
    # Data parallel: every rank computes the loss, and rank 0 logged the mean of their own losses.
    assert report["pipeline_logged_loss"]["status"] == "PASS"
    assert report["pipeline_logged_loss"]["last_stage_ranks"] == [0, 1]
    table = (out / "acceptance.md").read_text().splitlines()
    assert table[2] == "| check | verdict | figures |" and len(table) == 4 + len(results)
    assert "| resume_dp2_tp4_from_dp2_tp2_pp2 | FAIL |" in "\n".join(table)


def test_the_kit_fails_a_run_that_logs_zero_losses(dp2_run, tmp_path):
    """A run whose rank 0 logged 0 (the loss of a rank that computes none) fails, however well it agrees."""
    from ascend_llm_recipes.training.tools import acceptance

    run, _ = dp2_run
    zeroed = str(tmp_path / "zeroed")
    shutil.copytree(run, zeroed)
    path = os.path.join(zeroed, "metrics.jsonl")
    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({**r, "loss": 0.0} if r["step"] > 3 and "val_loss" not in r else r) + "\n"
                     for r in records)
    losses = acceptance.logged_losses(zeroed)
    assert len(losses) == DP_STEPS and losses[4] == 0.0  # kept, not dropped
    result = acceptance.compare(losses, losses, 0.0)
    assert result["status"] == "FAIL" and result["zero_or_non_finite_loss_steps"] == list(range(4, DP_STEPS + 1))
    pipeline = acceptance.pipeline_loss_result(zeroed)
    assert pipeline["status"] == "FAIL" and pipeline["zero_or_non_finite_loss_steps"][0] == 4


def test_the_relayout_launch_hands_mindformers_the_checkpoints_strategy(dp2_run, tmp_path, monkeypatch):
    """After the launcher's checks, the step keeps its layout, and only that launch's config asks MindFormers to
    re-slice (auto_trans_ckpt with src_strategy_path_or_dir as transform_checkpoint.py wants it)."""
    from ascend_llm_recipes.training.launcher.resume import saved_recipe
    from ascend_llm_recipes.training.tools.relayout import keep_source_strategy
    from ascend_llm_recipes.training.worker.train import mindformers_config

    run = as_tp2(dp2_run[0], tmp_path)  # a copy recorded as a semi-auto DP1 x TP2 run's, resumed at semi-auto DP2
    previous = saved_recipe(run)
    step_dir = os.path.join(run, "checkpoints", f"step_{DP_STEPS:08d}")
    recipe = load_recipe(os.path.join(run, "recipe.yaml"), ["auto_trans_ckpt=True", "parallel_config.data_parallel=2",
                                                            "parallel_config.model_parallel=1",
                                                            "runner_config.batch_size=2"], planning=True)
    recipe.load_checkpoint, recipe.resume_training = step_dir, True
    keep_source_strategy(previous, recipe, run, step_dir)
    assert json.load(open(os.path.join(step_dir, "layout.json"))) == {"data_parallel": 1, "model_parallel": 2,
                                                                      "pipeline_stage": 1, "semi_auto": True}
    monkeypatch.setenv("RANK_ID", "1")
    config = mindformers_config(recipe, run)
    assert config["auto_trans_ckpt"] is True
    # Without pipeline stages any one rank's file is the source strategy (transform_checkpoint.py:163-174).
    assert config["src_strategy_path_or_dir"] == os.path.join(step_dir, "strategy", "ckpt_strategy_rank_0.ckpt")
    assert config["parallel"]["strategy_ckpt_save_file"].endswith("/strategy/ckpt_strategy_rank_1.ckpt")
    # The next launch at the same layout resumes its own newer checkpoint: nothing to re-slice.
    recipe.load_checkpoint = os.path.join(run, "checkpoints", "step_00000009")
    assert mindformers_config(recipe, run)["auto_trans_ckpt"] is False


def test_a_semi_auto_runs_checkpoints_are_not_held_to_whole_model_shapes(dp2_run, tmp_path):
    """A semi-auto rank saves its slice or stage: resume and verify_checkpoint must not set its steps aside by shape."""
    from ascend_llm_recipes.models.shapes import parameter_shapes
    from ascend_llm_recipes.training.checkpoint import rank_shapes, scan_steps
    from ascend_llm_recipes.training.launcher.resume import saved_recipe

    run, _ = dp2_run
    previous = saved_recipe(run)
    assert rank_shapes(previous).whole == parameter_shapes(previous.model.model_config, 1)  # data parallel: whole
    assert rank_shapes(previous).optimizer_shard == 1
    tp_run = as_tp2(run, tmp_path)
    tp_previous = saved_recipe(tp_run)
    assert rank_shapes(tp_previous) is None
    (step, _), invalid = scan_steps(tp_run, rank_shapes(tp_previous))
    assert step == DP_STEPS and not invalid
