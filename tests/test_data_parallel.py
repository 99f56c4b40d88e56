"""Data parallel executes for real: two msrun worker processes match one process at the same global batch."""

import json
import os
import re
import shutil

import numpy as np
import pytest

from conftest import DP2_RECIPE, DP_SAVE_STEPS, DP_STEPS as STEPS, MOE_RECIPE, TINY_RECIPE, data_parallel_settings
from ascend_llm_recipes.training.launcher.cli import launch


def losses(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["loss"] for line in f]


def final_weights(run_dir, rank):
    import glob
    import mindspore as ms
    ckpt = glob.glob(os.path.join(run_dir, "**", f"rank_{rank}", f"*_{STEPS}.ckpt"), recursive=True)[0]
    params = ms.load_checkpoint(ckpt)
    return {k: v.asnumpy() for k, v in params.items() if not k.startswith(("adam_", "global_step", "scale_sense",
                                                                           "current_iterator_step", "epoch_num",
                                                                           "step_num", "loss_scale"))}


@pytest.fixture(scope="module")
def runs(data_parallel_runs):
    return data_parallel_runs


def interrupted_copy(run_dir, copy):
    """COPY: a copy of a data_parallel_runs run as its job leaves it when killed right after its step-4 save.

    The run saved at steps 4 and 8 (DP_SAVE_STEPS): what its steps after the step-4 save wrote is taken away (the
    newer checkpoint, every rank's per-step records after step 4, the end-of-run summary, the ranks' final status
    and heartbeat, which every resume removes anyway). What a resume reads is then the run's own: its recipe.yaml
    (whose sha256 the step-4 state.json records), its step-4 checkpoint, its data position and metrics up to
    step 4. The copy is a run directory moved as a user may move one (output_dir is not a setting a resume
    compares).
    """
    shutil.copytree(run_dir, copy)
    checkpoints = os.path.join(copy, "checkpoints")
    assert sorted(os.listdir(checkpoints)) == [f"step_{DP_SAVE_STEPS:08d}", f"step_{STEPS:08d}"]
    shutil.rmtree(os.path.join(checkpoints, f"step_{STEPS:08d}"))
    for name in os.listdir(copy):
        if name.startswith("metrics") and name.endswith(".jsonl"):
            kept = [r for r in records(os.path.join(copy, name)) if r["step"] <= DP_SAVE_STEPS]
            with open(os.path.join(copy, name), "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
    os.remove(os.path.join(copy, "summary.json"))
    for stale in ("status", "heartbeat"):
        shutil.rmtree(os.path.join(copy, stale))


def records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_dp2_loss_trajectory_matches_dp1(runs):
    one, two = runs
    single = losses(os.path.join(one, "metrics.jsonl"))
    # The run's loss is the global mean (all ranks); each rank's own half-batch loss stays in rank_loss.
    run = records(os.path.join(two, "metrics.jsonl"))
    other = records(os.path.join(two, "metrics_rank_1.jsonl"))
    assert len(single) == len(run) == len(other) == STEPS
    assert np.allclose([r["loss"] for r in run], single, rtol=2e-5, atol=2e-5)
    assert [r["loss"] for r in other] == [r["loss"] for r in run]  # every rank records (and acts on) the same
    rank0, rank1 = np.array([r["rank_loss"] for r in run]), np.array([r["rank_loss"] for r in other])
    assert np.allclose((rank0 + rank1) / 2, [r["loss"] for r in run], rtol=1e-6, atol=1e-6)
    assert not np.allclose(rank0, rank1)  # the ranks really saw different samples
    with open(os.path.join(two, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert (summary["first_loss"], summary["last_loss"]) == (run[0]["loss"], run[-1]["loss"])


# tiny_dp2_cpu.yaml's layout over tiny_cpu.yaml: two processes of half the batch, the same global batch of 4
DP2_LAYOUT = ("use_parallel=True", "runner_config.batch_size=2", "hardware.devices_per_node=2",
              "parallel_config.data_parallel=2")


@pytest.mark.drill
def test_moe_dp2_matches_one_process_losses_and_router_statistics(tiny_moe_run, tiny_dataset, tmp_path):
    """tiny_moe_cpu.yaml as two data-parallel processes at the same global batch: the losses and the recorded
    load-balancing loss, z-loss and expert load are one process's, step by step. The balancing loss counts the
    routing of the global batch (models/moe.py): per-rank counts gave another loss (1.0083 for 1.0018 at step 1)
    and a trajectory that drifted by 3.6e-4 in 20 steps."""
    two = str(tmp_path / "moe_dp2")
    assert launch(MOE_RECIPE, [f"output_dir={two}", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                               *DP2_LAYOUT], show_progress=False) == 0
    single = records(os.path.join(tiny_moe_run, "metrics.jsonl"))
    run, other = (records(os.path.join(two, name)) for name in ("metrics.jsonl", "metrics_rank_1.jsonl"))
    assert len(run) == len(single) == 20
    for key in ("loss", "lm_loss", "load_balancing_loss", "router_z_loss"):
        assert np.allclose([r[key] for r in run], [r[key] for r in single], rtol=2e-5, atol=2e-5), key
    assert [r["expert_load"] for r in run] == [r["expert_load"] for r in single]  # the same routing, every step
    assert [r["load_balancing_loss"] for r in other] == [r["load_balancing_loss"] for r in run]
    assert not np.allclose([r["rank_loss"] for r in run], [r["rank_loss"] for r in other])  # different halves


def test_dp2_ranks_end_with_identical_weights(runs):
    _, two = runs
    a, b = final_weights(two, 0), final_weights(two, 1)
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_dp2_weights_match_dp1(runs):
    one, two = runs
    a, b = final_weights(one, 0), final_weights(two, 0)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_dp2_console_shows_each_step_once_on_a_whole_line(runs):
    """What the launcher echoed (msrun's output): one rank's `[step N]` lines per node, never two on one line."""
    _, two = runs
    with open(os.path.join(two, "logs", "msrun.log"), encoding="utf-8", errors="replace") as f:
        lines = [line for line in f.read().splitlines() if "[step " in line]
    pattern = r"\[step (\d+)\] loss [\d.]+ lr \S+ grad_norm \S+ step \d+ ms .* MFU \S+( \[includes graph compile\])?"
    assert [int(re.fullmatch(pattern, line).group(1)) for line in lines] == list(range(1, STEPS + 1)), lines


def test_a_one_process_cpu_run_starts_its_worker_without_msrun_and_data_parallel_through_it(runs):
    """One CPU worker: the launcher starts scripts/train.py itself, without msrun and its scheduler (two more
    processes importing MindSpore, ~8 CPU-s a launch); two workers still run under msrun."""
    one, two = runs  # the tiny recipe as one process and as two (tiny_dp2_cpu.yaml)
    assert sorted(os.listdir(os.path.join(one, "logs"))) == ["worker_0.log"]
    with open(os.path.join(one, "logs", "worker_0.log"), encoding="utf-8", errors="replace") as f:
        log = f.read()
    assert "[step 1] loss" in log and "BuildCluster" not in log  # trained, and joined no cluster (no MS_ROLE)
    assert sorted(os.listdir(os.path.join(two, "logs"))) == ["msrun.log", "scheduler.log", "worker_0.log",
                                                             "worker_1.log"]


def test_collective_self_test_ran_on_every_rank(runs):
    _, two = runs
    for rank in (0, 1):
        with open(os.path.join(two, "logs", f"worker_{rank}.log"), encoding="utf-8") as f:
            assert f"[rank {rank}] collective self-test passed: all-reduce over 2 ranks = 3" in f.read()


@pytest.mark.parametrize("saved_at, resumed_at", [(DP2_RECIPE, TINY_RECIPE), (TINY_RECIPE, DP2_RECIPE)],
                         ids=["dp2_then_dp1", "dp1_then_dp2"])
def test_resume_at_another_data_parallel_degree_continues_the_dp1_trajectory(runs, tiny_dataset, tmp_path, capsys,
                                                                             saved_at, resumed_at):
    """Save at one data-parallel degree, resume at the other (same global batch): the DP1 trajectory continues.

    A step saved by fewer ranks than the new world size is complete (every rank it was saved by wrote its
    manifest): the new ranks resume from rank 0's file, none of it is set aside, nothing retrains from step 0.
    """
    one, two = runs
    run_dir = str(tmp_path / "run")
    interrupted_copy(two if saved_at == DP2_RECIPE else one, run_dir)
    capsys.readouterr()
    # Another layout: accepted as a recorded amendment (the global batch stays 4).
    assert launch(resumed_at, data_parallel_settings(run_dir, tiny_dataset), show_progress=False, amend=True) == 0
    out = capsys.readouterr().out
    assert f"resuming {run_dir} from step 4" in out and "skipping invalid checkpoint" not in out, out
    assert not os.path.exists(os.path.join(run_dir, "checkpoints", "invalid"))
    with open(os.path.join(run_dir, "amendments.jsonl"), encoding="utf-8") as f:
        changed = {a["key"]: (a["step"], a["old"], a["new"]) for a in map(json.loads, f)}
    dp = (2, 1) if saved_at == DP2_RECIPE else (1, 2)
    assert changed["parallel_config.data_parallel"] == (4, *dp)
    assert changed["runner_config.batch_size"] == (4, 4 // dp[0], 4 // dp[1])
    single = losses(os.path.join(one, "metrics.jsonl"))
    run = records(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in run] == list(range(1, STEPS + 1))
    assert np.allclose([r["loss"] for r in run[4:]], single[4:], rtol=2e-5, atol=2e-5)
    if resumed_at == DP2_RECIPE:  # the new rank 1 resumed too: same steps, same global loss
        other = records(os.path.join(run_dir, "metrics_rank_1.jsonl"))
        assert [r["step"] for r in other] == list(range(5, STEPS + 1))
        assert [r["loss"] for r in other] == [r["loss"] for r in run[4:]]


def test_dp2_run_interrupted_after_a_save_resumes_bitwise_on_both_ranks(runs, tiny_dataset, tmp_path):
    """The same command run again continues a DP2 run killed after its step-4 save (a copy of the shared run cut
    back to that save); both ranks' per-step losses equal the uninterrupted run's."""
    _, two = runs
    run_dir = str(tmp_path / "dp2_interrupted")
    interrupted_copy(two, run_dir)
    assert launch(DP2_RECIPE, data_parallel_settings(run_dir, tiny_dataset), show_progress=False) == 0
    for name in ("metrics.jsonl", "metrics_rank_1.jsonl"):
        assert losses(os.path.join(run_dir, name)) == losses(os.path.join(two, name))


def test_one_host_all_reduce_per_step_carries_loss_and_stop(tiny_dataset, tmp_path, monkeypatch, request):
    """StepRecorder agrees the global loss and a stop request in one all-reduce; monitor and checkpointer read it."""
    import mindspore as ms
    from mindspore.train.callback import RunContext, _InternalCallbackParam
    from ascend_llm_recipes.training.worker import collectives
    from ascend_llm_recipes.training.worker.anomaly import AnomalyMonitor
    from ascend_llm_recipes.training.worker.callbacks import StepRecord
    from ascend_llm_recipes.training.worker.checkpointer import Checkpointer
    from ascend_llm_recipes.training.rank_status import Heartbeat
    from ascend_llm_recipes.training.recipe.loading import load_recipe
    from ascend_llm_recipes.training.run_files import RESOLVED_RECIPE
    from ascend_llm_recipes.training.worker.train import build_callbacks

    recipe = load_recipe(DP2_RECIPE, (f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                                      f"output_dir={tmp_path}"))
    with open(tmp_path / RESOLVED_RECIPE, "w", encoding="utf-8") as f:
        f.write(recipe.to_yaml())
    heartbeat = Heartbeat(str(tmp_path), 0)
    recorder, checkpointer, monitor, callbacks = build_callbacks(recipe, str(tmp_path), heartbeat, 0)
    assert callbacks.index(monitor) < callbacks.index(checkpointer)  # the monitor decides before a save
    calls = []

    def other_rank_asks_to_stop(values):  # this rank's values plus the other rank's: loss 3.0, stop requested
        calls.append(list(values))
        return np.asarray(values, np.float32) + np.asarray([3.0, 1.0, 1.0, 0.0], np.float32)

    monkeypatch.setattr(collectives, "all_reduce_sum", other_rank_asks_to_stop)
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)  # as the worker runs (StepRecorder refuses PyNative)
    request.addfinalizer(lambda: ms.set_context(mode=mode))
    one = ms.Tensor(1.0, ms.float32)
    params = _InternalCallbackParam()
    params.net_outputs = (ms.Tensor(2.0, ms.float32), ms.Tensor(False), one, one, one)
    context = RunContext(params)
    recorder.on_train_begin(context)
    recorder.on_train_step_begin(context)
    recorder.on_train_step_end(context)
    saved = []
    monkeypatch.setattr(Checkpointer, "save", lambda self, params, step, kind="step": saved.append(step))
    for callback in (monitor, checkpointer):
        callback.on_train_step_end(context)
    # One all-reduce for the step: [this rank's loss, it computes one, its stop request, a non-finite value].
    assert calls == [[2.0, 1.0, 0.0, 0.0]]
    assert recorder.last == StepRecord(step=1, loss=2.5, lr=1.0, grad_norm=1.0, loss_scale=1.0, overflow=False,
                                       stop=True, rank_loss=2.0)
    assert saved == [1] and checkpointer.preempted and context.get_stop_requested()
    assert isinstance(monitor, AnomalyMonitor)
    recorder.close()
