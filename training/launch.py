"""`scripts/run_distributed.sh RECIPE [--set key=value ...]`: validate, prepare, launch, report.

Everything that can be checked is checked here, in one process, before msrun starts any
worker: the recipe, the dataset (prepared on first use when the recipe says how), and
the run directory. Workers then start from the resolved recipe saved in the run
directory; when one fails, the exit code is non-zero and the failing rank's last log
lines are shown.
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys

from training.errors import LaunchError, PretrainError
from training.recipe import Recipe, load_recipe
from training.train import RESOLVED_RECIPE, SUMMARY

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_SCRIPT = os.path.join(REPO_ROOT, "scripts", "train.py")
LOG_TAIL_LINES = 25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_dataset(recipe: Recipe, show_progress: bool = True) -> dict:
    """Return the dataset manifest, preparing the dataset first when it is missing and the recipe says how."""
    from data.mindrecord_io import MANIFEST
    from data.prepare import check_dataset, prepare_dataset, summary

    model = recipe.model.model_config
    dataset_dir = recipe.dataset_dir
    prep = recipe.data_preparation
    if prep is not None and not os.path.isfile(os.path.join(dataset_dir, MANIFEST)) \
            and not os.path.exists(dataset_dir):
        print(f"[launch] dataset {dataset_dir} not found: preparing it from {prep.source} "
              f"(vocabulary {prep.vocab_size}, seq_length {model.seq_length}); later runs reuse it", flush=True)
        manifest = prepare_dataset(dataset_dir, model.seq_length, prep.vocab_size, source=prep.source,
                                   max_documents=prep.max_documents, show_progress=show_progress)
        print("[launch] " + summary(dataset_dir, manifest), flush=True)
    return check_dataset(dataset_dir, model.seq_length, model.vocab_size, model.pad_token_id,
                         model.eos_token_id)


def prepare_run_dir(recipe: Recipe, recipe_path: str) -> str:
    """Create the run directory and save the resolved recipe in it (absolute paths)."""
    run_dir = os.path.abspath(recipe.output_dir)
    if os.path.exists(os.path.join(run_dir, RESOLVED_RECIPE)):
        raise LaunchError(f"output_dir {run_dir} already holds a run (from {recipe_path} or another recipe)",
                          hint="resuming is not supported yet; choose a new directory with "
                               "--set output_dir=..., or move the old run away")
    os.makedirs(run_dir, exist_ok=True)
    recipe.output_dir = run_dir
    recipe.train_dataset.data_loader.dataset_dir = os.path.abspath(recipe.dataset_dir)
    with open(os.path.join(run_dir, RESOLVED_RECIPE), "w", encoding="utf-8") as f:
        f.write(f"# resolved from {os.path.abspath(recipe_path)}\n")
        f.write(recipe.to_yaml())
    return run_dir


def msrun_command(recipe: Recipe, run_dir: str, master_port: int) -> list:
    msrun = shutil.which("msrun")
    if msrun is None:
        raise LaunchError("msrun not found on PATH", hint="install the repository: pip install -e .")
    n = recipe.world_size
    return [msrun, f"--worker_num={n}", f"--local_worker_num={n}", f"--master_port={master_port}",
            f"--log_dir={os.path.join(run_dir, 'logs')}", "--join=True",
            WORKER_SCRIPT, "--run-dir", run_dir]


def worker_env(run_dir: str, local_workers: int) -> dict:
    """Environment for msrun and its workers."""
    env = dict(os.environ, LOCAL_DEFAULT_PATH=run_dir,
               PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
    # msrun sets OMP_NUM_THREADS=1 unless it is already set, which halves CPU kernel speed
    # on a 2-core machine; share the cores between the local workers instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local_workers)))
    return env


def failed_ranks(run_dir: str, world_size: int) -> list:
    """(rank, state, error) for each rank that did not finish: failed, or died without a word."""
    failed = []
    for rank in range(world_size):
        path = os.path.join(run_dir, "status", f"rank_{rank}.json")
        try:
            with open(path, encoding="utf-8") as f:
                status = json.load(f)
        except (OSError, json.JSONDecodeError):
            failed.append((rank, "never started", ""))
            continue
        if status["state"] != "done":
            state = "killed or crashed" if status["state"] == "running" else status["state"]
            failed.append((rank, state, status.get("error", "")))
    return failed


def tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return f"(no log at {path})\n"


def failure_report(run_dir: str, world_size: int, returncode: int) -> str:
    ranks = failed_ranks(run_dir, world_size) or [(None, "unknown", "")]
    parts = [f"[launch] training failed (msrun exit code {returncode})"]
    for rank, state, error in ranks:
        if rank is None:
            parts.append("no rank reported a failure; see the logs in " + os.path.join(run_dir, "logs"))
            continue
        log = os.path.join(run_dir, "logs", f"worker_{rank}.log")
        parts.append(f"rank {rank}: {state}{': ' + error if error else ''}\n"
                     f"--- last {LOG_TAIL_LINES} lines of {log} ---\n{tail(log)}---")
    return "\n".join(parts)


def format_summary(summary: dict) -> str:
    return (f"[launch] done: {summary['steps']} steps ({summary['tokens']:,} tokens), loss "
            f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, {summary['tokens_per_s']:,.0f} tokens/s "
            f"after a {summary['first_step_time']:.1f} s first step (graph compile), graph mode "
            f"{'throughout' if summary['graph_mode'] else 'NOT throughout'}.\n"
            f"[launch] run directory: {summary['run_dir']}\n"
            f"[launch] checkpoint: {summary['checkpoint']}")


def launch(recipe_path: str, overrides=(), show_progress: bool = True) -> int:
    recipe = load_recipe(recipe_path, tuple(overrides))
    ensure_dataset(recipe, show_progress)
    run_dir = prepare_run_dir(recipe, recipe_path)
    print(f"[launch] resolved recipe (saved as {os.path.join(run_dir, RESOLVED_RECIPE)}):\n{recipe.to_yaml()}",
          flush=True)
    command = msrun_command(recipe, run_dir, free_port())
    env = worker_env(run_dir, recipe.world_size)
    print(f"[launch] {recipe.world_size} worker(s): {' '.join(command)}", flush=True)
    returncode = subprocess.call(command, env=env, cwd=run_dir)
    failed = failed_ranks(run_dir, recipe.world_size)
    if returncode != 0 or failed:
        print(failure_report(run_dir, recipe.world_size, returncode), file=sys.stderr, flush=True)
        return returncode or 1
    with open(os.path.join(run_dir, SUMMARY), encoding="utf-8") as f:
        print(format_summary(json.load(f)), flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/run_distributed.sh",
                                     description="Validate a recipe, prepare its data, and train through msrun.")
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/demo_cpu.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override a recipe key (repeatable), e.g. --set runner_config.stop_step=50")
    args = parser.parse_args(argv)
    try:
        return launch(args.recipe, args.overrides)
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
