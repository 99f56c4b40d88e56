"""Training through MindFormers' Trainer, launched like a user does, on real data in graph mode."""

import json
import os

import pytest

from conftest import TINY_RECIPE
from training.launch import launch


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def run_tiny(tmp_path_factory, tiny_dataset, name, *extra):
    run_dir = str(tmp_path_factory.mktemp("runs") / name)
    code = launch(TINY_RECIPE, [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                                *extra], show_progress=False)
    assert code == 0
    return run_dir


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_dataset):
    """One real 20-step run of the tiny recipe (cwd set to an empty directory)."""
    cwd = tmp_path_factory.mktemp("cwd")
    old = os.getcwd()
    os.chdir(cwd)
    try:
        run_dir = run_tiny(tmp_path_factory, tiny_dataset, "baseline")
    finally:
        os.chdir(old)
    return run_dir, str(cwd)


def test_tiny_recipe_trains_and_loss_decreases(tiny_run):
    run_dir, _ = tiny_run
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 21))
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert first == pytest.approx(6.24, abs=0.1)  # ln(512): an untrained model guesses uniformly
    assert last < first - 1.0
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in records)
    assert records[0]["lr"] < records[2]["lr"]  # two warm-up steps, then cosine decay
    assert records[-1]["lr"] < records[2]["lr"]


def test_training_ran_in_graph_mode_throughout(tiny_run):
    run_dir, _ = tiny_run
    assert all(r["graph_mode"] for r in read_metrics(run_dir))
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        assert json.load(f)["graph_mode"] is True


def test_run_directory_holds_everything_and_cwd_stays_clean(tiny_run):
    run_dir, cwd = tiny_run
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["steps"] == 20 and summary["tokens"] == 20 * 4 * 64
    assert summary["checkpoint"].startswith(run_dir) and summary["checkpoint"].endswith("_20.ckpt")
    assert os.path.getsize(summary["checkpoint"]) > 0
    assert os.path.isfile(os.path.join(run_dir, "recipe.yaml"))
    assert os.path.isfile(os.path.join(run_dir, "logs", "worker_0.log"))
    assert os.listdir(cwd) == []  # MindFormers' ./output went into the run directory


def test_checkpoint_holds_weights_and_optimizer_state(tiny_run):
    import mindspore as ms
    run_dir, _ = tiny_run
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        params = ms.load_checkpoint(json.load(f)["checkpoint"])
    assert params["model.layers.1.mlp.down_proj.weight"].shape == (64, 176)
    assert "adam_m.model.embed_tokens.weight" in params and "adam_v.lm_head.weight" in params
    assert int(params["global_step"].asnumpy()) == 20


def test_recompute_changes_memory_not_math(tmp_path_factory, tiny_dataset, tiny_run):
    baseline = read_metrics(tiny_run[0])[:6]
    run_dir = run_tiny(tmp_path_factory, tiny_dataset, "recompute", "recompute_config.recompute=True",
                       "runner_config.stop_step=6", "lr_schedule.total_steps=20")
    recomputed = read_metrics(run_dir)
    assert [r["loss"] for r in recomputed] == pytest.approx([r["loss"] for r in baseline], rel=1e-5)
