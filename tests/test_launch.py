"""The launcher as a user runs it: bad input stops before training; a dead worker is named."""

import os
import shutil
import signal
import subprocess
import time

import pytest

from conftest import REPO_ROOT, TINY_RECIPE

LAUNCHER = os.path.join(REPO_ROOT, "scripts", "run_distributed.sh")


def run_launcher(*args, timeout=300):
    return subprocess.run(["bash", LAUNCHER, *args], capture_output=True, text=True, timeout=timeout)


def test_missing_recipe_file():
    result = run_launcher("recipes/does_not_exist.yaml")
    assert result.returncode == 2
    assert "recipe recipes/does_not_exist.yaml: 1 problem(s):\n  - file not found" in result.stderr


def test_unknown_key_stops_before_anything_runs(tmp_path):
    result = run_launcher(TINY_RECIPE, "--set", "runner_config.batchsize=2", "--set", f"output_dir={tmp_path}/run")
    assert result.returncode == 2
    assert "runner_config.batchsize: unknown key; did you mean batch_size?" in result.stderr
    assert not os.path.exists(tmp_path / "run")


def test_missing_dataset_names_key_and_command(tmp_path):
    result = run_launcher(TINY_RECIPE, "--set", "data_preparation=null",
                          "--set", f"train_dataset.data_loader.dataset_dir={tmp_path}/none",
                          "--set", f"output_dir={tmp_path}/run")
    assert result.returncode == 2
    assert "train_dataset.data_loader.dataset_dir: dataset" in result.stderr
    assert f"python scripts/prepare_data.py --output {tmp_path}/none --seq-length 64 --vocab-size 512" \
        in result.stderr
    assert not os.path.exists(tmp_path / "run")


def test_dataset_seq_length_mismatch(tiny_dataset, tmp_path):
    result = run_launcher(TINY_RECIPE, "--set", "model.model_config.seq_length=128",
                          "--set", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                          "--set", f"output_dir={tmp_path}/run")
    assert result.returncode == 2
    assert "seq_length 64 (model.model_config.seq_length is 128)" in result.stderr
    assert "--seq-length 128" in result.stderr


def test_dataset_copied_without_index_files(tiny_dataset, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dataset, copy, ignore=shutil.ignore_patterns("*.db"))
    result = run_launcher(TINY_RECIPE, "--set", f"train_dataset.data_loader.dataset_dir={copy}",
                          "--set", f"output_dir={tmp_path}/run")
    assert result.returncode == 2
    assert "train-00000.mindrecord.db listed in manifest.json is missing" in result.stderr


def test_killed_worker_is_named_with_its_log(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(["bash", LAUNCHER, TINY_RECIPE, "--set", f"output_dir={run_dir}",
                             "--set", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                             "--set", "runner_config.stop_step=0", "--set", "runner_config.epochs=50"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.5)
    import json
    pid = json.loads((run_dir / "status" / "rank_0.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "[launch] training failed" in stderr
    assert "rank 0: killed or crashed" in stderr
    assert f"last 25 lines of {run_dir}/logs/worker_0.log" in stderr


def test_rerun_into_an_existing_run_is_refused(tiny_dataset, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe.yaml").write_text("seed: 0\n")
    result = run_launcher(TINY_RECIPE, "--set", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                          "--set", f"output_dir={tmp_path}/run")
    assert result.returncode == 2
    assert "already holds a run" in result.stderr
    assert (tmp_path / "run" / "recipe.yaml").read_text() == "seed: 0\n"


@pytest.mark.parametrize("bad", ["runner_config.stop_step=-1"])
def test_bad_values_are_refused(bad, tmp_path):
    result = run_launcher(TINY_RECIPE, "--set", bad, "--set", f"output_dir={tmp_path}/run")
    assert result.returncode == 2 and "runner_config.stop_step: must be >= 0" in result.stderr
