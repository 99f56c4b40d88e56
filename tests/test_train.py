"""Training through MindFormers' Trainer, launched like a user does, on real data in graph mode."""

import glob
import json
import math
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, TINY_RECIPE
from make_golden_losses import GOLDEN, corpus_sha256
from ascend_llm_recipes.training.launcher.cli import launch

# Absolute, per step. Changes of rounding order measured on this machine (oneDNN's kernels restricted to
# SSE4.1 with ONEDNN_MAX_CPU_ISA, the gradient summed over 2 data-parallel ranks, OMP_NUM_THREADS=1,
# recompute) moved no loss by more than 4.8e-7 (one float32 ulp at loss ~5) over the 20 steps, and the
# difference did not grow with the steps; another CPU's vector units (AVX-512) change rounding the same
# way. Real changes move the curve far more: learning rate +1% by up to 5.6e-3, another seed by up to 0.43.
# 1e-4 sits 200x above the one and 50x below the other.
GOLDEN_TOLERANCE = 1e-4
GOLDEN_LOSSES = GOLDEN["recipes/tiny_cpu.yaml"]


def read_metrics(run_dir, held_out=False):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if ("val_loss" in r) == held_out]


def run_tiny(tmp_path_factory, tiny_dataset, name, *extra):
    run_dir = str(tmp_path_factory.mktemp("runs") / name)
    code = launch(TINY_RECIPE, [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                                *extra], show_progress=False)
    assert code == 0
    return run_dir


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


def assert_golden_curve(losses: list, golden_path: str) -> None:
    """The run's losses are the curve pinned in golden_path, step by step within GOLDEN_TOLERANCE."""
    with open(golden_path, encoding="utf-8") as f:
        golden = json.load(f)
    # The corpus is shipped (tests/data/tiny_corpus): the same training data everywhere, so the test never skips.
    assert corpus_sha256(golden["corpus_documents"]) == golden["corpus_sha256"], (
        f"{golden['corpus']} is not the corpus the golden curve was trained on: regenerate with {golden['command']}")
    assert len(losses) == len(golden["losses"]) == 20
    # GOLDEN_TOLERANCE: see its comment; a failure prints every step's difference.
    differences = [round(a - b, 7) for a, b in zip(losses, golden["losses"])]
    assert max(map(abs, differences)) <= GOLDEN_TOLERANCE, (
        f"losses moved from {golden_path} (made on {golden['cpu']}, mindspore {golden['mindspore']}): "
        f"per-step differences {differences}; if the change is intended, regenerate with {golden['command']}")


def test_first_20_losses_are_the_golden_curve(tiny_run):
    """The tiny recipe's losses, pinned: a change to the model, data order, optimizer or schedule moves them."""
    assert_golden_curve([r["loss"] for r in read_metrics(tiny_run[0])], GOLDEN_LOSSES)


def test_tiny_moe_recipe_learns_and_its_losses_are_the_golden_curve(tiny_moe_run):
    """recipes/tiny_moe_cpu.yaml as shipped (a router, 4 experts, the router terms in the loss), pinned like tiny's:
    a change to the routing, the experts' combine or the router losses moves the curve."""
    run_dir = tiny_moe_run
    records = read_metrics(run_dir)
    losses = [r["loss"] for r in records]
    assert losses[0] == pytest.approx(6.24 + 0.01, abs=0.1)  # ln(512), plus the load-balancing term's ~0.01
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert all(r["graph_mode"] for r in records)
    for r in records:  # the recipe's coefficients weight the router terms the run records (router_stats.py)
        assert r["loss"] == pytest.approx(r["lm_loss"] + 0.01 * r["load_balancing_loss"] + 0.001 * r["router_z_loss"],
                                          rel=1e-6)
        assert 0.99 < r["load_balancing_loss"] < 1.5  # near an even load (1.0); all on 2 experts would be ~2
    assert_golden_curve(losses, GOLDEN["recipes/tiny_moe_cpu.yaml"])


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


def test_metrics_lines_have_every_field_with_plausible_values(tiny_run):
    records = read_metrics(tiny_run[0])
    fields = {"step", "loss", "lr", "grad_norm", "loss_scale", "step_time", "iteration_gap", "data_wait",
              "tokens_per_s", "tokens_per_s_per_device", "mfu", "host_memory", "device_memory", "compile", "time"}
    assert all(fields <= set(r) for r in records)
    assert records[0]["compile"] and not any(r["compile"] for r in records[1:])
    steady = records[1:]
    assert records[0]["step_time"] > 5 * max(r["step_time"] for r in steady)  # compile reported on its own
    for r in steady:
        assert 0 <= r["data_wait"] < 1 and r["iteration_gap"] >= 0
        assert r["tokens_per_s"] == pytest.approx(256 / (r["step_time"] + r["iteration_gap"]), rel=1e-3)
        assert r["tokens_per_s_per_device"] == r["tokens_per_s"]
        assert 0 < r["mfu"] < 1  # against the GEMM peak measured at start-up
        assert 100e6 < r["host_memory"] < 8e9 and r["device_memory"] is None  # CPU: no device memory
        assert r["loss_scale"] == 1.0
    with open(os.path.join(tiny_run[0], "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["compile_time"] > 1 and 0 < summary["mfu"] < 1 and 0 <= summary["data_wait"] < 1


def test_held_out_loss_at_the_configured_interval(tiny_run):
    held_out = read_metrics(tiny_run[0], held_out=True)
    assert [r["step"] for r in held_out] == [6, 12, 18, 20]
    assert all(r["val_batches"] == 4 and r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) for r in held_out)
    assert held_out[-1]["val_loss"] < held_out[0]["val_loss"]


def test_tensorboard_and_heartbeat_written(tiny_run):
    run_dir = tiny_run[0]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(os.path.join(run_dir, "tensorboard")))
    with open(os.path.join(run_dir, "heartbeat", "rank_0.json"), encoding="utf-8") as f:
        beat = json.load(f)
    assert beat["phase"] == "done" and beat["step"] == 20


def test_profiler_window_writes_a_trace(tiny_run):
    traces = glob.glob(os.path.join(tiny_run[0], "profile", "rank_0", "**", "trace_view.json"), recursive=True)
    assert traces and os.path.getsize(traces[0]) > 100
    with open(os.path.join(tiny_run[0], "logs", "worker_0.log"), encoding="utf-8") as f:
        assert "[profile] steps 3-4 traced: " in f.read()


def lines(ax) -> dict:
    """A panel's plotted lines by label."""
    return {line.get_label(): line for line in ax.get_lines()}


def test_dashboard_of_a_run(tiny_run, tmp_path):
    """Loss (raw, EMA, held-out), LR, gradient norm with the clip, throughput and data wait, from a real run."""
    from ascend_llm_recipes.training.tools.plots import PANELS, dashboard, read_run

    run_dir = tiny_run[0]
    train, held_out = read_metrics(run_dir), read_metrics(run_dir, held_out=True)
    fig = dashboard([read_run(run_dir)])
    panels = {ax.get_label(): ax for ax in fig.axes}
    assert set(panels) == set(PANELS)
    loss = lines(panels["loss"])
    assert list(loss["baseline: train loss"].get_xdata()) == list(range(1, 21))
    assert list(loss["baseline: train loss"].get_ydata()) == [r["loss"] for r in train]
    # The smoothing is an exponential moving average over 5 steps (a twentieth of the run, at least 5), bias
    # corrected: each point is the beta-weighted mean of the losses so far, beta = 1 - 2 / (5 + 1).
    beta = 2 / 3
    losses = [r["loss"] for r in train]
    want = [sum(beta ** (n - i) * x for i, x in enumerate(losses[:n + 1])) / sum(beta ** k for k in range(n + 1))
            for n in range(len(losses))]
    assert list(loss["baseline: train loss EMA"].get_ydata()) == pytest.approx(want, rel=1e-12)
    assert "EMA over 5 steps" in panels["loss"].get_title(loc="left")
    assert list(loss["baseline: held-out loss"].get_xdata()) == [6, 12, 18, 20]
    assert list(loss["baseline: held-out loss"].get_ydata()) == [r["val_loss"] for r in held_out]
    assert {"train loss, per step", "train loss, EMA", "held-out loss"} == \
        {t.get_text() for t in panels["loss"].get_legend().get_texts()}
    assert list(lines(panels["learning rate"])["baseline: learning rate"].get_ydata()) == [r["lr"] for r in train]
    grad = lines(panels["gradient norm"])
    assert list(grad["baseline: gradient norm"].get_ydata()) == [r["grad_norm"] for r in train]
    assert list(grad["baseline: clip 1"].get_ydata()) == [1.0, 1.0]  # runner_wrapper.max_grad_norm
    # The first step compiles the graph: no throughput or data-wait point for it.
    speed = lines(panels["throughput"])["baseline: tokens_per_s"]
    assert list(speed.get_xdata()) == list(range(2, 21))
    assert list(speed.get_ydata()) == [r["tokens_per_s"] for r in train[1:]]
    assert panels["throughput"].child_axes[0].get_ylabel() == "MFU (%)"
    wait = lines(panels["data wait"])["baseline: data_wait"]
    assert list(wait.get_ydata()) == pytest.approx([100 * r["data_wait"] for r in train[1:]])
    assert all(ax.get_xlabel() == "step" for ax in fig.axes)
    legend = fig.legends[0]
    assert legend.get_title().get_text() == "Training dashboard: baseline"
    summary = legend.get_texts()[0].get_text()
    assert summary.startswith(f"baseline: 20 steps (5,120 tokens), loss {train[0]['loss']:.3f} → {want[-1]:.3f} "
                              f"(EMA), held-out {held_out[-1]['val_loss']:.3f} at step 20, ")
    assert "rollback" not in summary and "spike" not in summary

    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts", "plot_run.py"), run_dir,
                             "--output", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "dashboard.png")
    with open(tmp_path / "dashboard.png", "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")) == (1600, 950)  # width, height


@pytest.mark.drill
def test_deepseek_recipe_resumes_bit_exact_with_its_correction_bias(tmp_path, tiny_dataset, capfd):
    """recipes/tiny_deepseek_cpu.yaml (MLA, sigmoid group-limited router, shared expert): 8 steps in one launch
    equal 4 steps, then a resume to 8, exactly: the correction bias each step moves (auxiliary-loss-free balancing)
    is saved with the checkpoint and restored, or the resumed routing would differ."""
    from ascend_llm_recipes.models.conversion.formats import CkptFile

    recipe = os.path.join(REPO_ROOT, "recipes", "tiny_deepseek_cpu.yaml")
    common = [f"train_dataset.data_loader.dataset_dir={tiny_dataset}", "callbacks.1.save_checkpoint_steps=4",
              "lr_schedule.total_steps=8"]
    whole, halves = str(tmp_path / "whole"), str(tmp_path / "halves")
    assert launch(recipe, [f"output_dir={whole}", "runner_config.stop_step=8", *common], show_progress=False) == 0
    assert launch(recipe, [f"output_dir={halves}", "runner_config.stop_step=4", *common], show_progress=False) == 0
    capfd.readouterr()
    assert launch(recipe, [f"output_dir={halves}", "runner_config.stop_step=8", *common], show_progress=False,
                  amend=True) == 0
    out = capfd.readouterr().out
    # resumed from its step-4 save (the correction bias has no AdamW moments; the MoE counters are no weights)
    assert f"[launch] resuming {halves} from step 4 " in out, out
    assert not os.path.exists(os.path.join(halves, "checkpoints", "invalid"))
    keys = ("loss", "lm_loss", "load_balancing_loss", "expert_load", "grad_norm")
    first, resumed = read_metrics(whole), read_metrics(halves)
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in first]

    def bias(run_dir):
        path = glob.glob(os.path.join(run_dir, "checkpoints", "step_00000008", "rank_0", "*.ckpt"))[0]
        return CkptFile(path).read("model.layers.1.mlp.router.expert_bias")

    assert bias(whole).tolist() == bias(halves).tolist() and any(bias(whole))  # it moved, and identically


def test_a_moe_run_resumes_with_its_router_terms_amended_not_as_another_model(tiny_moe_run, tiny_dataset, tmp_path):
    """The MoE loss coefficients and the capacity weigh training, not the model: changing them is a setting change
    (--amend), while a change of the model itself still refuses the run."""
    import shutil

    from conftest import MOE_RECIPE
    from ascend_llm_recipes.common.errors import LaunchError
    from ascend_llm_recipes.training.launcher.resume import prepare_run_dir
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    run_dir = str(tmp_path / "moe")
    shutil.copytree(tiny_moe_run, run_dir)
    settings = [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                "runner_config.stop_step=24"]

    def recipe(*changes):
        return load_recipe(MOE_RECIPE, (*settings, *changes))

    terms = ("model.model_config.router_aux_loss_coef=0.05", "model.model_config.capacity_factor=1.5")
    with pytest.raises(LaunchError, match=r"trained with other settings; this launch changes "
                                          r"model\.model_config\.router_aux_loss_coef \(0\.01 -> 0\.05\)"):
        prepare_run_dir(recipe(*terms), MOE_RECIPE)
    with pytest.raises(LaunchError, match=r"another model \(changed: model\.model_config\.moe_intermediate_size\)"):
        prepare_run_dir(recipe(*terms, "model.model_config.moe_intermediate_size=32"), MOE_RECIPE, amend=True)
    amended = recipe(*terms)
    prepare_run_dir(amended, MOE_RECIPE, amend=True)
    assert amended.load_checkpoint.endswith("step_00000020")
    with open(os.path.join(run_dir, "amendments.jsonl"), encoding="utf-8") as f:
        keys = [json.loads(line)["key"] for line in f]
    assert {"model.model_config.router_aux_loss_coef", "model.model_config.capacity_factor"} <= set(keys)
