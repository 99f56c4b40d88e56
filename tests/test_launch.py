"""The launcher as a user runs it: bad input stops before training; a dead worker is named."""

import os
import re
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


def test_rerun_into_a_directory_whose_run_is_unreadable_is_refused(tiny_dataset, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe.yaml").write_text("seed: 0\n")
    result = run_launcher(TINY_RECIPE, "--set", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                          "--set", f"output_dir={tmp_path}/run")
    assert result.returncode == 2
    assert f"{tmp_path}/run/recipe.yaml" in result.stderr and "missing required key" in result.stderr
    assert (tmp_path / "run" / "recipe.yaml").read_text() == "seed: 0\n"  # nothing overwritten


@pytest.mark.parametrize("bad", ["runner_config.stop_step=-1"])
def test_bad_values_are_refused(bad, tmp_path):
    result = run_launcher(TINY_RECIPE, "--set", bad, "--set", f"output_dir={tmp_path}/run")
    assert result.returncode == 2 and "runner_config.stop_step: must be >= 0" in result.stderr


def test_slurm_and_explicit_cluster_resolution():
    from training.launch import first_slurm_host, resolve_cluster
    from training.recipe import load_recipe
    from training.errors import LaunchError

    assert first_slurm_host("gpu[03-06,09],login1") == "gpu03"
    assert first_slurm_host("node7") == "node7"
    recipe = load_recipe(os.path.join(REPO_ROOT, "recipes", "llama2_70b_32dev.yaml"))
    cluster = resolve_cluster(recipe, env={"SLURM_NNODES": "4", "SLURM_NODEID": "2",
                                           "SLURM_JOB_NODELIST": "ascend[10-13]"})
    assert (cluster.nodes, cluster.node_rank, cluster.master_addr, cluster.master_port) == (4, 2, "ascend10", 8118)
    assert cluster.local_workers == 8 and list(cluster.ranks) == list(range(16, 24))  # contiguous per node
    explicit = resolve_cluster(recipe, nodes=4, node_rank=0, master_addr="10.1.1.1", master_port=9000, env={})
    assert explicit.master_addr == "10.1.1.1" and explicit.ranks == range(0, 8)
    with pytest.raises(LaunchError, match=r"hardware\.devices_per_node: 8, but 32 devices over 2 node\(s\) is 16"):
        resolve_cluster(recipe, nodes=2, env={})
    with pytest.raises(LaunchError, match="cannot be split evenly over 3 nodes"):
        resolve_cluster(recipe, nodes=3, env={})


def test_dry_run_prints_the_msrun_command(tmp_path):
    env = dict(os.environ, DRY_RUN="1")
    result = subprocess.run(["bash", LAUNCHER, os.path.join(REPO_ROOT, "recipes", "tiny_dp2_cpu.yaml"),
                             "--set", f"output_dir={tmp_path}/run", "--set", "hardware.devices_per_node=1",
                             "--nodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    line = [x for x in result.stdout.splitlines() if x.startswith("[dry-run]")][0]
    for part in ("HCCL_CONNECT_TIMEOUT=", "--worker_num=2", "--local_worker_num=1", "--master_addr=10.0.0.5",
                 "--master_port=8118", "--node_rank=1", "scripts/train.py"):
        assert part in line
    assert not os.path.exists(tmp_path / "run")  # nothing prepared, nothing started


@pytest.mark.parametrize("name", ["llama2_7b_8dev", "llama2_13b_8dev", "llama2_70b_32dev", "dense_100b_64dev",
                                  "demo_cpu", "tiny_dp2_cpu"])
def test_plan_works_for_every_shipped_recipe_on_cpu(name):
    result = run_launcher(os.path.join(REPO_ROOT, "recipes", f"{name}.yaml"), "--plan")
    assert result.returncode == 0, result.stderr
    assert "fits" in result.stdout.lower()


def test_plan_still_works_for_ascend_features_asked_on_cpu():
    result = run_launcher(TINY_RECIPE, "--plan", "--set", "model.model_config.compute_dtype=bfloat16",
                          "--set", "use_parallel=True", "--set", "parallel_config.model_parallel=2")
    assert result.returncode == 0, result.stderr
    refused = run_launcher(TINY_RECIPE, "--set", "model.model_config.compute_dtype=bfloat16")
    assert refused.returncode == 2 and "bfloat16 kernels exist only on Ascend/GPU" in refused.stderr


def test_stalled_worker_is_named_by_rank_and_phase(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(["bash", LAUNCHER, TINY_RECIPE, "--set", f"output_dir={run_dir}",
                             "--set", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                             "--set", "runner_config.stop_step=0", "--set", "runner_config.epochs=50",
                             "--set", "monitoring.hang_timeout=20"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.5)
    import json
    pid = json.loads((run_dir / "status" / "rank_0.json").read_text())["pid"]
    os.kill(pid, signal.SIGSTOP)  # a hang: alive, silent
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 3
    assert re.search(r"rank 0 stalled in phase '(data|step \d+|save)' for \d+ s \(monitoring\.hang_timeout 20 s\)",
                     stderr), stderr
    assert re.search(r"rank 0: killed or crashed \(last phase '(data|step \d+|save)'", stderr), stderr
