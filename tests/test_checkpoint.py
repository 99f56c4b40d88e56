"""Checkpoints: fault drills on real runs (kill -9, SIGTERM, corrupt newest), and bad input refused."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from conftest import REPO_ROOT, TINY_RECIPE, TINY_RUN_SAVES, load_script, tiny_run_extras, tiny_run_settings
from ascend_llm_recipes.training.checkpoint import (MANIFEST, newest_valid_step, read_json, step_dir, verify_step,
                                                    write_rank)
from ascend_llm_recipes.training.run_files import LOCK_FILE

LAUNCHER = os.path.join(REPO_ROOT, "scripts", "run_distributed.sh")
SAVE = [a for setting in TINY_RUN_SAVES for a in ("--set", setting)]


def command(run_dir, dataset, *extra):
    return ["bash", LAUNCHER, TINY_RECIPE, "--set", f"output_dir={run_dir}",
            "--set", f"train_dataset.data_loader.dataset_dir={dataset}", *SAVE, *extra]


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if "val_loss" not in line]


def start_and_signal(run_dir, dataset, after_steps, sig, *extra, freeze=False):
    """Launch like a user, wait until `after_steps` steps are recorded, send `sig` to the worker.

    freeze: SIGSTOP it first and return once stopped, so the test reads what it has saved before `sig` lands (a
    fast machine trains several steps between the poll and the signal).
    """
    proc = subprocess.Popen(command(run_dir, dataset, *extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    path = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.time() + 240
    while time.time() < deadline:
        if os.path.exists(path) and sum("val_loss" not in line for line in
                                        open(path, encoding="utf-8").read().splitlines()) >= after_steps:
            break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.02 if freeze else 0.1)
    worker = read_json(os.path.join(run_dir, "status", "rank_0.json"))["pid"]
    if freeze:
        os.kill(worker, signal.SIGSTOP)
        while open(f"/proc/{worker}/stat", encoding="utf-8").read().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.001)  # stopped: nothing more is saved
        saved = sorted(int(name.split("_")[1]) for name in os.listdir(os.path.join(run_dir, "checkpoints"))
                       if os.path.isfile(os.path.join(run_dir, "checkpoints", name, "rank_0", MANIFEST)))
        os.kill(worker, sig)
        output, _ = proc.communicate(timeout=180)
        return proc.returncode, output, saved
    os.kill(worker, sig)
    output, _ = proc.communicate(timeout=180)
    return proc.returncode, output


def as_baseline(dataset):
    """The --set arguments of the baseline's settings beyond SAVE (conftest.tiny_run_extras): a launch on the
    baseline, or on a copy of it, passes them to change nothing else."""
    return [a for setting in tiny_run_extras(dataset) for a in ("--set", setting)]


def append_torn_line(path, text):
    """Append `text`, a line torn by a crash (no newline), to the metrics file PATH; returns its line number
    (after the training and the held-out records)."""
    with open(path, "a+", encoding="utf-8") as f:
        f.seek(0)
        line = len(f.readlines()) + 1
        f.write(text)
    return line


def rerun(run_dir, dataset, *extra):
    result = subprocess.run(command(run_dir, dataset, *extra), capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout + result.stderr


def refusal(run_dir, dataset, *extra):
    """What a launch with these `--set` settings is refused with (the CLI prints it and exits 2), launched in this
    process: a refusal comes before any job process, so a launcher process of its own would only add its start-up."""
    from ascend_llm_recipes.common.errors import LaunchError
    from ascend_llm_recipes.training.launcher.cli import launch

    settings = [a for a in command(run_dir, dataset, *extra)[3:] if a != "--set"]
    with pytest.raises(LaunchError) as refused:
        launch(TINY_RECIPE, settings, show_progress=False)
    return str(refused.value)


@pytest.fixture
def baseline(tiny_run):
    """The uninterrupted run: the shared tiny run (conftest.py), 20 steps saved every 5 (SAVE), the newest 3 kept."""
    return tiny_run[0]


def same_trajectory(run_dir, baseline_dir):
    got, want = metrics(run_dir), metrics(baseline_dir)
    assert [r["step"] for r in got] == list(range(1, 21))  # every step recorded exactly once
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # bitwise on CPU
    assert [r["lr"] for r in got] == [r["lr"] for r in want]


def test_layout_manifest_and_pruning(baseline):
    steps = sorted(os.listdir(os.path.join(baseline, "checkpoints")))
    assert steps == ["step_00000010", "step_00000015", "step_00000020"]  # keep_checkpoint_max 3
    manifest = read_json(os.path.join(baseline, "checkpoints", "step_00000020", "rank_0", MANIFEST))
    assert manifest["step"] == 20 and len(manifest["sha256"]) == 64
    tensors = manifest["tensors"]
    assert tensors["model.embed_tokens.weight"]["shape"] == [512, 64]
    assert "adam_m.lm_head.weight" in tensors and "global_step" in tensors
    state = read_json(os.path.join(baseline, "checkpoints", "step_00000020", "state.json"))
    assert state["data_position"] == 20 * 4 and len(state["rng_state"]) >= 1
    assert len(state["recipe_sha256"]) == 64 and len(state["dataset_manifest_sha256"]) == 64
    # The data position carries the ids (and their hash) of the samples the next step reads.
    assert state["next_samples"]["position"] == 80 and state["next_samples"]["count"] == 4
    assert state["data_skips"] == []


def test_saved_bytes_are_the_planned_checkpoint_size(baseline):
    """What one rank wrote (its manifest's tensors) is what --plan prints as the checkpoint per rank."""
    import numpy as np
    from ascend_llm_recipes.training.tools.planner import checkpoint_bytes
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    manifest = read_json(os.path.join(baseline, "checkpoints", "step_00000020", "rank_0", MANIFEST))
    written = sum(int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize for t in manifest["tensors"].values())
    recipe = load_recipe(os.path.join(baseline, "recipe.yaml"))
    assert checkpoint_bytes(recipe) == (written, written)


def test_accumulation_buffers_are_not_saved():
    """accu_grads (wrapper.py:849, zeroed after every step) stay out of the snapshot; weights and moments stay in."""
    from mindspore import nn
    from ascend_llm_recipes.training.checkpoint import snapshot

    class WithAccumulation(nn.Cell):
        def __init__(self):
            super().__init__()
            self.net = nn.Dense(4, 4)
            self.optimizer = nn.Adam(self.net.trainable_params())
            self.accu_grads = self.optimizer.parameters.clone(prefix="accu_grads", init="zeros")

    cell = WithAccumulation()
    names = [t["name"] for t in snapshot(cell)]
    assert any(n.endswith("net.weight") for n in names) and any("moment1." in n for n in names)
    assert not [n for n in names if "accu_grads" in n]
    assert [p.name for p in cell.get_parameters() if p.name.startswith("accu_grads.")]  # they exist, unsaved


def stages_cell():
    """A Cell of two pipeline stages as this rank (stage 0) holds it after MindSpore's parallel compile.

    Built under semi_auto_parallel, an initializer's Parameter stays uninitialised (has_init,
    mindspore/common/parameter.py:394-397). The compiler initialises the parameters of this rank's graph, sliced
    (`init_data(layout, set_sliced=True)`, mindspore/parallel/_utils.py:249) and marked is_param_init (which
    serialization.py:857-862 reads); the other stage's stay as built.
    """
    import mindspore as ms
    from mindspore import nn
    from mindspore.common.initializer import initializer

    class TwoStages(nn.Cell):
        def __init__(self):
            super().__init__()
            self.first = ms.Parameter(initializer("normal", [64, 32], ms.float32), name="model.layers.0.w")
            self.second = ms.Parameter(initializer("normal", [4096, 4096], ms.float32), name="model.layers.1.w")

    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    try:
        cell = TwoStages()
    finally:
        ms.reset_auto_parallel_context()
    assert cell.first.has_init and cell.second.has_init
    cell.first = cell.first.init_data(set_sliced=True)
    cell.first.param_info.is_param_init = True
    return cell


@pytest.fixture
def graph_mode():
    """Graph mode, as training runs (MindSpore's save judges sliced parameters in graph mode only)."""
    import mindspore as ms

    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=mode)


def test_snapshot_leaves_other_stages_parameters_as_mindspore_save_does(graph_mode):
    """F1: another stage's parameter is neither materialised nor saved; the same set MindSpore's save keeps."""
    from mindspore.train.serialization import _convert_cell_param_and_names_to_dict
    from ascend_llm_recipes.training.checkpoint import snapshot

    cell = stages_cell()
    tensors = snapshot(cell)
    assert [t["name"] for t in tensors] == ["model.layers.0.w"]
    assert cell.second.has_init  # never built: asnumpy() would have made its full 64 MB here
    assert tensors.elsewhere == ["model.layers.1.w"]
    assert list(_convert_cell_param_and_names_to_dict(cell, None, True)) == ["model.layers.0.w"]


def test_a_weight_no_stage_saved_makes_the_step_invalid(graph_mode, tmp_path):
    """Each stage leaves the other's weights out; a step where no rank holds one of them is not resumable."""
    from ascend_llm_recipes.training.checkpoint import Snapshot, snapshot

    cell = stages_cell()
    directory = str(tmp_path / "step_00000001")
    meta = {"step": 1, "world_size": 2}
    write_rank(os.path.join(directory, "rank_0"), "a.ckpt", snapshot(cell), {}, {**meta, "rank": 0})
    second = [{"name": "model.layers.1.w", "data": cell.first}]  # stage 1's rank, holding its layer
    write_rank(os.path.join(directory, "rank_1"), "b.ckpt", Snapshot(second, ["model.layers.0.w"]), {},
               {**meta, "rank": 1})
    assert verify_step(directory, 2, need_optimizer=False) == []
    write_rank(os.path.join(directory, "rank_1"), "b.ckpt", Snapshot([], ["model.layers.0.w", "model.layers.1.w"]),
               {}, {**meta, "rank": 1})
    assert verify_step(directory, 2, need_optimizer=False) == [
        f"{directory}: 1 tensor(s) left by rank 0 to another pipeline stage but held by no rank (e.g. "
        "model.layers.1.w): a resume would train them from their initialisers"]


def test_resume_with_another_data_order_is_refused(baseline, tiny_dataset):
    before = metrics(baseline)
    output = refusal(baseline, tiny_dataset, *as_baseline(tiny_dataset), "--set", "seed=7")
    assert "resume from step 20: the training data order changed: after sample 80" in output
    assert "(changed: seed)" in output and "a resume must not replay or skip data" in output
    # Half the global batch divides the position (80 samples = 40 steps of 2), but would renumber the steps.
    output = refusal(baseline, tiny_dataset, *as_baseline(tiny_dataset), "--set", "runner_config.batch_size=2")
    assert ("resume from step 20: the checkpoint was trained at global batch 4 (80 samples consumed), this recipe's "
            "global batch is 2 (changed: runner_config.batch_size); changing the global batch on resume is not "
            "supported") in output
    assert metrics(baseline) == before  # refused before anything was touched


@pytest.mark.drill
def test_kill9_then_corrupt_newest_and_crash_during_save(baseline, tiny_dataset, tmp_path):
    """kill -9 mid-run; the newest complete step is corrupt and a newer save was cut short: resume falls back."""
    run_dir = str(tmp_path / "run")
    # Frozen at step 11 or later (saves every 5: 5 and 10 complete, maybe 15), then killed.
    code, _, saved = start_and_signal(run_dir, tiny_dataset, 11, signal.SIGKILL, freeze=True)
    assert code != 0
    assert saved in ([5, 10], [5, 10, 15]), saved  # stopped before its last save (step 20)
    newest, previous = saved[-1], saved[-2]
    newest_dir = os.path.join(step_dir(run_dir, newest), "rank_0")
    path = os.path.join(newest_dir, read_json(os.path.join(newest_dir, MANIFEST))["file"])
    with open(path, "r+b") as f:  # same size, different bytes
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\xde\xad\xbe\xef")
    # What a crash in the middle of saving the next step leaves: a partial file, no manifest (the kill may have
    # left one already).
    partial = os.path.join(step_dir(run_dir, newest + 5), "rank_0")
    os.makedirs(partial, exist_ok=True)
    with open(path, "rb") as f, open(os.path.join(partial, ".partial-x.ckpt"), "wb") as g:
        g.write(f.read()[:1000])
    code, output = rerun(run_dir, tiny_dataset)
    assert code == 0, output
    assert "skipping" in output and f"step_{newest + 5:08d}" in output and "incomplete save" in output
    assert "sha256 differs from manifest.json (corrupt)" in output
    assert "resuming" in output and f"from step {previous} " in output
    same_trajectory(run_dir, baseline)


@pytest.mark.drill
def test_sigterm_saves_then_resume_continues_exactly(baseline, tiny_dataset, tmp_path):
    """Also held-out evaluation every 6 steps: each launch ends (at 7+ and at 20) with its final evaluation.

    The regular saves of both launches are at step 20 only, so that the step the signal lands at (7 or later:
    under load the worker may be at a step 10 of a save every 5) can never be a regular save step.
    """
    run_dir = str(tmp_path / "run")
    held_out = ("--set", "do_eval=True", "--set", "eval_step_interval=6",
                "--set", f"eval_dataset={{data_loader: {{dataset_dir: {tiny_dataset}}}, max_batches: 2}}",
                "--set", "callbacks.1.save_checkpoint_steps=20")
    code, output = start_and_signal(run_dir, tiny_dataset, 7, signal.SIGTERM, *held_out)
    assert code == 4, output
    saved = [int(e.split("_")[1]) for e in os.listdir(os.path.join(run_dir, "checkpoints"))]
    preempted_at = max(saved)
    assert saved == [preempted_at] and 7 <= preempted_at < 20  # the one save: because of the signal
    code, output = rerun(run_dir, tiny_dataset, *held_out)
    assert code == 0 and f"from step {preempted_at}" in output, output
    same_trajectory(run_dir, baseline)
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        evals = [r["step"] for r in map(json.loads, f) if "val_loss" in r]
    assert evals == sorted({6, preempted_at, 12, 18, 20})  # each once; the last one at the final step


def files_and_bytes(directory):
    """Every file of a run directory with its mtime and bytes, but the lock (each launch takes it, then empties it)."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            if name == LOCK_FILE:
                continue
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.join(root, name)] = (os.stat(f.fileno()).st_mtime_ns, f.read())
    return found


def test_rerun_of_a_complete_run_does_nothing(baseline, tiny_dataset, capsys):
    from ascend_llm_recipes.common.errors import LaunchError
    from ascend_llm_recipes.training.launcher.cli import launch

    before = files_and_bytes(baseline)
    code, output = rerun(baseline, tiny_dataset, *as_baseline(tiny_dataset))
    assert code == 0 and "already complete (step 20" in output
    assert files_and_bytes(baseline) == before  # not even recipe.yaml or the status files rewritten
    # Other settings on a finished run: refused, naming each key, and still nothing rewritten.
    with pytest.raises(LaunchError, match=r"holds a run trained with other settings; this launch changes "
                                          r"lr_schedule.learning_rate \(0.005 -> 0.001\), "
                                          r"optimizer.weight_decay \(0.0 -> 0.1\)\n(?s:.)*pass --amend"):
        launch(TINY_RECIPE, [*tiny_run_settings(baseline, tiny_dataset), "lr_schedule.learning_rate=0.001",
                             "optimizer.weight_decay=0.1"], show_progress=False)
    assert files_and_bytes(baseline) == before
    # With --amend there is still no step for the change to apply to: said, nothing recorded or rewritten.
    assert launch(TINY_RECIPE, [*tiny_run_settings(baseline, tiny_dataset), "lr_schedule.learning_rate=0.001"],
                  show_progress=False, amend=True) == 0
    assert "--amend applies nothing and records nothing (lr_schedule.learning_rate)" in capsys.readouterr().out
    assert files_and_bytes(baseline) == before


def corrupt_bytes(step_directory):
    rank_dir = os.path.join(step_directory, "rank_0")
    path = os.path.join(rank_dir, read_json(os.path.join(rank_dir, MANIFEST))["file"])
    with open(path, "r+b") as f:  # same size, different bytes
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\xde\xad\xbe\xef")


def test_corrupt_newest_steps_are_set_aside_and_new_saves_kept(baseline, tiny_dataset, tmp_path):
    """Newest step corrupt, the one before it with a truncated state.json, metrics.jsonl torn: amended to stop at 12."""
    from scripts.verify_checkpoint import main as verify
    from ascend_llm_recipes.common.errors import LaunchError
    from ascend_llm_recipes.training.launcher.resume import prepare_run_dir
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    run_dir = str(tmp_path / "run")
    shutil.copytree(baseline, run_dir)
    corrupt_bytes(step_dir(run_dir, 20))
    state = os.path.join(step_dir(run_dir, 15), "state.json")
    with open(state, "r+b") as f:
        f.truncate(50)
    torn = append_torn_line(os.path.join(run_dir, "metrics.jsonl"), '{"step": 21, "loss": 3.1')
    assert verify([run_dir]) == 1  # what a resume would find, reported
    with pytest.raises(LaunchError, match=r"this launch changes runner_config.stop_step \(20 -> 12\)\n"):
        prepare_run_dir(load_recipe(TINY_RECIPE, (*tiny_run_settings(run_dir, tiny_dataset),
                                                  "runner_config.stop_step=12")), TINY_RECIPE)
    code, output = rerun(run_dir, tiny_dataset, *as_baseline(tiny_dataset), "--set", "runner_config.stop_step=12",
                         "--amend")
    assert code == 0, output
    assert f"{state}: unreadable (JSONDecodeError: truncated or corrupt)" in output
    assert "sha256 differs from manifest.json (corrupt)" in output and "from step 10" in output
    assert f"metrics.jsonl:{torn}: not a JSON record (torn by a crash?), dropped" in output
    assert "this run's recipe was amended" in output and "from step 10: runner_config.stop_step 20 -> 12" in output
    # The corrupt steps were moved aside with their reasons; retention kept the valid 10 and the new 12.
    root = os.path.join(run_dir, "checkpoints")
    assert sorted(os.listdir(root)) == ["invalid", "step_00000010", "step_00000012"]
    assert sorted(os.listdir(os.path.join(root, "invalid"))) == ["step_00000015", "step_00000020"]
    with open(os.path.join(root, "invalid", "step_00000015", "REASON.txt"), encoding="utf-8") as f:
        assert "state.json: unreadable" in f.read()
    assert verify_step(step_dir(run_dir, 10), 1) == [] and verify_step(step_dir(run_dir, 12), 1) == []
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 13))
    amendments = [json.loads(line) for line in open(os.path.join(run_dir, "amendments.jsonl"), encoding="utf-8")]
    assert [(a["step"], a["key"], a["old"], a["new"]) for a in amendments] == [(10, "runner_config.stop_step", 20, 12)]
    with open(os.path.join(run_dir, "recipe.yaml"), encoding="utf-8") as f:
        assert "stop_step: 12" in f.read()  # recipe.yaml describes what was trained last; the history the rest


def test_deleted_state_json_falls_back_to_the_previous_step(baseline, tiny_dataset, tmp_path):
    from ascend_llm_recipes.training.launcher.resume import prepare_run_dir
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    run_dir = str(tmp_path / "run")
    shutil.copytree(baseline, run_dir)
    os.remove(os.path.join(step_dir(run_dir, 20), "state.json"))
    recipe = load_recipe(TINY_RECIPE, tuple(tiny_run_settings(run_dir, tiny_dataset)))
    prepare_run_dir(recipe, TINY_RECIPE)
    assert recipe.load_checkpoint == step_dir(run_dir, 15)
    with open(os.path.join(run_dir, "checkpoints", "invalid", "step_00000020", "REASON.txt"), encoding="utf-8") as f:
        assert "state.json: missing (the data position of this step is unknown)" in f.read()
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 16))


def test_recipe_change_that_alters_shapes_is_refused(baseline, tiny_dataset):
    output = refusal(baseline, tiny_dataset, *as_baseline(tiny_dataset), "--set", "model.model_config.hidden_size=128")
    assert "holds a run of another model (changed: model.model_config.hidden_size)" in output


def test_truncated_file_and_another_model(baseline, tmp_path):
    from ascend_llm_recipes.models.shapes import parameter_shapes
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    copy = str(tmp_path / "step")
    shutil.copytree(step_dir(baseline, 20), copy)
    cfg = load_recipe(TINY_RECIPE).model.model_config
    assert verify_step(copy, 1, parameter_shapes(cfg)) == []
    other = load_recipe(TINY_RECIPE, ("model.model_config.num_layers=3",)).model.model_config
    problems = verify_step(copy, 1, parameter_shapes(other))
    assert any("tensor model.layers.2.input_layernorm.weight missing (checkpoint of another model?)" in p
               for p in problems)
    ckpt = os.path.join(copy, "rank_0", read_json(os.path.join(copy, "rank_0", MANIFEST))["file"])
    with open(ckpt, "r+b") as f:
        f.truncate(os.path.getsize(ckpt) // 2)
    assert any("(truncated?)" in p for p in verify_step(copy, 1, parameter_shapes(cfg)))
    step, _ = newest_valid_step(str(tmp_path))
    assert step is None


def test_missing_optimizer_state_is_refused_for_resume(tmp_path):
    import numpy as np
    import mindspore as ms
    from ascend_llm_recipes.models.shapes import parameter_shapes
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    cfg = load_recipe(TINY_RECIPE).model.model_config
    shapes = parameter_shapes(cfg)
    weights = [{"name": n, "data": ms.Tensor(np.zeros(s, np.float32))} for n, s in shapes.items()]
    write_rank(str(tmp_path / "rank_0"), "w_rank_0-1_5.ckpt", weights, {}, {"step": 5, "world_size": 1})
    problems = verify_step(str(tmp_path), 1, shapes)
    assert "no AdamW state" in problems[0] and "set load_checkpoint without" in problems[0]
    assert "state.json: missing" in problems[1]  # nor a data position to resume from
    assert verify_step(str(tmp_path), 1, shapes, need_optimizer=False) == []


def test_every_entry_of_a_run_directory_is_named_in_run_files(baseline):
    from ascend_llm_recipes.data.loader import SKIPS_FILE
    from ascend_llm_recipes.training import run_files

    named = {v for k, v in vars(run_files).items() if k.isupper() and isinstance(v, str)}
    named |= {SKIPS_FILE, *run_files.MINDFORMERS_DIRS}
    assert sorted(set(os.listdir(baseline)) - named) == []


def test_verify_checkpoint_script(baseline):
    script = os.path.join(REPO_ROOT, "scripts", "verify_checkpoint.py")
    ok = subprocess.run(["python", script, baseline, "--recipe", TINY_RECIPE], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.count("OK ") == 3, ok.stdout + ok.stderr
    bad = subprocess.run(["python", script, baseline, "--recipe", TINY_RECIPE,
                          "--set", "model.model_config.intermediate_size=192"], capture_output=True, text=True)
    assert bad.returncode == 1 and "mlp.up_proj.weight has shape (176, 64), the recipe's model needs (192, 64)" \
        in bad.stdout


def test_verify_checkpoint_says_what_it_verified_and_refuses_the_rest(baseline, tmp_path, capsys):
    from scripts.verify_checkpoint import main as verify

    step = step_dir(baseline, 20)
    ckpt = os.path.join(step, "rank_0", read_json(os.path.join(step, "rank_0", MANIFEST))["file"])
    assert verify([ckpt]) == 0  # a rank's file, checked with its whole step against the manifests
    out = capsys.readouterr().out
    assert f"one rank's part of {step}" in out and f"OK   {step}: step 20, 1 rank(s), 65 tensors per rank, 80 " \
        "samples consumed (global batch 4)" in out and "verified 1 complete checkpoint(s), 0 bad" in out
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    shutil.copyfile(ckpt, tmp_path / "bare.ckpt")
    refused = {str(tmp_path / "missing"): "does not exist", str(tmp_path / "empty"): "an empty folder",
               str(tmp_path / "notes.txt"): "a file, not a checkpoint",
               os.path.join(baseline, "checkpoints"): "the checkpoints folder itself",
               str(tmp_path / "bare.ckpt"): "no manifest.json beside it naming this file"}
    for path, message in refused.items():
        assert verify([path]) == 2, path
        err = capsys.readouterr().err
        assert f"error: {path}: {message}" in err and "HINT: pass" in err
    incomplete = tmp_path / "step_00000005"
    shutil.copytree(step, incomplete)
    os.remove(incomplete / "rank_0" / MANIFEST)
    assert verify([str(incomplete)]) == 1
    assert "no readable manifest.json" in capsys.readouterr().out


def test_plot_run_drops_a_torn_line_and_refuses_bad_input(baseline, tmp_path, capsys):
    plot = load_script("plot_run").main

    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    shutil.copyfile(os.path.join(baseline, "metrics.jsonl"), os.path.join(run_dir, "metrics.jsonl"))
    torn = append_torn_line(os.path.join(run_dir, "metrics.jsonl"), '{"step": 21, "lo')
    assert plot([run_dir]) == 0
    captured = capsys.readouterr()
    assert f"metrics.jsonl:{torn}: not a JSON record (torn by a crash?), dropped" in captured.err
    assert "recipe.yaml: missing; loss spikes and the gradient clip are not marked" in captured.err
    assert captured.out.strip() == os.path.join(run_dir, "plots", "dashboard.png")
    assert plot([str(tmp_path / "missing")]) == 2
    assert "no metrics file" in capsys.readouterr().err


NAN = ["--set", "lr_schedule.learning_rate=1e30", "--set", "lr_schedule.warmup_steps=0",
       "--set", "runner_wrapper.use_clip_grad=False", "--set", "runner_config.stop_step=4"]


def test_nan_stops_and_keeps_the_state_for_post_mortem(tiny_dataset, tmp_path):
    run_dir = str(tmp_path / "run")
    code, output = rerun(run_dir, tiny_dataset, *NAN)
    assert code == 1
    assert "step 2: non-finite loss nan" in output and "state saved for post-mortem" in output
    post_mortem = step_dir(run_dir, 2, kind="nan")
    assert os.path.isfile(os.path.join(post_mortem, "rank_0", MANIFEST))
    assert verify_step(post_mortem, 1) == []
    assert not os.path.exists(os.path.join(run_dir, "checkpoints", "step_00000002"))  # never resumed from


def test_nan_skip_goes_on(tiny_dataset, tmp_path):
    run_dir = str(tmp_path / "run")
    code, output = rerun(run_dir, tiny_dataset, *NAN, "--set", "anomaly.on_nan=skip")
    assert code == 0, output
    assert "[anomaly] step 2: non-finite loss/grad norm; the update was skipped" in output
    assert len(metrics(run_dir)) == 4


def test_loss_spike_against_the_moving_window():
    from ascend_llm_recipes.training.worker.callbacks import StepRecorder

    recorder = StepRecorder.__new__(StepRecorder)
    recorder.records = [{"loss": 2.0} for _ in range(5)] + [{"loss": 2.5}]
    assert recorder.spike(factor=1.5, window=5) is None
    recorder.records.append({"loss": 3.5})
    assert recorder.spike(factor=1.5, window=5) == pytest.approx(2.1)  # mean of the 5 before it
    assert recorder.spike(factor=0.0, window=5) is None  # off


def rollback_on_the_dashboard(run_dir, rollback, last_good, baseline, output):
    """The dashboard marks the rollback and the relaunch; compared with the baseline, both runs are labelled."""
    from ascend_llm_recipes.training.tools.plots import dashboard, read_run

    spike_step = rollback["spike_step"]
    fig = dashboard([read_run(run_dir)])
    for panel in ("loss", "gradient norm"):
        ax = next(ax for ax in fig.axes if ax.get_label() == panel)
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert list(lines["run: rollback"].get_xdata()) == [spike_step, spike_step]
        assert list(lines["run: relaunch"].get_xdata()) == [last_good + 0.5, last_good + 0.5]
    loss = next(ax for ax in fig.axes if ax.get_label() == "loss")
    marker = next(c for c in loss.collections if c.get_label() == "run: spike rolled back")
    # At the spike's loss, or on the panel's top edge when the spike is above the smoothed curve's scale.
    assert marker.get_offsets().tolist() == [[spike_step, pytest.approx(min(rollback["loss"], loss.get_ylim()[1]))]]
    assert f"loss {rollback['loss']:.2f}, rolled back to {last_good}" in [t.get_text() for t in loss.texts]
    assert "1 rollback(s)" in fig.legends[0].get_texts()[0].get_text()

    assert load_script("plot_run").main([baseline, run_dir, "--output", output]) == 0
    assert os.listdir(output) == ["compare_baseline_run.png"]  # named after the run directories
    fig = dashboard([read_run(baseline, "uninterrupted"), read_run(run_dir)])
    loss = next(ax for ax in fig.axes if ax.get_label() == "loss")
    labels = {line.get_label() for line in loss.get_lines()}
    assert {"uninterrupted: train loss EMA", "run: train loss EMA", "run: rollback"} <= labels
    assert "uninterrupted: rollback" not in labels
    legend = fig.legends[0]
    assert legend.get_title().get_text() == "Training runs compared: uninterrupted, run"
    assert [t.get_text().split(":")[0] for t in legend.get_texts()] == ["uninterrupted", "run"]
    assert [line.get_color() for line in legend.get_lines()] == [lines_color(loss, "uninterrupted"),
                                                                 lines_color(loss, "run")]


def lines_color(ax, run):
    return next(line.get_color() for line in ax.get_lines() if line.get_label() == f"{run}: train loss EMA")


def poisoned_dataset(tiny_dataset, root):
    """Twelve stdlib modules and, among them, one file of random CJK text: byte tokens the model never saw."""
    import random

    import numpy as np
    from ascend_llm_recipes.data.text.corpus import python_stdlib_files
    from ascend_llm_recipes.data.mindrecord_io import read_manifest, read_samples
    from ascend_llm_recipes.data.prepare import prepare_dataset

    src = os.path.join(root, "src")
    os.makedirs(src)
    for i, path in enumerate(python_stdlib_files()[:12]):
        shutil.copyfile(path, os.path.join(src, f"doc_{i:02d}.txt"))
    rng = random.Random(0)
    with open(os.path.join(src, "doc_05_poison.txt"), "w", encoding="utf-8") as f:
        f.write("".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(40)))
    out = os.path.join(root, "poisoned")
    prepare_dataset(out, 64, inputs=[src], tokenizer=os.path.join(tiny_dataset, "tokenizer.model"),
                    show_progress=False, workers=0)
    rows = np.stack(list(read_samples(out, read_manifest(out))))
    poisoned = np.flatnonzero(((rows > 2) & (rows < 259)).mean(axis=1) > 0.5)  # mostly byte-fallback pieces
    return out, poisoned


@pytest.mark.drill
def test_loss_spike_rolls_back_and_skips_the_offending_samples(tiny_dataset, baseline, tmp_path):
    dataset, poisoned = poisoned_dataset(tiny_dataset, str(tmp_path))
    spike_step = int(poisoned[0]) // 4 + 1  # batch 4, unshuffled: sample i is read at step i // 4 + 1
    assert len(poisoned) and {int(i) // 4 + 1 for i in poisoned} == {spike_step} and spike_step > 12
    run_dir = str(tmp_path / "run")
    settings = ("--set", "train_dataset.data_loader.shuffle=False",
                "--set", f"runner_config.stop_step={spike_step + 4}", "--set", "anomaly.spike_factor=1.3",
                "--set", "anomaly.spike_window=5", "--set", "anomaly.on_spike=rollback")
    code, output = rerun(run_dir, dataset, *settings)
    assert code == 0, output
    last_good = (spike_step - 1) // 5 * 5  # checkpoints every 5 steps
    assert f"[launch] loss spike at step {spike_step}: rolling back to step {last_good} and skipping 4 samples" \
        in output
    assert f"resuming {run_dir} from step {last_good}" in output
    rollbacks = read_json(os.path.join(run_dir, "data_skips.json"))["rollbacks"]
    start = (spike_step - 1) * 4
    assert len(rollbacks) == 1 and rollbacks[0]["skipped_positions"] == [[start, start + 4]]
    assert rollbacks[0]["loss"] > 1.3 * rollbacks[0]["moving_mean"]
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, spike_step + 5))  # each step once, the spike replaced
    assert records[spike_step - 1]["loss"] < 1.3 * sum(r["loss"] for r in records[spike_step - 6:spike_step - 1]) / 5
    # After the skip, step k reads the samples that were step k + 1's: the last save expects sample 4 x (k + 1) next.
    state = read_json(os.path.join(step_dir(run_dir, spike_step + 4), "state.json"))
    assert state["data_skips"] == [[start, start + 4]]
    assert state["next_samples"]["first_ids"][:2] == [4 * (spike_step + 5), 4 * (spike_step + 5) + 1]
    rollback_on_the_dashboard(run_dir, rollbacks[0], last_good, baseline, str(tmp_path / "plots"))
    # Without the rollback record a rerun would read the skipped samples again: refused.
    os.remove(os.path.join(run_dir, "data_skips.json"))
    assert "was trained without the samples at training-order positions" in refusal(run_dir, dataset, *settings)


def rank_slices(net, rank: int, shard: int, held) -> list:
    """Every parameter of `net` (weights, AdamW moments, step) as `rank` holds it, cut by MindSpore's own
    checkpoint-transform code from the optimizer-shard layout of a data-parallel-only strategy file."""
    import mindspore as ms
    import numpy as np
    from mindspore.parallel._tensor import _construct_tensor_layout_for_opt_shard, _load_tensor

    out = []
    for p in net.get_parameters():
        whole = p.asnumpy()
        if held(p.name, whole) == whole.shape:
            out.append({"name": p.name, "data": ms.Tensor(whole)})
            continue
        dev, tensor_map, full = _construct_tensor_layout_for_opt_shard([shard], [-1] * whole.ndim, 1, shard,
                                                                       list(whole.shape))
        part = _load_tensor(ms.Tensor(whole), dev, tensor_map, full, rank).reshape(-1, *whole.shape[1:])
        out.append({"name": p.name, "data": ms.Tensor(np.ascontiguousarray(part))})
    return out


def test_a_dp_only_semi_auto_rank_resumes_from_the_slices_optimizer_parallel_gives_it(tmp_path, tiny_dataset):
    """MindFormers' 7B layout (semi-auto DP 8, optimizer parallel): each rank saves its slices, and resume checks
    them against the slice it holds, not the whole model (which refused every resume of that recipe)."""
    import mindspore as ms
    from mindspore import nn
    from ascend_llm_recipes.common.errors import LaunchError
    from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
    from ascend_llm_recipes.training.checkpoint import rank_shapes, verify_step
    from ascend_llm_recipes.training.recipe.loading import load_recipe
    from ascend_llm_recipes.training.worker.train import check_checkpoint_parameters

    recipe = load_recipe(os.path.join(REPO_ROOT, "recipes", "tiny_ascend.yaml"),
                         [f"train_dataset.data_loader.dataset_dir={tiny_dataset}", f"output_dir={tmp_path}",
                          "parallel.parallel_optimizer_config.optimizer_level=level3"], planning=True)
    shapes = rank_shapes(recipe)
    assert (shapes.optimizer_shard, shapes.threshold_kb) == (8, 64)
    # 64 KB threshold in the parameter's dtype: the (512, 64) float32 table (128 KB) is sliced, a (64, 64)
    # projection (16 KB) and the norms stay whole; a bfloat16 table (64 KB) is still sliced.
    assert shapes.shape("model.embed_tokens.weight", 4) == (64, 64) == shapes.shape("model.embed_tokens.weight", 2)
    assert shapes.shape("model.layers.0.self_attn.q_proj.weight", 4) == (64, 64)
    assert shapes.shape("model.norm.weight", 4) == (64,)
    # MindFormers' own 7B layout, DP 8 x TP 1 (ours is DP 4 x TP 2 by its plan; the strategy file decides there).
    seven_b = rank_shapes(load_recipe(os.path.join(REPO_ROOT, "recipes", "llama2_7b_8dev.yaml"),
                                      ["parallel_config.data_parallel=8", "parallel_config.model_parallel=1"],
                                      planning=True))
    assert seven_b.shape("model.layers.0.self_attn.q_proj.weight", 4) == (512, 4096)  # the (512, 4096)
    assert seven_b.shape("model.layers.0.mlp.gate_proj.weight", 2) == (1376, 4096)
    assert seven_b.shape("model.layers.0.input_layernorm.weight", 4) == (4096,)  # 16 KB: whole

    cfg = recipe.model.model_config
    net = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in vars(cfg).items() if k != "type"}))
    optimizer = nn.AdamWeightDecay(net.trainable_params())  # moments named adam_m./adam_v. as MindFormers' AdamW
    cell = nn.TrainOneStepCell(net, optimizer)  # what the checkpointer snapshots: the train network's parameters

    def held(name, array):
        base = name.split(".", 1)[1] if name.startswith(("adam_m.", "adam_v.")) else name
        return shapes.shape(base, array.dtype.itemsize) if base in shapes else array.shape

    step = os.path.join(str(tmp_path), "checkpoints", "step_00000010")
    meta = {"step": 10, "epoch": 1, "world_size": 8, "kind": "step"}
    for rank in range(8):
        write_rank(os.path.join(step, f"rank_{rank}"), f"llama_rank_{rank}-1_10.ckpt",
                   rank_slices(cell, rank, 8, held), {"epoch_num": 1, "step_num": 10}, {**meta, "rank": rank})
    manifest = read_json(os.path.join(step, "rank_3", MANIFEST))["tensors"]
    assert manifest["adam_m.model.embed_tokens.weight"]["shape"] == [64, 64]
    assert manifest["model.layers.0.self_attn.q_proj.weight"]["shape"] == [64, 64]
    assert verify_step(step, 8, shapes, need_optimizer=False) == []
    recipe.load_checkpoint, recipe.resume_training = step, True
    check_checkpoint_parameters(recipe, 3)  # rank 3's own slices: accepted

    # A rank file holding the whole table where the rank keeps 1/8 of it is refused, naming the slice rule.
    whole = [{"name": p.name, "data": ms.Tensor(p.asnumpy())} for p in cell.get_parameters()]
    write_rank(os.path.join(step, "rank_3"), "llama_rank_3-1_10.ckpt", whole, {}, {**meta, "rank": 3})
    with pytest.raises(LaunchError, match=r"model\.embed_tokens\.weight: checkpoint shape \(512, 64\), rank 3 of "
                                          r"the recipe's model holds \(64, 64\) \(optimizer parallel: the whole "
                                          r"\(512, 64\) sliced over 8"):
        check_checkpoint_parameters(recipe, 3)
    assert any("tensor adam_v.model.embed_tokens.weight has shape (512, 64), this rank holds (64, 64)" in p
               for p in verify_step(step, 8, shapes, need_optimizer=False))
