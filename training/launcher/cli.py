"""`scripts/run_distributed.sh RECIPE [--set key=value ...] [--plan | --check] [cluster options]`.

Everything that can be checked is checked here, in one process, before msrun starts any
worker: the recipe, the environment (preflight), the dataset (prepared on first use when
the recipe says how), and the run directory. Workers then start from the resolved recipe
saved in the run directory; when one fails, the exit code is non-zero and the failing
rank's last log lines are shown. `DRY_RUN=1` prints the msrun command instead of running it.

One node or many: `--nodes N --node-rank R --master-addr HOST --master-port P`, or the
same read from Slurm's variables. Ranks are contiguous per node (node R runs ranks
R x local .. R x local + local - 1), so tensor-parallel groups stay on a node's links.
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from ascend_llm_recipes.training.launcher.datasets import check_load_checkpoint, ensure_dataset
from ascend_llm_recipes.common.errors import LaunchError, PretrainError
from ascend_llm_recipes.training.launcher.job import (LAUNCHER_ENV, RunDirLock, describe_holder, job_processes,
                                             process_id, send, start_time)
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.recipe.schema import Recipe
from ascend_llm_recipes.training.launcher.resume import check_data_position, prepare_run_dir, resumed_step
from ascend_llm_recipes.training.launcher.rendezvous import (DEFAULT_RENDEZVOUS_TIMEOUT, NodeGroup, check_node_address,
                                                    open_rendezvous, report_lost)
from ascend_llm_recipes.training.run_files import (AMENDMENTS, LOCK_FILE, LOGS, MSRUN_LOG, RESOLVED_RECIPE, SUMMARY,
                                                   heartbeat_path, read_status, worker_log)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # realpath: the package may be a symlink
WORKER_SCRIPT = os.path.join(REPO_ROOT, "scripts", "train.py")
LOG_TAIL_LINES = 25
HANG_EXIT_CODE = 3
PREEMPTED_EXIT_CODE = 4   # stopped on request (SIGTERM, Ctrl-C): each rank saved at the end of its step
KILLED_EXIT_CODE = 5      # stopped hard (a second Ctrl-C, or the grace ran out): nothing saved at the stop
MAX_MASTER_PORT = 65534  # the rendezvous listens on master_port + 1
NODE_LOST_EXIT_CODE = 6   # another node's launcher died, fell silent or failed: this node's part was stopped
INTERNAL_ERROR_EXIT_CODE = 70
STOP_GRACE_SECONDS = 120  # after Ctrl-C/SIGTERM: time for the ranks to finish their step and save
FAILURE_GRACE_SECONDS = 10  # after a rank failed: time for msrun to stop the rest before the launcher kills them
SETTLE_SECONDS = 10       # every worker has exited: time for msrun and its scheduler to follow
ENDING_SETTLE_SECONDS = 3  # the same once the job is being stopped (msrun polls its workers every second)
DEFAULT_MULTINODE_PORT = 8118  # every node must name the same port; a random one cannot be shared


@dataclass
class Cluster:
    nodes: int
    node_rank: int
    master_addr: str
    master_port: int
    local_workers: int
    world_size: int

    @property
    def ranks(self) -> range:
        """This node's ranks: contiguous, so tensor-parallel groups never span nodes."""
        start = self.node_rank * self.local_workers
        return range(start, start + self.local_workers)


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist: 'gpu[03-06,09],login1' -> 'gpu03'."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not match:
        return nodelist
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def resolve_cluster(recipe: Recipe, nodes=None, node_rank=None, master_addr=None, master_port=None,
                    env=None) -> Cluster:
    """Node count, this node's rank and the master address, from arguments, then Slurm, then one node."""
    env = os.environ if env is None else env
    nodes = nodes if nodes is not None else _slurm_int(env, "SLURM_NNODES", 1)
    node_rank = node_rank if node_rank is not None else _slurm_int(env, "SLURM_NODEID", 0)
    if nodes < 1:
        raise LaunchError(f"--nodes {nodes}: the node count must be at least 1",
                          hint="pass the number of nodes the job runs on (under Slurm, SLURM_NNODES gives it)")
    if not 0 <= node_rank < nodes:
        raise LaunchError(f"--node-rank {node_rank} must be in [0, {nodes}) for --nodes {nodes}",
                          hint="number the nodes 0 .. nodes-1, node 0 being the one at --master-addr")
    if master_port is not None and not 1 <= master_port <= MAX_MASTER_PORT:
        raise LaunchError(f"--master-port {master_port}: must be in [1, {MAX_MASTER_PORT}] (msrun's scheduler takes "
                          "it and the launchers' rendezvous the port after it)",
                          hint="pick a free port, the same on every node, e.g. the default "
                               f"{DEFAULT_MULTINODE_PORT}")
    if master_addr is None:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        master_addr = first_slurm_host(nodelist) if nodelist and nodes > 1 else "127.0.0.1"
    if master_port is None:
        master_port = DEFAULT_MULTINODE_PORT if nodes > 1 else free_port()
    world = recipe.world_size
    problems = []
    if world % nodes:
        problems.append(f"parallel_config: {world} devices (data x model x pipeline parallel) cannot be split "
                        f"evenly over {nodes} nodes")
    elif recipe.hardware.devices_per_node and world // nodes != recipe.hardware.devices_per_node:
        problems.append(f"hardware.devices_per_node: {recipe.hardware.devices_per_node}, but {world} devices over "
                        f"{nodes} node(s) is {world // nodes} per node; WORLD_SIZE must match the real devices "
                        "or HCCL initialisation hangs")
    if problems:
        raise LaunchError("; ".join(problems), hint="fix the parallel degrees or the node count before launching")
    return Cluster(nodes, node_rank, master_addr, master_port, world // nodes, world)


def _slurm_int(env, name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        raise LaunchError(f"{name}={env.get(name)!r} is not a whole number",
                          hint="run under a real Slurm allocation, or pass --nodes/--node-rank and unset it") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msrun_log_name(cluster: Cluster) -> str:
    """logs/msrun.log, one per node when several nodes share the run directory."""
    return MSRUN_LOG if cluster.nodes == 1 else f"msrun.node_{cluster.node_rank}.log"


def msrun_command(cluster: Cluster, run_dir: str, bind_core: bool = False) -> list:
    """msrun run by this Python (its console script is mindspore.parallel.cluster.run:main).

    The `msrun` on PATH can belong to another installation: a pyenv shim, for one, runs it through
    `pyenv exec`, which puts pyenv's own bin first on PATH, and msrun starts each worker as plain
    `python` (mindspore/parallel/cluster/process_entity/_utils.py:104-106): the workers would then
    import another copy of ascend_llm_recipes than the launcher's, without a word.
    msrun echoes the log of this node's first rank only (every rank records the same agreed step, and
    several `tail -f` into one output interleave): each rank's own log is RUN_DIR/logs/worker_N.log.
    `bind_core` pins each worker to the CPU cores of its device's NUMA node: MindFormers starts every job
    with `msrun --bind_core=True` (scripts/msrun_launcher.sh of r1.8.0, lines 128 and 136); msrun derives
    the binding from the machine (mindspore/parallel/cluster/run.py:178-185). It is used on Ascend; on CPU
    the workers share the few cores through OMP_NUM_THREADS instead (worker_env).
    """
    return [sys.executable, "-m", "mindspore.parallel.cluster.run", *(["--bind_core=True"] if bind_core else []),
            f"--worker_num={cluster.world_size}",
            f"--local_worker_num={cluster.local_workers}",
            f"--master_addr={cluster.master_addr}", f"--master_port={cluster.master_port}",
            f"--node_rank={cluster.node_rank}", f"--log_dir={os.path.join(run_dir, LOGS)}", "--join=True",
            f"--tail_worker_log={cluster.ranks.start}", WORKER_SCRIPT, "--run-dir", run_dir]


def binds_cores(recipe: Recipe) -> bool:
    return recipe.context.device_target == "Ascend"


def worker_env(run_dir: str, local_workers: int, hccl: dict = None) -> dict:
    """Environment for msrun and its workers: identical HCCL settings on every rank, set before init."""
    env = dict(os.environ, LOCAL_DEFAULT_PATH=run_dir)
    # msrun starts the workers as `python`: this Python, the one that imported this package.
    env["PATH"] = os.pathsep.join(p for p in (os.path.dirname(sys.executable), os.environ.get("PATH")) if p)
    env.update(hccl or {})
    # msrun sets OMP_NUM_THREADS=1 unless it is already set, which halves CPU kernel speed
    # on a 2-core machine; share the cores between the local workers instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local_workers)))
    return env


def read_heartbeat(run_dir: str, rank: int):
    try:
        with open(heartbeat_path(run_dir, rank), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def stalled_ranks(run_dir: str, ranks, timeout: float, started: float, now: float = None) -> list:
    """(rank, phase, seconds) for each rank whose last heartbeat is older than `timeout`."""
    now = time.time() if now is None else now
    stalled = []
    for rank in ranks:
        beat = read_heartbeat(run_dir, rank)
        phase, last = (beat["phase"], beat["time"]) if beat else ("not started", started)
        if phase != "done" and now - last > timeout:
            stalled.append((rank, phase, now - last))
    return stalled


@dataclass
class JobOutcome:
    """How a run of msrun ended, as the launcher saw it."""
    returncode: int                # msrun's
    stopped_by: str = ""           # the signal (SIGINT, SIGTERM, SIGHUP) the launcher was stopped with
    killed: str = ""               # why the launcher killed the job's processes, if it did
    hung: bool = False
    seen_failing: dict = field(default_factory=dict)  # rank -> poll round the launcher first saw it fail or die
    node_lost: str = ""            # another node lost during the run (training/launcher/rendezvous.py), why and where
    msrun_log: str = MSRUN_LOG     # this node's msrun output, in RUN_DIR/logs


def run_watched(command: list, env: dict, run_dir: str, ranks, hang_timeout: float, poll: float = 1.0,
                msrun_log: str = MSRUN_LOG, nodes: NodeGroup = None) -> JobOutcome:
    """Run msrun and watch its job until every process of it is gone.

    Stops the job when a rank fails or dies (whatever msrun does meanwhile: its scheduler can
    wait minutes for a rank that is gone), when a rank's heartbeat stops for `hang_timeout`
    seconds, when another node is lost (`nodes`: its ranks are gone, ours would wait on them in
    a collective), and on SIGINT/SIGTERM/SIGHUP: every worker then saves at the end of its current
    step and exits; a second signal, or STOP_GRACE_SECONDS, kills the job at once. msrun's own
    output goes to logs/`msrun_log` (it must not depend on the launcher being alive) and is echoed here.
    """
    launcher = process_id()
    env = dict(env, **{LAUNCHER_ENV: launcher})
    log_path = os.path.join(run_dir, LOGS, msrun_log)
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    outcome, signals = JobOutcome(returncode=0, msrun_log=msrun_log), []
    handlers = {sig: signal.signal(sig, lambda signum, _: signals.append(signal.Signals(signum).name))
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    started, rounds, proc, echo = time.time(), 0, None, None
    deadline, terminated, seen_worker, workers_gone = None, set(), False, None
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, env=env, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        echo = OutputEcho(log_path)
        while True:
            if proc.poll() is not None:
                break
            rounds += 1
            now, processes = time.time(), job_processes(launcher)
            workers = [p for p in processes if p.is_worker]
            seen_worker = seen_worker or bool(workers)
            if signals and not outcome.stopped_by:
                outcome.stopped_by, deadline = signals[0], now + STOP_GRACE_SECONDS
                print(f"[launch] {signals[0]}: stopping the job: every rank saves at the end of its current step and "
                      f"exits (at most {STOP_GRACE_SECONDS} s); {signals[0]} again kills it now",
                      file=sys.stderr, flush=True)
            if outcome.stopped_by:  # workers msrun starts late get the signal too
                send([p for p in workers if p.pid not in terminated], signal.SIGTERM)
                terminated.update(p.pid for p in workers)
            failing = [r for r in ranks if r not in outcome.seen_failing and rank_failing(run_dir, r, started)]
            outcome.seen_failing.update((rank, rounds) for rank in failing)
            if failing and deadline is None:
                print(f"[launch] rank {', '.join(map(str, failing))} failed: stopping the job", file=sys.stderr,
                      flush=True)
                deadline = now + FAILURE_GRACE_SECONDS  # msrun stops the other workers itself; the scheduler may not
            stalled = [] if deadline is not None else stalled_ranks(run_dir, ranks, hang_timeout, started, now)
            for rank, phase, seconds in stalled:
                print(f"[launch] rank {rank} stalled in phase '{phase}' for {seconds:.0f} s "
                      f"(monitoring.hang_timeout {hang_timeout} s); stopping the job", file=sys.stderr, flush=True)
            workers_gone = (workers_gone or now) if seen_worker and not workers else None
            outcome.node_lost = nodes.problem() if nodes is not None else ""
            # Once the job is ending, msrun only needs to note how its workers exited.
            settle = SETTLE_SECONDS if deadline is None else ENDING_SETTLE_SECONDS
            why = (outcome.node_lost if outcome.node_lost else
                   "a rank stalled" if stalled else
                   f"second {signals[1]}" if len(signals) > 1 else
                   "the grace period ran out" if deadline is not None and now > deadline else
                   "its workers are gone" if workers_gone and now - workers_gone > settle else "")
            if why:
                outcome.hung = outcome.hung or bool(stalled)
                if why != "its workers are gone":
                    outcome.killed = why
                kill_job(proc, launcher)
                break
            time.sleep(poll)
        outcome.returncode = proc.wait()
        kill_job(proc, launcher)  # nothing of the job outlives its launch
    except BaseException:
        if proc is not None:
            kill_job(proc, launcher)
        raise
    finally:
        if echo is not None:
            echo.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return outcome


class OutputEcho:
    """Copies msrun's log to stdout from a thread, so a slow or full stdout never holds up the watch."""

    def __init__(self, path: str):
        self.path = path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="msrun-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset = 0
        while True:
            last = self._stop.is_set()
            offset = echo_new_output(self.path, offset)
            if last:
                return
            self._stop.wait(0.5)

    def close(self, timeout: float = 5.0) -> None:
        """Copy what is left, waiting at most `timeout` seconds for stdout."""
        self._stop.set()
        self._thread.join(timeout)


def echo_new_output(path: str, offset: int) -> int:
    """Copy what msrun wrote to `path` since `offset` to stdout; returns the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return offset
    if data:
        try:
            sys.stdout.flush()
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
        except (OSError, ValueError):  # the terminal is gone (SIGHUP follows): keep watching the job
            pass
    return offset + len(data)


def kill_job(proc: subprocess.Popen, launcher: str) -> None:
    """SIGKILL msrun's process group and every process of the job (workers run in sessions of their own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.time() + 10
    while True:
        left = job_processes(launcher)
        if not left or time.time() > deadline:
            break
        send(left, signal.SIGKILL)
        time.sleep(0.2)
    proc.wait()


def rank_failing(run_dir: str, rank: int, since: float) -> bool:
    """The rank's status (written after `since`) says failed, or says running while its process is gone."""
    status = read_status(run_dir, rank)
    if status is None or status["state"] == "done" or status["time"] < since:
        return False
    return status["state"] == "failed" or start_time(status.get("pid", 0)) is None


def requested_rollback(run_dir: str, ranks):
    """The rollback record this node's ranks stopped for (a loss spike, anomaly.on_spike: rollback), or None."""
    for rank in ranks:
        status = read_status(run_dir, rank)
        if status and status.get("rollback"):
            return status["rollback"]
    return None


def failed_ranks(run_dir: str, ranks) -> list:
    """(rank, state, error) for each of `ranks` that did not finish: failed, or died without a word."""
    failed = []
    for rank in ranks:
        status = read_status(run_dir, rank)
        if status is None:
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


def msrun_exit_codes(run_dir: str, msrun_log: str = MSRUN_LOG) -> dict:
    """{pid: exit code} of the workers msrun saw exit with an error (negative: killed by that signal)."""
    codes = {}
    try:
        with open(os.path.join(run_dir, LOGS, msrun_log), encoding="utf-8", errors="replace") as f:
            for match in re.finditer(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)", f.read()):
                codes.setdefault(int(match.group(1)), int(match.group(2)))
    except OSError:
        pass
    return codes


def describe_exit(code) -> str:
    if code is None:
        return "died (exit code unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    return f"exited with code {code}"


def first_failure(run_dir: str, failed: list, outcome: JobOutcome, codes: dict):
    """The rank that failed first: seen first by the launcher, then the one msrun saw, then the earliest status."""
    def order(item):
        rank = item[0]
        status = read_status(run_dir, rank) or {}
        return (outcome.seen_failing.get(rank, float("inf")), status.get("pid") not in codes,
                status.get("time", float("inf")) if status.get("state") == "failed" else float("inf"), rank)
    return min(failed, key=order) if failed else None


def failure_report(run_dir: str, ranks, outcome: JobOutcome) -> str:
    """Which rank failed first, how (signal or exit code, error) and in which phase; then each failed rank's log."""
    codes = msrun_exit_codes(run_dir, outcome.msrun_log)
    failed = failed_ranks(run_dir, ranks)
    first = first_failure(run_dir, failed, outcome, codes)
    parts = [f"[launch] training failed (msrun exit code {outcome.returncode})"]
    if first is None:
        parts.append("no rank reported a failure; see the logs in " + os.path.join(run_dir, LOGS))
    elif not outcome.hung:  # a stalled rank was named already, and killed by the launcher
        rank, state, error = first
        status = read_status(run_dir, rank) or {}
        beat = read_heartbeat(run_dir, rank)
        code = codes.get(status.get("pid"))
        how = describe_exit(code) if code is not None or state != "failed" else "reported a failure"
        where = f" in phase '{beat['phase']}'" if beat else ""
        parts.append(f"[launch] rank {rank} failed first: {'never started' if not status else how + where}"
                     f"{': ' + error if error else ''}")
        failed.remove(first)
        failed.insert(0, first)
    for rank, state, error in failed:
        log = worker_log(run_dir, rank)
        beat = read_heartbeat(run_dir, rank)
        where = f" (last phase '{beat['phase']}', {time.time() - beat['time']:.0f} s ago)" if beat else ""
        parts.append(f"rank {rank}: {state}{where}{': ' + error if error else ''}\n"
                     f"--- last {LOG_TAIL_LINES} lines of {log} ---\n{tail(log)}---")
    return "\n".join(parts)


def report_failure(run_dir: str, cluster: Cluster, outcome: JobOutcome, group: NodeGroup = None) -> str:
    """failure_report for this node's ranks; the other nodes are told its headline (which rank, how, where)."""
    report = failure_report(run_dir, cluster.ranks, outcome)
    if group is not None:
        group.failure = "; ".join(line[len("[launch] "):] for line in report.splitlines()[1:]
                                  if line.startswith("[launch] ") and not line.startswith("[launch] training failed"))
    return report


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
    from ascend_llm_recipes.training.tools.planner import format_plan, plan

    return format_plan(plan(recipe, device=device))


def launch(recipe_path: str, overrides=(), show_progress: bool = True, nodes: int = None, node_rank: int = None,
           master_addr: str = None, master_port: int = None, dry_run: bool = False, amend: bool = False,
           rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT) -> int:
    """Validate, check, prepare, then run msrun on this node; returns the exit code.

    `amend`: continue a run whose recipe changed, recording the change (continue_run).
    On several nodes, node 0 prepares the (shared) run directory and the others join it first
    (training/launcher/rendezvous.py): `rendezvous_timeout` bounds how long any node waits for the others.
    """
    from ascend_llm_recipes.training.launcher.preflight import has_errors, hccl_env

    if not os.path.isfile(WORKER_SCRIPT):  # a non-editable install carries the package, not scripts/ or recipes/
        raise LaunchError(f"the msrun worker {WORKER_SCRIPT} is missing: ascend_llm_recipes is installed without its "
                          "repository (pip install . copies the package only)",
                          hint="install it editable from a checkout: pip install -e /path/to/checkout")
    recipe = load_recipe(recipe_path, tuple(overrides))
    cluster = resolve_cluster(recipe, nodes, node_rank, master_addr, master_port)
    if cluster.nodes > 1 and not dry_run:
        check_node_address(cluster.nodes, cluster.node_rank, cluster.master_addr, cluster.master_port)
    findings = preflight(recipe, master_port=cluster.master_port if cluster.node_rank == 0 else None)
    hccl = hccl_env(recipe)
    if dry_run:
        command = msrun_command(cluster, os.path.abspath(recipe.output_dir), binds_cores(recipe))
        print("[dry-run] " + " ".join(f"{k}={v}" for k, v in sorted(hccl.items())) + " " + " ".join(command))
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
    import shlex
    parts = ["bash", "scripts/run_distributed.sh", recipe_path, *[a for o in overrides for a in ("--set", o)],
             "--nodes", str(cluster.nodes), "--node-rank", str(node_rank), "--master-addr", cluster.master_addr,
             "--master-port", str(cluster.master_port)]
    if amend:
        parts.append("--amend")
    if rendezvous_timeout != DEFAULT_RENDEZVOUS_TIMEOUT:
        parts += ["--rendezvous-timeout", f"{rendezvous_timeout:g}"]
    return " ".join(map(shlex.quote, parts))


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
    """Prepare the (locked) run directory, run msrun until the job ends, report; returns the exit code.

    On several nodes node 0 prepares the run directory, then starts every node (`group`).
    """
    from ascend_llm_recipes.data.loader import SKIPS_FILE
    from ascend_llm_recipes.training.launcher.preflight import write_findings

    if cluster.node_rank == 0:
        run_dir = prepare_run_dir(recipe, recipe_path, amend)
        if recipe.resume_training and recipe.load_checkpoint and \
                not os.path.abspath(recipe.load_checkpoint).startswith(run_dir + os.sep):
            check_data_position(recipe, run_dir)  # resuming another run's checkpoint in a new run directory
        if recipe.resume_training and recipe.runner_config.stop_step and \
                resumed_step(recipe) >= recipe.runner_config.stop_step:
            done = (f"{run_dir} is already complete (step {resumed_step(recipe)} of runner_config.stop_step "
                    f"{recipe.runner_config.stop_step}); nothing to do")
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
    command = msrun_command(cluster, run_dir, binds_cores(recipe))
    env = worker_env(run_dir, cluster.local_workers, hccl)
    if group is not None:
        group.heartbeats = lambda ranks: {rank: read_heartbeat(run_dir, rank) for rank in ranks}
    print(f"[launch] node {cluster.node_rank} of {cluster.nodes}: ranks {cluster.ranks.start}-"
          f"{cluster.ranks.stop - 1} of {cluster.world_size}; "
          + " ".join(f"{k}={v}" for k, v in sorted(hccl.items())), flush=True)
    print(f"[launch] {' '.join(command)}", flush=True)
    if cluster.local_workers > 1:
        print(f"[launch] showing rank {cluster.ranks.start}'s output; every rank's is in "
              f"{os.path.join(run_dir, LOGS, 'worker_N.log')}", flush=True)
    while True:
        outcome = run_watched(command, env, run_dir, cluster.ranks, recipe.monitoring.hang_timeout,
                              msrun_log=msrun_log_name(cluster), nodes=group)
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
            print(f"[launch] note: msrun exited with code {outcome.returncode} after every rank had finished and "
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
                                     description="Validate a recipe, prepare its data, and train through msrun.")
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/demo_cpu.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override a recipe key (repeatable), e.g. --set runner_config.stop_step=50")
    parser.add_argument("--plan", action="store_true",
                        help="print per-device memory and step time, then exit (works for Ascend recipes on CPU)")
    parser.add_argument("--device", help="with --plan: device from the planner's table (default hardware.device)")
    parser.add_argument("--check", action="store_true", help="run the preflight checks only")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --check: also compile one rank per pipeline stage under MindSpore's DryRun "
                             "(needs CANN)")
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
    if args.dry_run and not args.check:
        parser.error("--dry-run goes with --check (a compile-only check); to print the msrun command without "
                     "running it, set DRY_RUN=1")
    # Until msrun runs (run_watched handles them then), SIGTERM and SIGHUP stop the launcher as Ctrl-C does.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    try:
        if args.plan:
            print(plan_report(load_recipe(args.recipe, tuple(args.overrides), planning=True), args.device))
            return 0
        if args.check:
            from ascend_llm_recipes.training.launcher.preflight import has_errors
            if args.dry_run:
                from ascend_llm_recipes.training.tools.acceptance import dry_run_compile
                return dry_run_compile(load_recipe(args.recipe, tuple(args.overrides), planning=True), args.recipe)
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
        f.write(f"{' '.join(sys.argv)}\n\n{traceback.format_exc()}")
    return (f"internal error (a bug in ascend-llm-recipes): {type(err).__name__}: {err}\n"
            f"  the traceback is saved in {path}; please report it with that file")


if __name__ == "__main__":
    sys.exit(main())
