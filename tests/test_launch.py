"""The launcher as a user runs it: bad input stops before training; a dead worker is named."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT, TINY_RECIPE

LAUNCHER = os.path.join(REPO_ROOT, "scripts", "run_distributed.sh")
DP2_RECIPE = os.path.join(REPO_ROOT, "recipes", "tiny_dp2_cpu.yaml")


def run_launcher(*args, timeout=300):
    return subprocess.run(["bash", LAUNCHER, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bare_python3(tmp_path_factory):
    """bin/ of a Python with the standard library only (a venv without site-packages), whose only name is
    python3 (as on Debian without python-is-python3)."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # venv makes python3 a link to python (python3 -> python -> the interpreter): point python3 at the
    # interpreter itself before removing python, or python3 dangles and the launcher finds no Python at all.
    interpreter = os.path.realpath(venv / "bin" / "python3")
    os.remove(venv / "bin" / "python3")
    os.remove(venv / "bin" / "python")
    os.symlink(interpreter, venv / "bin" / "python3")
    return str(venv / "bin")


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory):
    """A directory holding ascend_llm_recipes as `pip install .` (non-editable) installs it: the package only."""
    source = tmp_path_factory.mktemp("source")
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO_ROOT, name), source)
    for folder in ("common", "models", "data", "training"):  # not the checkout itself: pip builds in the tree
        shutil.copytree(os.path.join(REPO_ROOT, folder), source / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path_factory.mktemp("site-packages")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--no-compile", "--target", str(target), str(source)], check=True, timeout=600)
    return str(target)


def shell_tools(directory) -> str:
    """A PATH directory with the tools the launcher script uses and no Python."""
    os.makedirs(directory)
    for tool in ("dirname", "grep", "tail", "sed"):
        os.symlink(shutil.which(tool), os.path.join(directory, tool))
    return str(directory)


def test_launcher_names_the_python_it_found_and_the_real_import_error(bare_python3, package_copy, tmp_path):
    tools = shell_tools(tmp_path / "tools")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bash = shutil.which("bash")
    result = subprocess.run([bash, LAUNCHER, TINY_RECIPE], capture_output=True, text=True, timeout=120,
                            env=dict(env, PATH=f"{bare_python3}{os.pathsep}{tools}"))
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: the ascend_llm_recipes package is not installed in this Python "
                                    f"({bare_python3}/python3);\n  install it once from the repository root: "
                                    f'pip install -e "{os.path.realpath(REPO_ROOT)}"'), result.stderr
    # Installed, but without its dependencies: the import error itself, not "not installed".
    result = subprocess.run([bash, LAUNCHER, TINY_RECIPE], capture_output=True, text=True, timeout=120,
                            env=dict(env, PATH=f"{bare_python3}{os.pathsep}{tools}", PYTHONPATH=package_copy))
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {bare_python3}/python3 cannot import "
                                    "ascend_llm_recipes.training.launcher.cli: "
                                    "ModuleNotFoundError: No module named 'yaml'\n"), result.stderr
    assert re.search(rf'\n  raised at "{package_copy}/ascend_llm_recipes/training/[\w/]+\.py", line \d+, '
                     r'in <module>\n', result.stderr), result.stderr
    result = subprocess.run([bash, LAUNCHER, TINY_RECIPE], capture_output=True, text=True, timeout=120,
                            env=dict(env, PATH=tools))
    assert result.returncode == 2
    assert result.stderr.startswith("error: no python or python3 on PATH;"), result.stderr


def test_launcher_says_a_non_editable_install_is_a_copy_not_a_checkout(package_copy):
    result = subprocess.run(["bash", LAUNCHER, TINY_RECIPE], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=package_copy))
    assert result.returncode == 2
    assert f"imports ascend_llm_recipes from {package_copy}/ascend_llm_recipes, a copy of the package installed " \
           "without its checkout (`pip install .` without -e): that copy's code runs" in result.stderr, result.stderr
    assert "checkout's code runs" not in result.stderr
    assert f"error: the training worker {package_copy}/ascend_llm_recipes/scripts/train.py is missing" in result.stderr


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


def start_launcher(run_dir, dataset, recipe=TINY_RECIPE, *sets):
    """A launch that trains for minutes (50 epochs, no stop_step): it ends only when a test stops it.

    Its stdout (the workers' output too) and stderr go to files RUN_DIR.stdout and
    RUN_DIR.stderr, which a test can read while it runs: a full pipe would block it.
    """
    out, err = open(f"{run_dir}.stdout", "w+"), open(f"{run_dir}.stderr", "w+")
    proc = subprocess.Popen(["bash", LAUNCHER, recipe, "--set", f"output_dir={run_dir}",
                             "--set", f"train_dataset.data_loader.dataset_dir={dataset}",
                             "--set", "runner_config.stop_step=0", "--set", "runner_config.epochs=50", *sets],
                            stdout=out, stderr=err, text=True)
    proc.output_files = out, err
    return proc


def finish(proc, timeout=150):
    """(stdout, stderr) of a launch started by start_launcher, once it has exited."""
    proc.wait(timeout=timeout)
    texts = []
    for f in proc.output_files:
        f.seek(0)
        texts.append(f.read())
        f.close()
    return tuple(texts)


def wait_for_output(proc, run_dir, pattern, stream="stdout", timeout=120):
    """The match of `pattern` in RUN_DIR.stdout (or .stderr) of a running launch started by start_launcher."""
    deadline = time.time() + timeout
    while True:
        with open(f"{run_dir}.{stream}", encoding="utf-8") as f:
            match = re.search(pattern, f.read())
        if match:
            return match
        assert proc.poll() is None and time.time() < deadline, finish(proc)
        time.sleep(0.3)


def wait_for_steps(proc, run_dir, steps=3, timeout=240):
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None and time.time() < deadline, finish(proc)
        time.sleep(0.3)


def rank_pid(run_dir, rank):
    return json.loads((run_dir / "status" / f"rank_{rank}.json").read_text())["pid"]


def processes_of(run_dir):
    """(pid, command line) of every process whose arguments name the run directory: msrun, scheduler, workers."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, ValueError):
            continue
        if str(run_dir) in command and not zombie:
            found.append((int(entry), command))
    return found


def test_a_run_directory_has_one_owner_and_ctrl_c_stops_the_whole_job(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    first = start_launcher(run_dir, tiny_dataset)
    wait_for_steps(first, run_dir)
    second = run_launcher(TINY_RECIPE, "--set", f"output_dir={run_dir}",
                          "--set", f"train_dataset.data_loader.dataset_dir={tiny_dataset}")
    assert second.returncode == 2
    assert re.search(rf"output_dir {run_dir} is in use: launch on host \S+ by PID {first.pid}, started", second.stderr)
    assert first.poll() is None  # the owner is not disturbed
    dry = subprocess.run(["bash", LAUNCHER, TINY_RECIPE, "--set", f"output_dir={run_dir}"], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, DRY_RUN="1"))
    assert dry.returncode == 0 and "[dry-run]" in dry.stdout  # looking takes no lock

    first.send_signal(signal.SIGINT)
    # After every rank wrote "done" (its step saved), a process killed in teardown does not fail the job.
    deadline = time.time() + 120
    while json.loads((run_dir / "status" / "rank_0.json").read_text())["state"] != "done":
        assert time.time() < deadline and first.poll() is None, finish(first)
        time.sleep(0.05)
    os.kill(rank_pid(run_dir, 0), signal.SIGKILL)
    stdout, stderr = finish(first)
    assert first.returncode == 4, stderr
    assert "[launch] SIGINT: stopping the job: every rank saves at the end of its current step" in stderr
    step = int(re.search(r"\[launch\] stopped \(SIGINT\) after step (\d+), checkpoint saved, no process of the job "
                         r"left; rerun the same command to resume", stdout).group(1))
    assert "after every rank had finished and saved (a process ended badly during teardown)" in stdout
    assert (run_dir / "checkpoints" / f"step_{step:08d}" / "rank_0" / "manifest.json").exists()
    assert processes_of(run_dir) == []
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, step + 1))  # one writer
    assert (run_dir / "launch.lock").read_text() == ""  # released


def test_stale_lock_is_taken_over_and_a_live_one_is_not(tmp_path, capsys):
    import platform
    from ascend_llm_recipes.common.errors import LaunchError
    from ascend_llm_recipes.training.launcher.job import process_id
    from ascend_llm_recipes.training.run_files import LOCK_FILE
    from ascend_llm_recipes.training.launcher.cli import lock_run_dir
    from ascend_llm_recipes.training.launcher.cluster import Cluster
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    dead = subprocess.Popen(["sleep", "0"])
    dead_id = process_id(dead.pid)
    dead.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = {"host": platform.node(), "pid": dead.pid, "launcher": dead_id, "started": "2026-01-01T00:00:00+0000",
             "command": "an old launch"}
    (run_dir / LOCK_FILE).write_text(json.dumps(stale))
    recipe = load_recipe(TINY_RECIPE, (f"output_dir={run_dir}",))
    cluster = Cluster(1, 0, "127.0.0.1", 0, 1, 1)
    lock = lock_run_dir(recipe, cluster)
    try:
        assert f"taking over the stale lock {run_dir}/{LOCK_FILE} of a launch that is gone (launch on host " \
               f"{platform.node()} by PID {dead.pid}" in capsys.readouterr().out
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(LaunchError, match=rf"is in use: launch on host \S+ by PID {os.getpid()}"):
            lock_run_dir(recipe, cluster)  # held (flock): refused even within one process
    finally:
        lock.release()
    # A lock naming another host cannot be checked from here: refused, naming it.
    (run_dir / LOCK_FILE).write_text(json.dumps(dict(stale, host="elsewhere")))
    with pytest.raises(LaunchError, match=r"locked by launch on host elsewhere by PID \d+.*cannot be checked"):
        lock_run_dir(recipe, cluster)


@pytest.mark.drill
def test_killed_launcher_stops_its_workers_and_the_same_command_right_away_continues(tiny_dataset, tmp_path):
    """kill -9 of the launcher: its workers save at the end of their step and exit; the same command run at once
    waits for the old job's processes (bounded, saying so) instead of refusing, then resumes from that save.
    The tiny recipe's one CPU worker is started by the launcher itself, without msrun."""
    run_dir = tmp_path / "run"
    launcher = start_launcher(run_dir, tiny_dataset)
    wait_for_steps(launcher, run_dir)
    steps_seen = len((run_dir / "metrics.jsonl").read_text().splitlines())
    worker = rank_pid(run_dir, 0)
    # Hold the old job's worker (stopped, it cannot see its launcher go) so that it is still there when the same
    # command comes back, however fast it would save and stop and however slowly the new launcher starts.
    os.kill(worker, signal.SIGSTOP)
    try:
        launcher.kill()
        finish(launcher)
        again = start_launcher(run_dir, tiny_dataset)
        wait_for_output(again, run_dir, rf"\[launch\] the launcher that held {run_dir} \(PID {launcher.pid}\) is gone; "
                        r"waiting up to 45 s for its job's \d+ process\(es\) \([\d, ]+\) to save at the end of their "
                        r"step and exit", stream="stderr")
    finally:
        os.kill(worker, signal.SIGCONT)
    resumed = int(wait_for_output(again, run_dir, rf"\[launch\] resuming {run_dir} from step (\d+)").group(1))
    assert resumed >= steps_seen  # the step the orphaned worker saved at the end of, after the kill
    wait_for_steps(again, run_dir, steps=resumed + 1)  # metrics.jsonl was cut back to the resumed step
    again.send_signal(signal.SIGINT)
    stdout, stderr = finish(again)
    assert again.returncode == 4, stderr
    waited = re.search(r"\[launch\] the previous job's processes exited after (\d+) s; continuing", stderr)
    assert waited and int(waited.group(1)) <= 45, stderr
    assert "are still" not in stderr and processes_of(run_dir) == []


def test_a_failed_rank_stops_the_job_at_once_and_is_named(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "heartbeat" / "rank_1.json").mkdir(parents=True)  # rank 1 cannot write its heartbeat: it fails
    started = time.time()
    result = run_launcher(DP2_RECIPE, "--set", f"output_dir={run_dir}",
                          "--set", f"train_dataset.data_loader.dataset_dir={tiny_dataset}", timeout=150)
    failed_at = json.loads((run_dir / "status" / "rank_1.json").read_text())["time"]
    assert result.returncode == 1
    assert time.time() - failed_at < 30, time.time() - started  # msrun's scheduler alone would wait minutes
    assert re.search(r"\[launch\] rank 1 failed first: exited with code 1: IsADirectoryError",
                     result.stderr), result.stderr
    assert processes_of(run_dir) == []


def test_the_first_rank_to_die_is_named_with_its_signal_and_phase(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_launcher(run_dir, tiny_dataset, DP2_RECIPE)
    wait_for_steps(proc, run_dir)
    os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
    _, stderr = finish(proc)
    assert proc.returncode == 1
    assert re.search(r"\[launch\] rank 1 failed first: killed by signal 9 \(SIGKILL\) in phase "
                     r"'(step \d+|data|save)'", stderr), stderr
    assert "rank 0: killed or crashed" in stderr
    assert f"last 25 lines of {run_dir}/logs/worker_1.log" in stderr
    # as after Ctrl-C, what to do next: nothing to fix, the rerun resumes (saves every 10 steps: from step 10 or 0)
    assert re.search(r"\[launch\] next: rerun the same command to (resume from step 10 \(the newest complete "
                     r"checkpoint, .*\)|start over \(no checkpoint is complete\))$", stderr.rstrip()), stderr
    assert processes_of(run_dir) == []


def test_internal_error_is_one_line_and_a_saved_traceback(tmp_path):
    code = ("import sys, ascend_llm_recipes.training.launcher.cli as launch\n"
            "def broken(*args, **kwargs):\n    raise RuntimeError('boom')\n"
            "launch.load_recipe = broken\n"
            f"sys.exit(launch.main([{TINY_RECIPE!r}]))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 70
    assert "Traceback" not in result.stderr
    match = re.search(r"internal error \(a bug in ascend-llm-recipes\): RuntimeError: boom\n"
                      r"  the traceback is saved in (\S+); please report it", result.stderr)
    assert match, result.stderr
    with open(match.group(1)) as f:
        saved = f.read()
    assert "Traceback (most recent call last)" in saved and "RuntimeError: boom" in saved
    os.remove(match.group(1))


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
    from ascend_llm_recipes.training.launcher.cluster import first_slurm_host, resolve_cluster
    from ascend_llm_recipes.training.recipe.loading import load_recipe
    from ascend_llm_recipes.common.errors import LaunchError

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
    # Wrong cluster arguments are named, never taken for one node or reported as a bug.
    with pytest.raises(LaunchError, match=r"--nodes 0: the node count must be at least 1"):
        resolve_cluster(recipe, nodes=0, env={"SLURM_NNODES": "4"})
    with pytest.raises(LaunchError, match=r"--node-rank 4 must be in \[0, 4\).*\n.*number the nodes 0 \.\. nodes-1"):
        resolve_cluster(recipe, nodes=4, node_rank=4, env={})
    with pytest.raises(LaunchError, match=r"SLURM_NNODES='x' is not a whole number"):
        resolve_cluster(recipe, env={"SLURM_NNODES": "x"})
    for port in (0, 65535, 99999):
        with pytest.raises(LaunchError, match=rf"--master-port {port}: must be in \[1, 65534\]"):
            resolve_cluster(recipe, nodes=4, node_rank=0, master_port=port, env={})
    from ascend_llm_recipes.training.launcher.cli import main
    with pytest.raises(SystemExit):
        main([TINY_RECIPE, "--rendezvous-timeout", "0"])


def test_msrun_and_its_workers_run_the_launchers_python(tmp_path):
    """Not the `msrun` on PATH: a pyenv shim puts pyenv's own python first, and msrun starts workers as `python`."""
    from ascend_llm_recipes.training.launcher.cluster import Cluster, msrun_command, worker_env

    command = msrun_command(Cluster(1, 0, "127.0.0.1", 8118, 2, 2), str(tmp_path))
    assert command[:3] == [sys.executable, "-m", "mindspore.parallel.cluster.run"]
    assert worker_env(str(tmp_path), 2)["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)


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


def test_msrun_binds_cores_on_ascend_only(tmp_path):
    """The command msrun's own argument parser reads: --bind_core=True for an Ascend recipe, absent on CPU."""
    from mindspore.parallel.cluster.run import get_args
    from ascend_llm_recipes.training.launcher.cluster import binds_cores, msrun_command, resolve_cluster
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    parsed = {}
    for name in ("llama2_7b_8dev", "tiny_dp2_cpu"):
        recipe = load_recipe(os.path.join(REPO_ROOT, "recipes", f"{name}.yaml"), [f"output_dir={tmp_path}/{name}"],
                             planning=True)
        command = msrun_command(resolve_cluster(recipe, env={}), str(tmp_path), binds_cores(recipe))
        old_argv = sys.argv
        try:
            # [python, -m, mindspore.parallel.cluster.run, options...]: argv as msrun's parser sees it
            assert command[1:3] == ["-m", "mindspore.parallel.cluster.run"]
            sys.argv = command[2:command.index("--run-dir")]
            parsed[name] = get_args()
        finally:
            sys.argv = old_argv
    assert parsed["llama2_7b_8dev"].bind_core is True and parsed["llama2_7b_8dev"].worker_num == 8
    assert parsed["tiny_dp2_cpu"].bind_core is False and parsed["tiny_dp2_cpu"].worker_num == 2


@pytest.mark.parametrize("name", ["llama2_7b_8dev", "llama2_13b_8dev", "llama2_70b_32dev", "dense_100b_64dev",
                                  "demo_cpu", "tiny_dp2_cpu", "llama2_7b_910a_16dev"])
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


@pytest.mark.drill
def test_stalled_worker_is_named_by_rank_and_phase(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    # hang_timeout is the limit of a running step (~40 ms here; seconds on a loaded machine); the start-up (imports,
    # graph compile: ~30 s on a loaded 2-core machine) has the generous startup_timeout.
    proc = start_launcher(run_dir, tiny_dataset, TINY_RECIPE, "--set", "monitoring.hang_timeout=10",
                          "--set", "monitoring.startup_timeout=600")
    wait_for_steps(proc, run_dir)
    pid = rank_pid(run_dir, 0)
    os.kill(pid, signal.SIGSTOP)  # a hang: alive, silent
    try:
        _, stderr = finish(proc)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 3
    assert re.search(r"rank 0 stalled in phase '(data|step \d+|save)' for \d+ s \(monitoring\.hang_timeout 10 s\)",
                     stderr), stderr
    assert re.search(r"rank 0: killed or crashed \(last phase '(data|step \d+|save)'", stderr), stderr
    assert processes_of(run_dir) == []


def test_a_run_directory_with_checkpoints_but_no_recipe_is_not_trained_over(tiny_dataset, tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_00000006"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    result = run_launcher(TINY_RECIPE, "--set", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                          "--set", f"output_dir={tmp_path}/run")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "holds a run's checkpoints and metrics.jsonl but no recipe.yaml" in result.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (tmp_path / "run" / "recipe.yaml").exists()


def test_dry_run_flag_needs_check(tmp_path):
    result = run_launcher(TINY_RECIPE, "--dry-run", "--set", f"output_dir={tmp_path}/run")
    assert result.returncode == 2 and "--dry-run goes with --check" in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_process_blocked_holding_the_gil_still_stops_when_its_launcher_is_gone():
    """msrun's scheduler blocks in init() holding the GIL, where a watchdog thread never runs (it kept a killed
    launcher's job alive ~10 minutes): the watchdog process kills it. libc sleep through ctypes.PyDLL keeps the GIL."""
    from ascend_llm_recipes.training.launcher.job import LAUNCHER_ENV, process_id

    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    blocked = {}
    try:
        for how in ("watch_launcher(lambda pid: os._exit(3))", "watch_launcher_from_a_child('scheduler')"):
            code = ("import ctypes, os\n"
                    "from ascend_llm_recipes.training.launcher.job import (watch_launcher,\n"
                    "                                                      watch_launcher_from_a_child)\n"
                    f"{how}\nctypes.PyDLL(None).sleep(20)\n")
            blocked[how] = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True,
                                            env=dict(os.environ, **{LAUNCHER_ENV: process_id(launcher.pid)}))
        time.sleep(2)  # both are asleep in C, their watchdogs started
        launcher.kill()
        launcher.wait()
        thread, child = blocked.values()
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert "[scheduler] the launcher (pid" in child.stderr.read()
        assert thread.poll() is None  # the thread version is still blocked: the defect this guards against
    finally:
        for p in (launcher, *blocked.values()):
            p.kill()
            p.wait()
