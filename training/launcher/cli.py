"""`scripts/run_distributed.sh RECIPE [--set key=value ...] [--plan | --check] [cluster options]`.

Everything that can be checked is checked here, in one process, before any worker starts:
the recipe, the environment (preflight), the dataset (prepared on first use when the recipe
says how), and the run directory. Workers then start from the resolved recipe saved in the
run directory, through msrun (a one-process CPU run: the worker alone, started by the
launcher); when one fails, the exit code is non-zero and the failing rank's last log lines
are shown. `DRY_RUN=1` prints the command instead of running it.

One node or many: `--nodes N --node-rank R --master-addr HOST --master-port P`, or the
same read from Slurm's variables (training/launcher/cluster.py). This module parses the command
line and runs the steps in order; the job is watched by training/launcher/supervision.py and a
failure named by training/launcher/failure_report.py. Exit codes: 0 done, 1 a rank failed, 2 bad
input or preflight errors, HANG_EXIT_CODE .. NODE_LOST_EXIT_CODE below, 70 a bug.
"""

import argparse
import json
import os
import shlex
import signal
import sys

from ascend_llm_recipes.common.errors import LaunchError, PretrainError
from ascend_llm_recipes.training.launcher.cluster import (DEFAULT_MULTINODE_PORT, WORKER_SCRIPT, Cluster, job_command,
                                                          msrun_log_name, resolve_cluster, starts_worker_directly,
                                                          worker_env)
from ascend_llm_recipes.training.launcher.datasets import check_load_checkpoint, ensure_dataset, last_step
from ascend_llm_recipes.training.launcher.failure_report import describe_exit, failed_ranks, report_failure
from ascend_llm_recipes.training.launcher.job import RunDirLock, describe_holder
from ascend_llm_recipes.training.launcher.rendezvous import (DEFAULT_RENDEZVOUS_TIMEOUT, NodeGroup,
                                                             check_node_address, open_rendezvous, report_lost)
from ascend_llm_recipes.training.launcher.resume import check_data_position, prepare_run_dir, resumed_step
from ascend_llm_recipes.training.launcher.supervision import run_watched
from ascend_llm_recipes.training.rank_status import read_heartbeat, read_status
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.recipe.schema import Recipe
from ascend_llm_recipes.training.run_files import AMENDMENTS, LOCK_FILE, LOGS, RESOLVED_RECIPE, SUMMARY

HANG_EXIT_CODE = 3
PREEMPTED_EXIT_CODE = 4   # stopped on request (SIGTERM, Ctrl-C): each rank saved at the end of its step
KILLED_EXIT_CODE = 5      # stopped hard (a second Ctrl-C, or the grace ran out): nothing saved at the stop
NODE_LOST_EXIT_CODE = 6   # another node's launcher died, fell silent or failed: this node's part was stopped
INTERNAL_ERROR_EXIT_CODE = 70


def requested_rollback(run_dir: str, ranks):
    """The rollback record this node's ranks stopped for (a loss spike, anomaly.on_spike: rollback), or None."""
    for rank in ranks:
        status = read_status(run_dir, rank)
        if status and status.get("rollback"):
            return status["rollback"]
    return None


def job_complete(run_dir: str, ranks) -> bool:
    """Every rank of this node wrote 'done' and, on the node of rank 0, the summary's final checkpoint is complete."""
    from ascend_llm_recipes.training.checkpoint import complete_steps

    if any((read_status(run_dir, r) or {}).get("state") != "done" for r in ranks):
        return False
    if 0 not in ranks:
        return True
    try:
        with open(os.path.join(run_dir, SUMMARY), encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    return summary.get("checkpoint") is None or summary["last_step"] in complete_steps(run_dir)


def format_summary(summary: dict) -> str:
    mfu = f"MFU {summary['mfu']:.1%}, " if summary.get("mfu") is not None else ""
    ended = "interrupted after" if summary.get("preempted") else "done:"
    return (f"[launch] {ended} {summary['steps']} steps ({summary['tokens']:,} tokens), loss "
            f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, {summary['tokens_per_s']:,.0f} tokens/s "
            f"({mfu}data wait {summary['data_wait']:.1%}) after a {summary['first_step_time']:.1f} s first step "
            f"(graph compile ~{summary['compile_time']:.1f} s), graph mode "
            f"{'throughout' if summary['graph_mode'] else 'NOT throughout'}.\n"
            f"[launch] run directory: {summary['run_dir']}\n"
            f"[launch] checkpoint: {summary['checkpoint']}")


def preflight(recipe: Recipe, master_port: int = None) -> list:
    """Run the environment checks and print them."""
    from ascend_llm_recipes.training.launcher.preflight import format_findings, run_checks

    findings = run_checks(recipe, master_port=master_port)
    print(format_findings(findings), flush=True)
    return findings


def plan_report(recipe: Recipe, device: str = None) -> str:
    from ascend_llm_recipes.training.tools.plan_report import format_plan
    from ascend_llm_recipes.training.tools.planner import plan

    return format_plan(plan(recipe, device=device))


def launch(recipe_path: str, overrides=(), show_progress: bool = True, nodes: int = None, node_rank: int = None,
           master_addr: str = None, master_port: int = None, dry_run: bool = False, amend: bool = False,
           rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT) -> int:
    """Validate, check, prepare, then run msrun (or a one-process CPU run's worker); returns the exit code.

    `amend`: continue a run whose recipe changed, recording the change (continue_run).
    On several nodes, node 0 prepares the (shared) run directory and the others join it first
    (training/launcher/rendezvous.py): `rendezvous_timeout` bounds how long any node waits for the others.
    """
    from ascend_llm_recipes.training.launcher.preflight import has_errors, hccl_env

    if not os.path.isfile(WORKER_SCRIPT):  # a non-editable install carries the package, not scripts/ or recipes/
        raise LaunchError(f"the training worker {WORKER_SCRIPT} is missing: ascend_llm_recipes is installed without "
                          "its repository (pip install . copies the package only)",
                          hint="install it editable from a checkout: pip install -e /path/to/checkout")
    recipe = load_recipe(recipe_path, tuple(overrides))
    cluster = resolve_cluster(recipe, nodes, node_rank, master_addr, master_port)
    if cluster.nodes > 1 and not dry_run:
        check_node_address(cluster.nodes, cluster.node_rank, cluster.master_addr, cluster.master_port)
    # msrun's scheduler listens on the master port; a worker started without msrun (starts_worker_directly) uses none.
    uses_port = cluster.node_rank == 0 and not starts_worker_directly(recipe, cluster)
    findings = preflight(recipe, master_port=cluster.master_port if uses_port else None)
    hccl = hccl_env(recipe)
    if dry_run:
        command = job_command(recipe, cluster, os.path.abspath(recipe.output_dir))
        print("[dry-run] " + shlex.join([f"{k}={v}" for k, v in sorted(hccl.items())] + command))
        return 2 if has_errors(findings) else 0
    if has_errors(findings):
        raise LaunchError("preflight found errors (above); nothing was started",
                          hint="fix them, or see `bash scripts/run_distributed.sh RECIPE --check`")
    group = open_rendezvous(cluster, recipe, rendezvous_timeout,
                            lambda k: join_command(recipe_path, overrides, cluster, k, amend, rendezvous_timeout))
    try:
        code = launch_node(recipe, recipe_path, cluster, findings, hccl, amend, show_progress, group)
    except BaseException as err:
        if group is not None:
            stopped = f"node {cluster.node_rank}'s launcher stopped ({type(err).__name__})"
            group.abort(getattr(err, "message", "") or stopped)
        raise
    if group is not None:
        # A stop on request is all-reduced (every rank stops and saves at the same step): not a failure for the others.
        group.end(code, ok=code in (0, PREEMPTED_EXIT_CODE))
    return code


def launch_node(recipe: Recipe, recipe_path: str, cluster: Cluster, findings: list, hccl: dict, amend: bool,
                show_progress: bool, group: NodeGroup = None) -> int:
    """This node's part once the checks passed: node 0 (or the only node) owns and prepares the run directory."""
    if cluster.node_rank == 0:
        ensure_dataset(recipe, show_progress)
        check_load_checkpoint(recipe)
        with lock_run_dir(recipe, cluster):
            if group is not None:
                group.wait_joined()  # before the run directory is touched
            return run_job(recipe, recipe_path, cluster, findings, hccl, amend, group)
    nothing_to_do = group.prepared(recipe.output_dir)  # the run directory (and dataset) node 0 prepared
    if nothing_to_do:
        print(f"[launch] {nothing_to_do}", flush=True)
        return 0
    ensure_dataset(recipe, show_progress)
    check_load_checkpoint(recipe)
    group.start()
    return run_job(recipe, recipe_path, cluster, findings, hccl, amend, group)


def join_command(recipe_path: str, overrides, cluster: Cluster, node_rank: int, amend: bool,
                 rendezvous_timeout: float) -> str:
    """The command another node runs to join this launch."""
    parts = ["bash", "scripts/run_distributed.sh", recipe_path, *[a for o in overrides for a in ("--set", o)],
             "--nodes", str(cluster.nodes), "--node-rank", str(node_rank), "--master-addr", cluster.master_addr,
             "--master-port", str(cluster.master_port)]
    if amend:
        parts.append("--amend")
    if rendezvous_timeout != DEFAULT_RENDEZVOUS_TIMEOUT:
        parts += ["--rendezvous-timeout", f"{rendezvous_timeout:g}"]
    return shlex.join(parts)


def lock_run_dir(recipe: Recipe, cluster: Cluster) -> RunDirLock:
    """Own the run directory for this launch; a stale lock left by a dead launcher is taken over.

    On several nodes only node 0 takes it: the others join node 0's launch at the rendezvous,
    which admits one launcher per node rank.
    """
    run_dir = os.path.abspath(recipe.output_dir)
    lock = RunDirLock(run_dir, LOCK_FILE)
    stale = lock.acquire()
    if stale:
        print(f"[launch] warning: taking over the stale lock {lock.path} of a launch that is gone "
              f"({describe_holder(stale)})", flush=True)
    return lock


def run_job(recipe: Recipe, recipe_path: str, cluster: Cluster, findings: list, hccl: dict,
            amend: bool = False, group: NodeGroup = None) -> int:
    """Prepare the (locked) run directory, run msrun (or the only worker) until the job ends, report; returns the
    exit code.

    On several nodes node 0 prepares the run directory, then starts every node (`group`).
    """
    from ascend_llm_recipes.data.loader import SKIPS_FILE
    from ascend_llm_recipes.training.launcher.preflight import write_findings

    if cluster.node_rank == 0:
        run_dir = prepare_run_dir(recipe, recipe_path, amend)
        if recipe.resume_training and recipe.load_checkpoint and \
                not os.path.abspath(recipe.load_checkpoint).startswith(run_dir + os.sep):
            check_data_position(recipe, run_dir)  # resuming another run's checkpoint in a new run directory
        last, why = last_step(recipe)  # stop_step, or the data's last step (a rerun must not train past it)
        if recipe.resume_training and 0 < last <= resumed_step(recipe):
            done = f"{run_dir} is already complete (step {resumed_step(recipe)} of {why}); nothing to do"
            print(f"[launch] {done}", flush=True)
            if group is not None:
                group.start(run_dir, nothing_to_do=done)
            return 0
        write_findings(findings, run_dir)
        if group is not None:
            group.start(run_dir)
    else:
        run_dir = recipe.output_dir
    print(f"[launch] resolved recipe (saved as {os.path.join(run_dir, RESOLVED_RECIPE)}):\n{recipe.to_yaml()}",
          flush=True)
    direct = starts_worker_directly(recipe, cluster)
    command = job_command(recipe, cluster, run_dir)
    env = worker_env(run_dir, cluster.local_workers, hccl, direct)
    if group is not None:
        group.heartbeats = lambda ranks: {rank: read_heartbeat(run_dir, rank) for rank in ranks}
    print(f"[launch] node {cluster.node_rank} of {cluster.nodes}: ranks {cluster.ranks.start}-"
          f"{cluster.ranks.stop - 1} of {cluster.world_size}; "
          + " ".join(f"{k}={v}" for k, v in sorted(hccl.items())), flush=True)
    print(f"[launch] {'one CPU worker, started without msrun: ' if direct else ''}{shlex.join(command)}", flush=True)
    if cluster.local_workers > 1:
        print(f"[launch] showing rank {cluster.ranks.start}'s output; every rank's is in "
              f"{os.path.join(run_dir, LOGS, 'worker_N.log')}", flush=True)
    while True:
        outcome = run_watched(command, env, run_dir, cluster.ranks, recipe.monitoring.hang_timeout,
                              msrun_log=msrun_log_name(cluster), nodes=group, direct=direct,
                              startup_timeout=recipe.monitoring.startup_timeout)
        complete = job_complete(run_dir, cluster.ranks)
        lost = outcome.node_lost or (group.problem() if group is not None and not complete else "")
        if lost:
            print(report_lost(lost, cluster, run_dir), file=sys.stderr, flush=True)
            return NODE_LOST_EXIT_CODE
        reported_failure = any(state == "failed" for _, state, _ in failed_ranks(run_dir, cluster.ranks))
        if outcome.stopped_by and not complete and not reported_failure:
            print(f"[launch] stopped ({outcome.stopped_by}) "
                  + (f"hard ({outcome.killed}): the job's processes were killed without saving"
                     if outcome.killed else "before every rank could save (they were still starting)")
                  + "; no process of the job is left; rerun the same command to resume from the newest checkpoint",
                  file=sys.stderr, flush=True)
            return KILLED_EXIT_CODE if outcome.killed else PREEMPTED_EXIT_CODE
        if outcome.hung:
            print(report_failure(run_dir, cluster, outcome, group), file=sys.stderr, flush=True)
            return HANG_EXIT_CODE
        if complete and outcome.returncode != 0:
            ended = ("was " if outcome.returncode < 0 else "") + describe_exit(outcome.returncode)
            print(f"[launch] note: {'the worker' if direct else 'msrun'} {ended} after every rank had finished and "
                  "saved (a process ended badly during teardown); the run is complete", flush=True)
        elif outcome.returncode != 0 or failed_ranks(run_dir, cluster.ranks):
            print(report_failure(run_dir, cluster, outcome, group), file=sys.stderr, flush=True)
            return 1
        rollback = requested_rollback(run_dir, cluster.ranks)
        if rollback is None:
            break
        if cluster.nodes > 1:  # one node's launcher cannot restart the others' msrun: every node reruns
            print(f"[launch] loss spike at step {rollback['spike_step']}: rerun the command on every node to roll back "
                  f"to step {rollback['rolled_back_to']}, skipping {rollback['skipped_samples']} samples (see "
                  f"{os.path.join(run_dir, SKIPS_FILE)})", file=sys.stderr, flush=True)
            return PREEMPTED_EXIT_CODE
        # A loss spike: the workers stopped at the spike step and recorded the samples to skip;
        # resume from the newest checkpoint before it, as a rerun of the same command would.
        print(f"[launch] loss spike at step {rollback['spike_step']}: rolling back to step "
              f"{rollback['rolled_back_to']} and skipping {rollback['skipped_samples']} samples (steps "
              f"{rollback['skipped_steps'][0]}-{rollback['skipped_steps'][1]}); see "
              f"{os.path.join(run_dir, SKIPS_FILE)}", flush=True)
        run_dir = prepare_run_dir(recipe, recipe_path, amend)
    if cluster.node_rank == 0:
        with open(os.path.join(run_dir, SUMMARY), encoding="utf-8") as f:
            summary = json.load(f)
        print(format_summary(summary), flush=True)
        if summary.get("preempted"):
            why = f"stopped ({outcome.stopped_by})" if outcome.stopped_by else "preempted (SIGTERM)"
            print(f"[launch] {why} after step {summary['last_step']}, checkpoint saved, no process of the job left; "
                  f"rerun the same command{' on every node' if cluster.nodes > 1 else ''} to resume", flush=True)
            return PREEMPTED_EXIT_CODE
    preempted = any((read_status(run_dir, r) or {}).get("preempted") for r in cluster.ranks)
    if cluster.node_rank > 0:  # node 0 prints the run's summary; this node says how its part ended
        print(f"[launch] node {cluster.node_rank}: ranks {cluster.ranks.start}-{cluster.ranks.stop - 1} "
              + ("stopped on request (another node was interrupted), checkpoint saved; rerun the command on every "
                 "node to resume" if preempted else "finished") + f"; node 0 prints the run's summary ({run_dir})",
              flush=True)
    return PREEMPTED_EXIT_CODE if preempted else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/run_distributed.sh",
                                     description="Validate a recipe, prepare its data, and train (through msrun, "
                                                 "or a one-process CPU run's worker alone).")
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/demo_cpu.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override a recipe key (repeatable), e.g. --set runner_config.stop_step=50")
    parser.add_argument("--plan", action="store_true",
                        help="print per-device memory and step time, then exit (works for Ascend recipes on CPU)")
    parser.add_argument("--device", help="with --plan: device from the planner's table (default hardware.device)")
    parser.add_argument("--check", action="store_true", help="run the preflight checks only")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --check: compile one rank per pipeline stage under MindSpore's DryRun instead "
                             "(needs CANN, real or simulated: python -m ascend_llm_recipes.training.tools.simulated_cann)")
    parser.add_argument("--layers", type=int, metavar="N",
                        help="with --dry-run: compile the recipe's layout at N layers (a multiple of the pipeline "
                             "stages) where its full depth takes too long or too much memory on this host")
    parser.add_argument("--nodes", type=int, help="number of nodes (default: SLURM_NNODES or 1)")
    parser.add_argument("--node-rank", type=int, help="this node's index (default: SLURM_NODEID or 0)")
    parser.add_argument("--master-addr", help="node 0's address (default: first Slurm host or 127.0.0.1)")
    parser.add_argument("--master-port", type=int, help=f"default {DEFAULT_MULTINODE_PORT} on several nodes (node 0's "
                                                        "launcher also listens on the next port, for the rendezvous)")
    parser.add_argument("--rendezvous-timeout", type=float, default=DEFAULT_RENDEZVOUS_TIMEOUT, metavar="SECONDS",
                        help="on several nodes: how long a node waits for the others to join before giving up "
                             f"(default {DEFAULT_RENDEZVOUS_TIMEOUT})")
    parser.add_argument("--amend", action="store_true",
                        help=f"continue a run with a changed recipe; the change is recorded in RUN_DIR/{AMENDMENTS}")
    args = parser.parse_args(argv)
    if not args.rendezvous_timeout > 0:
        parser.error(f"--rendezvous-timeout {args.rendezvous_timeout:g}: must be more than 0 seconds")
    if args.layers is not None and not args.dry_run:
        parser.error("--layers goes with --check --dry-run")
    if args.dry_run and not args.check:
        parser.error("--dry-run goes with --check (a compile-only check); to print the training command without "
                     "running it, set DRY_RUN=1")
    # Until the job runs (run_watched handles them then), SIGTERM and SIGHUP stop the launcher as Ctrl-C does.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    try:
        if args.plan:
            print(plan_report(load_recipe(args.recipe, tuple(args.overrides), planning=True), args.device))
            return 0
        if args.check:
            from ascend_llm_recipes.training.launcher.preflight import has_errors
            if args.dry_run:
                from ascend_llm_recipes.training.tools.dryrun import dry_run_compile
                return dry_run_compile(load_recipe(args.recipe, tuple(args.overrides), planning=True), args.recipe,
                                       layers=args.layers,
                                       print_only=os.environ.get("DRY_RUN", "") not in ("", "0"))
            recipe = load_recipe(args.recipe, tuple(args.overrides))
            return 2 if has_errors(preflight(recipe, master_port=args.master_port)) else 0
        return launch(args.recipe, args.overrides, nodes=args.nodes, node_rank=args.node_rank,
                      master_addr=args.master_addr, master_port=args.master_port,
                      dry_run=os.environ.get("DRY_RUN", "") not in ("", "0"), amend=args.amend,
                      rendezvous_timeout=args.rendezvous_timeout)
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("[launch] interrupted; no process of the job is running", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except OSError as err:  # the machine said no (permissions, a full disk, a path that is a file): not a bug
        where = f": {err.filename}" if err.filename else ""
        print(f"error: {err.strerror or err}{where}", file=sys.stderr)
        return 2
    except Exception as err:
        print(internal_error(err), file=sys.stderr)
        return INTERNAL_ERROR_EXIT_CODE


def internal_error(err: Exception) -> str:
    """One line for a bug: the traceback goes to a file, whose path the line gives."""
    import tempfile
    import traceback

    fd, path = tempfile.mkstemp(prefix="ascend-llm-recipes-error-", suffix=".txt")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"{shlex.join(sys.argv)}\n\n{traceback.format_exc()}")
    return (f"internal error (a bug in ascend-llm-recipes): {type(err).__name__}: {err}\n"
            f"  the traceback is saved in {path}; please report it with that file")


if __name__ == "__main__":
    sys.exit(main())
