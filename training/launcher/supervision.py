"""Supervision: run this node's msrun (or, in a one-process CPU run, the worker) and watch the job until it is gone.

`run_watched` stops the job when a rank fails or dies, when a rank's heartbeat stops for
monitoring.hang_timeout seconds, when another node is lost, and on SIGINT/SIGTERM/SIGHUP (each
rank then saves at the end of its step); it returns a `JobOutcome` that training/launcher/failure_report.py
and the launcher's command line (training/launcher/cli.py) turn into a report and an exit code.
The ranks' status and heartbeat files are read through training/rank_status.py.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from ascend_llm_recipes.training.launcher.job import LAUNCHER_ENV, job_processes, process_id, send, start_time
from ascend_llm_recipes.training.launcher.rendezvous import NodeGroup
from ascend_llm_recipes.training.rank_status import read_heartbeat, read_status
from ascend_llm_recipes.training.run_files import LOGS, MSRUN_LOG, worker_log

STOP_GRACE_SECONDS = 120  # after Ctrl-C/SIGTERM: time for the ranks to finish their step and save
FAILURE_GRACE_SECONDS = 10  # after a rank failed: time for msrun to stop the rest before the launcher kills them
# Every worker has exited: time for msrun and its scheduler to follow (a worker started without msrun is the
# process watched: its exit ends the watch at once).
SETTLE_SECONDS = 10
ENDING_SETTLE_SECONDS = 3  # the same once the job is being stopped (msrun polls its workers every second)


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
    """How a run of msrun, or of a worker started without it, ended, as the launcher saw it."""
    returncode: int                # msrun's, or the worker's when there is no msrun (worker_pid)
    stopped_by: str = ""           # the signal (SIGINT, SIGTERM, SIGHUP) the launcher was stopped with
    killed: str = ""               # why the launcher killed the job's processes, if it did
    hung: bool = False
    seen_failing: dict = field(default_factory=dict)  # rank -> poll round the launcher first saw it fail or die
    node_lost: str = ""            # another node lost during the run (training/launcher/rendezvous.py), why and where
    msrun_log: str = MSRUN_LOG     # this node's msrun output, in RUN_DIR/logs ("" without msrun)
    worker_pid: int = 0            # the worker the launcher started itself (a one-process CPU run), without msrun


def run_watched(command: list, env: dict, run_dir: str, ranks, hang_timeout: float, poll: float = 1.0,
                msrun_log: str = MSRUN_LOG, nodes: NodeGroup = None, direct: bool = False) -> JobOutcome:
    """Run msrun and watch its job until every process of it is gone.

    Stops the job when a rank fails or dies (whatever msrun does meanwhile: its scheduler can
    wait minutes for a rank that is gone), when a rank's heartbeat stops for `hang_timeout`
    seconds, when another node is lost (`nodes`: its ranks are gone, ours would wait on them in
    a collective), and on SIGINT/SIGTERM/SIGHUP: every worker then saves at the end of its current
    step and exits; a second signal, or STOP_GRACE_SECONDS, kills the job at once. msrun's own
    output goes to logs/`msrun_log` (it must not depend on the launcher being alive) and is echoed here.
    `direct`: `command` is the only rank's worker itself (cluster.starts_worker_directly), not msrun; its
    output goes to its logs/worker_N.log, echoed here, and the outcome's returncode is its own.
    """
    launcher = process_id()
    env = dict(env, **{LAUNCHER_ENV: launcher})
    log_path = worker_log(run_dir, ranks[0]) if direct else os.path.join(run_dir, LOGS, msrun_log)
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    outcome, signals = JobOutcome(returncode=0, msrun_log="" if direct else msrun_log), []
    handlers = {sig: signal.signal(sig, lambda signum, _: signals.append(signal.Signals(signum).name))
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    started, rounds, proc, echo = time.time(), 0, None, None
    deadline, terminated, seen_worker, workers_gone = None, set(), False, None
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, env=env, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        if direct:
            outcome.worker_pid = proc.pid
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
            try:  # a poll's wait, ended at once when the job's process exits (a run's end is reported without delay)
                proc.wait(timeout=poll)
            except subprocess.TimeoutExpired:
                pass
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
    """Copies msrun's log (or the direct worker's) to stdout from a thread, so a slow or full stdout never holds
    up the watch."""

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
    """Copy what msrun (or the direct worker) wrote to `path` since `offset` to stdout; returns the new offset."""
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
    """SIGKILL the process group of msrun (or of the direct worker) and every process of the job (msrun's workers
    run in sessions of their own)."""
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
