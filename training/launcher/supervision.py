"""Supervision: run this node's msrun (or, in a one-process CPU run, the worker) and watch the job until it is gone.

`run_watched` stops the job when a rank fails or dies, when a rank's heartbeat stops for
monitoring.hang_timeout seconds, when another node is lost, and on SIGINT/SIGTERM/SIGHUP (each
rank then saves at the end of its step); it returns a `JobOutcome` that training/launcher/failure_report.py
and the launcher's command line (training/launcher/cli.py) turn into a report and an exit code.
The ranks' status and heartbeat files are read through training/rank_status.py.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from ascend_llm_recipes.training.launcher.job import LAUNCHER_ENV, job_processes, process_id, send, start_time
from ascend_llm_recipes.training.launcher.rendezvous import NodeGroup
from ascend_llm_recipes.training.rank_status import read_heartbeat, read_status
from ascend_llm_recipes.training.run_files import LOGS, MINDFORMERS_DIRS, MSRUN_LOG, worker_log

STOP_GRACE_SECONDS = 120  # after Ctrl-C/SIGTERM: time for the ranks to finish their step and save
FAILURE_GRACE_SECONDS = 10  # after a rank failed: time for msrun to stop the rest before the launcher kills them
# Every worker has exited: time for msrun and its scheduler to follow (a worker started without msrun is the
# process watched: its exit ends the watch at once).
SETTLE_SECONDS = 10
ENDING_SETTLE_SECONDS = 3  # the same once the job is being stopped (msrun polls its workers every second)
# msrun is done with its workers (msrun_done_with_workers): after this long, in which a worker's failure would
# have shown in its log, the launcher stops waiting for msrun's scheduler and ends the job itself.
NOTED_SECONDS = 0.5
# msrun's log lines about its workers (mindspore/parallel/cluster/process_entity/_api.py:364 and 369).
WORKER_EXIT_LINE = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
KILLED_THE_REST_LINE = "There's worker exits with exception, kill all other workers."


@dataclass(frozen=True)
class KnownLine:
    """Lines of the workers' output (MindFormers') that the console leaves out, saying so once with `reason`, or
    shortens (`replacement`, for re.sub). The logs keep every line as it was written."""
    pattern: "re.Pattern"
    what: str
    reason: str
    replacement: Optional[str] = None


KNOWN_LINES = (
    KnownLine(re.compile(r" - mindformers/.*?/log\["), "MindFormers' logger name",
              "it names its logger after its log folder (mindformers/tools/logger.py:490)", " - mindformers["),
    KnownLine(re.compile(r"Import PyNative\w+ failed: No module named 'hyper_parallel'"),
              "MindFormers' warnings 'Import PyNative... failed: No module named hyper_parallel'",
              "MindFormers 1.9 tries its PyNative DeepSeek-V3 and Qwen3 models at import "
              "(models/deepseek3/modeling_deepseek_v3.py:27-31, models/qwen3/modeling_qwen3.py:31-35); they need the "
              "hyper_parallel package, which no recipe here uses"),
    KnownLine(re.compile(r"\[mindformers/core/callback/callback\.py:\d+\] - INFO - (\{ Epoch:\[| +[\d.]+% \|)"),
              "MindFormers' MFLossMonitor progress lines",
              "their step count and ETA run to the end of the epoch (cb_params.batch_num, "
              "mindformers/core/callback/callback.py:504-512), not to runner_config.stop_step; each [step N] line "
              "gives the progress and ETA to the run's last step"),
)


def known_line(line: str) -> tuple:
    """(the line as the console shows it, or None when it is left out; the KnownLine that left it out, or None)."""
    for known in KNOWN_LINES:
        if known.replacement is not None:
            line = known.pattern.sub(known.replacement, line)
        elif known.pattern.search(line):
            return None, known
    return line, None


# The phases of a rank still starting (training/rank_status.py): monitoring.startup_timeout applies to them.
STARTUP_PHASES = ("not started", "start", "setup", "compile")


def stalled_ranks(run_dir: str, ranks, timeout: float, started: float, now: float = None,
                  startup_timeout: float = None) -> list:
    """(rank, phase, seconds, limit) for each rank whose last heartbeat is older than its limit: `timeout`, or
    `startup_timeout` (when set) while it is starting (STARTUP_PHASES)."""
    now = time.time() if now is None else now
    stalled = []
    for rank in ranks:
        beat = read_heartbeat(run_dir, rank)
        phase, last = (beat["phase"], beat["time"]) if beat else ("not started", started)
        limit = startup_timeout if startup_timeout and phase in STARTUP_PHASES else timeout
        if phase != "done" and now - last > limit:
            stalled.append((rank, phase, now - last, limit))
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
                msrun_log: str = MSRUN_LOG, nodes: NodeGroup = None, direct: bool = False,
                startup_timeout: float = None) -> JobOutcome:
    """Run msrun and watch its job until every process of it is gone.

    Stops the job when a rank fails or dies (whatever msrun does meanwhile: its scheduler can
    wait minutes for a rank that is gone), when a rank's heartbeat stops for `hang_timeout`
    seconds (`startup_timeout`, when set, while it starts: STARTUP_PHASES), when another node is lost
    (`nodes`: its ranks are gone, ours would wait on them in a collective), and on SIGINT/SIGTERM/SIGHUP:
    every worker then saves at the end of its current step and exits; a second signal, or STOP_GRACE_SECONDS,
    kills the job at once. msrun's own output goes to logs/`msrun_log` (it must not depend on the launcher
    being alive) and is echoed here.
    Once every rank is done and each worker has exited 0 (and, on node 0, every other node ended well), the
    job is ended without waiting for msrun's scheduler to notice (msrun_done_with_workers: up to 5 s more) and
    msrun to exit; the outcome's returncode is then 0, msrun's own result for such a job.
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
    deadline, terminated, worker_pids, workers_gone, noted, ended_done = None, set(), set(), None, None, False
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
            worker_pids.update(p.pid for p in workers)
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
            stalled = [] if deadline is not None else stalled_ranks(run_dir, ranks, hang_timeout, started, now,
                                                                    startup_timeout)
            for rank, phase, seconds, limit in stalled:
                key = "hang_timeout" if limit == hang_timeout else "startup_timeout"
                print(f"[launch] rank {rank} stalled in phase '{phase}' for {seconds:.0f} s "
                      f"(monitoring.{key} {limit} s); stopping the job", file=sys.stderr, flush=True)
            workers_gone = (workers_gone or now) if worker_pids and not workers else None
            outcome.node_lost = nodes.problem() if nodes is not None else ""
            # Every worker has exited 0 and every rank is done (and on node 0 every other node ended well): msrun
            # would only wait for its scheduler (node 0), which has nothing left to do, and then exit.
            # NOTED_SECONDS: for msrun to log a failure of a worker it reaped just now.
            ended_well = (workers_gone and every_rank_done(run_dir, ranks, started)
                          and workers_ended_well(log_path, worker_pids)
                          and (nodes is None or nodes.scheduler_unneeded()))
            # The job is ending and msrun has seen how each worker ended: it only waits for its scheduler.
            ending_noted = deadline is not None and workers_gone and msrun_done_with_workers(log_path, worker_pids)
            noted = (noted or now) if ended_well or ending_noted else None
            finished = ended_well and now - noted >= NOTED_SECONDS
            # Once the job is ending, msrun only needs to note how its workers exited.
            settle = SETTLE_SECONDS if deadline is None else ENDING_SETTLE_SECONDS
            why = (outcome.node_lost if outcome.node_lost else
                   "a rank stalled" if stalled else
                   f"second {signals[1]}" if len(signals) > 1 else
                   "the grace period ran out" if deadline is not None and now > deadline else
                   "every rank is done" if finished else
                   "its workers are gone" if workers_gone and (now - workers_gone > settle or
                                                               (ending_noted and now - noted >= NOTED_SECONDS)) else "")
            if why:
                outcome.hung = outcome.hung or bool(stalled)
                if why not in ("its workers are gone", "every rank is done"):
                    outcome.killed = why
                ended_done = why == "every rank is done"
                kill_job(proc, launcher)
                break
            try:  # a poll's wait, ended at once when the job's process exits (a run's end is reported without delay)
                proc.wait(timeout=poll if not workers_gone else min(poll, NOTED_SECONDS / 2))
            except subprocess.TimeoutExpired:
                pass
        code = proc.wait()
        # Ended by the launcher once every rank was done and msrun had seen each worker exit 0: msrun's own result.
        outcome.returncode = 0 if ended_done and code == -signal.SIGKILL else code
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
        remove_empty_mindformers_dirs(run_dir)
    return outcome


def remove_empty_mindformers_dirs(run_dir: str) -> None:
    """MindFormers' Trainer makes checkpoint/ and strategy/ in its output directory whether or not anything goes
    there (mindformers/utils/file_utils.py:53-56, 68-71); a CPU run writes nothing to either (our checkpoints go to
    checkpoints/): the folders it left empty are removed once its job is gone."""
    for name in MINDFORMERS_DIRS:
        try:
            os.rmdir(os.path.join(run_dir, name))
        except OSError:
            pass  # holds files, or is not there


class OutputEcho:
    """Copies msrun's log (or the direct worker's) to stdout from a thread, so a slow or full stdout never holds
    up the watch. Whole lines pass through known_line: MindFormers' known lines are left out (each kind said once)
    or shortened; a line still unfinished after a poll is copied as it is."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.unfinished = 0  # bytes of a last line without its newline, left at the previous copy
        self.explained = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="msrun-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            last = self._stop.is_set()
            self.copy_new_output(flush=last)
            if last:
                return
            self._stop.wait(0.5)

    def copy_new_output(self, flush: bool = False) -> None:
        """Copy the whole lines written since the last copy to stdout; an unfinished last line waits for its newline
        one copy, then goes as it is (`flush`: at once)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        stalled = len(data) == self.unfinished  # nothing new since the previous copy
        end = len(data) if flush or stalled else data.rfind(b"\n") + 1
        shown = b"".join(self.relayed(line) for line in data[:end].splitlines(keepends=True))
        self.offset, self.unfinished = self.offset + end, len(data) - end
        if shown:
            try:
                sys.stdout.flush()
                sys.stdout.buffer.write(shown)
                sys.stdout.flush()
            except (OSError, ValueError):  # the terminal is gone (SIGHUP follows): keep watching the job
                pass

    def relayed(self, line: bytes) -> bytes:
        """One line of output as the console shows it (b"" when left out, after the one note saying why)."""
        text = line.decode(errors="replace")
        shown, left_out = known_line(text)
        if left_out is None:
            return line if shown == text else shown.encode()
        if left_out in self.explained:
            return b""
        self.explained.add(left_out)
        return (f"[launch] {left_out.what} are left out of this output (the log keeps them): {left_out.reason}\n"
                .encode())

    def close(self, timeout: float = 5.0) -> None:
        """Copy what is left, waiting at most `timeout` seconds for stdout."""
        self._stop.set()
        self._thread.join(timeout)


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


def msrun_exit_codes(log_path: str) -> dict:
    """{pid: exit code} of the workers msrun logged exiting with an error (negative: killed by that signal)."""
    codes = {}
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            for match in WORKER_EXIT_LINE.finditer(f.read()):
                codes.setdefault(int(match.group(1)), int(match.group(2)))
    except OSError:
        pass
    return codes


def exit_statuses(pids) -> dict:
    """{pid: exit status (waitpid's form)} of those of `pids` that have exited: a zombie's is in field 52 of its
    /proc/PID/stat (Linux >= 3.5); one already reaped (no /proc entry left) is None. {} while any still runs."""
    ended = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            ended[pid] = None
            continue
        if fields[0] not in ("Z", "X"):
            return {}
        ended[pid] = int(fields[49]) if len(fields) > 49 else None
    return ended


def msrun_done_with_workers(log_path: str, worker_pids) -> bool:
    """Every worker has exited and msrun has logged each failure it will log: all that is left for it is to wait
    for its scheduler (mindspore/parallel/cluster/process_entity/_api.py:378-381), whose finalize checks for live
    nodes every 5 s (mindspore/ccsrc/cluster/topology/cluster_context.cc Finalize, meta_server_node.cc:91).

    msrun reaps a worker only in its poll, which logs a failed one's exit code at once (_api.py:357-366): every
    worker reaped (no /proc entry left, not even a zombie) means every failure is in the log. After a failure
    it kills the other workers and logs that it did (_api.py:368-371), without reaping them.
    """
    if not worker_pids:
        return False
    statuses = exit_statuses(worker_pids)
    if statuses and all(status is None for status in statuses.values()):
        return True
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            return KILLED_THE_REST_LINE in f.read()
    except OSError:
        return False


def workers_ended_well(log_path: str, worker_pids) -> bool:
    """Every worker has exited with status 0: those not yet reaped by msrun say so in /proc, and msrun logged
    no failure of those it reaped (it logs one as it reaps it, _api.py:357-366)."""
    statuses = exit_statuses(worker_pids) if worker_pids else {}
    return bool(statuses) and all(not status for status in statuses.values()) and not msrun_exit_codes(log_path)


def every_rank_done(run_dir: str, ranks, since: float) -> bool:
    """Every rank's status (written after `since`) says done: its checkpoint, metrics and summary are written."""
    statuses = [read_status(run_dir, rank) for rank in ranks]
    return all(s is not None and s["state"] == "done" and s["time"] >= since for s in statuses)


def rank_failing(run_dir: str, rank: int, since: float) -> bool:
    """The rank's status (written after `since`) says failed, or says running while its process is gone."""
    status = read_status(run_dir, rank)
    if status is None or status["state"] == "done" or status["time"] < since:
        return False
    return status["state"] == "failed" or start_time(status.get("pid", 0)) is None
