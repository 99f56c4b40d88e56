"""The failure report: which rank failed first, how (signal or exit code, error) and in which phase.

The launcher's supervision (training/launcher/supervision.py) records the poll round at which it
first saw each rank fail; msrun's log gives the exit code of each worker it saw die (a worker the
launcher started itself, without msrun, gives its own); each rank's status and heartbeat
(training/rank_status.py) give its state, error and last phase. The first failure is named from
these (a rank that died without a word on a full disk is said to have), then each failed rank's
last log lines follow (MindFormers' known lines left out, repeats folded), then what to do next:
rerun, resuming from the newest complete checkpoint.
"""

import os
import re
import signal
import time

from ascend_llm_recipes.common.files import free_bytes
from ascend_llm_recipes.common.units import byte_size
from ascend_llm_recipes.training.launcher.cluster import Cluster
from ascend_llm_recipes.training.launcher.rendezvous import NodeGroup
from ascend_llm_recipes.training.launcher.supervision import JobOutcome, known_line, msrun_exit_codes
from ascend_llm_recipes.training.rank_status import read_heartbeat, read_status
from ascend_llm_recipes.training.run_files import CHECKPOINTS, LOGS, worker_log

LOG_TAIL_LINES = 25
TAIL_BYTES = 256 * 1024  # how much of the end of a log the tail reads (a long run's log holds a line per step)
# A rank that died without a word while its run directory's disk has less free than this died of the full disk:
# a write of a status file, a log line or a checkpoint fails there first.
FULL_DISK_BYTES = 1 << 20
NEXT_STEP = "[launch] next: "
NUMBER = re.compile(r"\d[\d.,]*(e[-+]?\d+)?")  # 12, 1,383, 4.782e-03: what differs between lines alike


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
    """The last `lines` lines of a log as fold_repeats gives them, MindFormers' known lines left out; a log that ends
    mid-line says it was cut short."""
    try:
        with open(path, "rb") as f:
            start = max(0, os.path.getsize(path) - TAIL_BYTES)
            f.seek(start)
            data = f.read().decode(errors="replace")
    except OSError:
        return f"(no log at {path})\n"
    text = data.splitlines()[1 if start else 0:]  # read from the middle of the log: its first line is a part of one
    shown = fold_repeats([line for line in (known_line(t)[0] for t in text) if line is not None])[-lines:]
    if data and not data.endswith("\n"):
        shown.append("(the log ends here, mid-line: it was cut short)")
    return "".join(line + "\n" for line in shown)


def fold_repeats(lines: list) -> list:
    """Runs of lines that differ only in their numbers (a step's log line, a repeated warning): the same line once
    with its count; lines alike the first and the last, with how many were left out between them."""
    def shape(line):
        return NUMBER.sub("#", line)

    folded, start = [], 0
    while start < len(lines):
        end = start + 1
        while end < len(lines) and shape(lines[end]) == shape(lines[start]):
            end += 1
        run = lines[start:end]
        if len(run) > 1 and len(set(run)) == 1:
            folded.append(f"{run[0]}  (x{len(run)})")
        elif len(run) > 3:
            folded += [run[0], f"... ({len(run) - 2} more like these)", run[-1]]
        else:
            folded += run
        start = end
    return folded


def full_disk(run_dir: str) -> str:
    """'' or, when the run directory's disk is full, what it says: the space free and the save that was underway."""
    from ascend_llm_recipes.training.checkpoint import complete_steps, step_entries

    free = free_bytes(run_dir)
    if free >= FULL_DISK_BYTES:
        return ""
    complete = complete_steps(run_dir)
    started = [int(e.split("_")[1]) for e in step_entries(run_dir)]
    saving = [s for s in started if s not in complete and (not complete or s > complete[-1])]
    at = f" at the step-{max(saving)} save" if saving else ""
    return (f"disk full{at}: {byte_size(free)} free on {os.path.join(run_dir, CHECKPOINTS)} (the rank could not say "
            "so itself, and its log may be cut short)")


def next_step(run_dir: str, nodes: int, fix_first: bool) -> str:
    """What to do after a failure: rerun the same command, which resumes from the newest complete checkpoint."""
    from ascend_llm_recipes.training.checkpoint import complete_steps, step_dir

    steps = complete_steps(run_dir)
    rerun = (f"{'once the cause above is fixed, ' if fix_first else ''}rerun the same command"
             f"{' on every node' if nodes > 1 else ''}")
    if not steps:
        return f"{NEXT_STEP}{rerun} to start over (no checkpoint is complete)"
    return f"{NEXT_STEP}{rerun} to resume from step {steps[-1]} (the newest complete checkpoint, " \
           f"{step_dir(run_dir, steps[-1])})"


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


def failure_report(run_dir: str, ranks, outcome: JobOutcome, nodes: int = 1) -> str:
    """Which rank failed first, how (signal or exit code, error) and in which phase; then each failed rank's log,
    and what to do next (`nodes`: the run's node count, which the rerun names)."""
    codes = exit_codes(run_dir, outcome)
    failed = failed_ranks(run_dir, ranks)
    first = first_failure(run_dir, failed, outcome, codes)
    parts = [f"[launch] training failed ({'worker' if outcome.worker_pid else 'msrun'} exit code {outcome.returncode})"]
    fix_first = first is not None and first[1] == "failed"  # the first rank to fail said what went wrong
    if first is None:
        parts.append("no rank reported a failure; see the logs in " + os.path.join(run_dir, LOGS))
    elif not outcome.hung:  # a stalled rank was named already, and killed by the launcher
        rank, state, error = first
        status = read_status(run_dir, rank) or {}
        beat = read_heartbeat(run_dir, rank)
        code = codes.get(status.get("pid"))
        how = describe_exit(code) if code is not None or state != "failed" else "reported a failure"
        where = f" in phase '{beat['phase']}'" if beat else ""
        if not error:
            error = full_disk(run_dir)
            fix_first = fix_first or bool(error)
        parts.append(f"[launch] rank {rank} failed first: {'never started' if not status else how + where}"
                     f"{': ' + error if error else ''}")
        failed.remove(first)
        failed.insert(0, first)
    for rank, state, error in failed:
        log = worker_log(run_dir, rank)
        beat = read_heartbeat(run_dir, rank)
        where = f" (last phase '{beat['phase']}', {time.time() - beat['time']:.0f} s ago)" if beat else ""
        error = "" if (rank, state, error) == first and not outcome.hung else error  # the headline gave it
        parts.append(f"rank {rank}: {state}{where}{': ' + error if error else ''}\n"
                     f"--- last {LOG_TAIL_LINES} lines of {log} (MindFormers' known lines left out, repeats folded) "
                     f"---\n{tail(log)}---")
    parts.append(next_step(run_dir, nodes, fix_first))
    return "\n".join(parts)


def report_failure(run_dir: str, cluster: Cluster, outcome: JobOutcome, group: NodeGroup = None) -> str:
    """failure_report for this node's ranks; the other nodes are told its headline (which rank, how, where)."""
    report = failure_report(run_dir, cluster.ranks, outcome, cluster.nodes)
    if group is not None:
        group.failure = "; ".join(line[len("[launch] "):] for line in report.splitlines()[1:]
                                  if line.startswith("[launch] ") and not line.startswith(NEXT_STEP)
                                  and not line.startswith("[launch] training failed"))
    return report
