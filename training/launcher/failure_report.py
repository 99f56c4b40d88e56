"""The failure report: which rank failed first, how (signal or exit code, error) and in which phase.

The launcher's supervision (training/launcher/supervision.py) records the poll round at which it
first saw each rank fail; msrun's log gives the exit code of each worker it saw die (a worker the
launcher started itself, without msrun, gives its own); each rank's status and heartbeat
(training/rank_status.py) give its state, error and last phase. The first failure is named from
these, then each failed rank's last log lines follow.
"""

import os
import signal
import time

from ascend_llm_recipes.training.launcher.cluster import Cluster
from ascend_llm_recipes.training.launcher.rendezvous import NodeGroup
from ascend_llm_recipes.training.launcher.supervision import JobOutcome, msrun_exit_codes
from ascend_llm_recipes.training.rank_status import read_heartbeat, read_status
from ascend_llm_recipes.training.run_files import LOGS, worker_log

LOG_TAIL_LINES = 25


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


def exit_codes(run_dir: str, outcome: JobOutcome) -> dict:
    """{pid: exit code} of the workers that exited with an error: from msrun's log, or the worker started without it."""
    if outcome.worker_pid:
        return {outcome.worker_pid: outcome.returncode} if outcome.returncode else {}
    return msrun_exit_codes(os.path.join(run_dir, LOGS, outcome.msrun_log))


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
    """The rank that failed first: seen first by the launcher, then one with an exit code, then the earliest status."""
    def order(item):
        rank = item[0]
        status = read_status(run_dir, rank) or {}
        return (outcome.seen_failing.get(rank, float("inf")), status.get("pid") not in codes,
                status.get("time", float("inf")) if status.get("state") == "failed" else float("inf"), rank)
    return min(failed, key=order) if failed else None


def failure_report(run_dir: str, ranks, outcome: JobOutcome) -> str:
    """Which rank failed first, how (signal or exit code, error) and in which phase; then each failed rank's log."""
    codes = exit_codes(run_dir, outcome)
    failed = failed_ranks(run_dir, ranks)
    first = first_failure(run_dir, failed, outcome, codes)
    parts = [f"[launch] training failed ({'worker' if outcome.worker_pid else 'msrun'} exit code {outcome.returncode})"]
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
