"""Datatrove tasks run in watched processes: a task that dies is named at once, never waited for.

datatrove's LocalPipelineExecutor runs its tasks in a `multiprocess` Pool, which waits forever for the
result of a worker killed by a signal ("3/4 tasks completed", then nothing), and each task's loguru
handler prints a traceback to the console for any exception, input errors included. TaskPool keeps
`workers` spawned processes for all the stages of a run; each takes one task at a time over its own
pipe, so the parent always knows which task a process holds: one that exits without answering is
reported with its task, its pid and the signal. A task's console output (datatrove's log lines, a
traceback) goes to a file beside datatrove's task log; its error comes back as a TaskFailure, which
`raise_failures` turns into the one-line error the single-process run would give.

The Ray executor (data/cluster/scale.py) reports its tasks' failures as TaskFailures too.
"""

import multiprocessing
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait

from tqdm import tqdm

from ascend_llm_recipes.common.errors import DataError, PretrainError
from ascend_llm_recipes.common.processes import die_with_parent

DIED, ERROR, OS_ERROR, BUG = "died", "error", "oserror", "bug"
RERUN = "rerun the same command to continue: it redoes only the unfinished tasks"


@dataclass
class TaskFailure:
    """A task that did not complete: `kind` says how, `detail` what with (see failure_of and TaskPool)."""

    rank: int
    kind: str
    detail: object  # DIED: how it died; ERROR: the PretrainError; OS_ERROR: (errno, strerror, filename); BUG: traceback


class TaskBug(RuntimeError):
    """An unexpected exception inside a task: a bug; its message carries the task's own traceback."""


def failure_of(rank: int, err: BaseException, trace: str = "") -> TaskFailure:
    """The TaskFailure for an exception a task raised (picklable: it crosses a pipe or Ray's object store)."""
    if isinstance(err, PretrainError):
        return TaskFailure(rank, ERROR, err)
    if isinstance(err, OSError) and err.errno is not None:
        return TaskFailure(rank, OS_ERROR, (err.errno, err.strerror, os.fsdecode(err.filename or "")))
    return TaskFailure(rank, BUG, trace or "".join(traceback.format_exception(err)))


def raise_failures(stage: str, failures: list, total: int, completed: int, os_error) -> None:
    """Raise the error the user should see for a stage's failed tasks (the first by rank of the gravest kind).

    os_error: the run's translation of an OSError (data/run_state.py RunState.os_error: a full disk, with the space
    needed).
    """
    failures = sorted(failures, key=lambda f: f.rank)
    by_kind = {kind: [f for f in failures if f.kind == kind] for kind in (ERROR, OS_ERROR, BUG, DIED)}
    if by_kind[ERROR]:
        raise by_kind[ERROR][0].detail
    if by_kind[OS_ERROR]:
        code, strerror, filename = by_kind[OS_ERROR][0].detail
        raise os_error(OSError(code, strerror, filename or None))
    if by_kind[BUG]:
        first = by_kind[BUG][0]
        raise TaskBug(f"task {first.rank} of stage {stage} failed; its traceback:\n{first.detail}")
    died = by_kind[DIED]
    raise DataError(f"stage {stage}: " + "; ".join(f"task {f.rank} {f.detail}" for f in died)
                    + f" ({completed} of its {total} tasks completed and are kept)", hint=RERUN)


# ---- the worker processes -----------------------------------------------------------------------------

def _redirect_output(path: str) -> None:
    """Send this process's stdout and stderr (datatrove's console log, loguru's own complaints) to `path`."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError:  # a full disk: the task's own write will say so
        fd = os.open(os.devnull, os.O_WRONLY)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _worker(conn, parent: int) -> None:
    die_with_parent(parent)  # an orphan task would race the rerun's copy of it in the same scratch directory
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the parent answers it
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            # Everything this worker wrote is closed and reported (datatrove closes the task log in its finally):
            # leave without the interpreter's teardown, which after MindSpore's import (MindRecord, in the pack
            # stage) takes 1.5-2+ s (its exit handlers and native destructors). TaskPool.close waits for that, so
            # each run ended ~2 s after its last task (per worker: up to 2 s each, then SIGTERM).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        executor, rank = job
        _redirect_output(os.path.join(executor.logging_dir.path, "logs", f"task_{rank:05d}.out"))
        try:
            executor._run_for_rank(rank, local_rank=1)  # datatrove: records the task's completion
            outcome = None
        except Exception as err:  # noqa: BLE001 - every failure goes back to the parent, named
            outcome = failure_of(rank, err)
        conn.send((rank, outcome))


class TaskPool:
    """Up to `workers` spawned processes that run datatrove tasks one at a time, for any number of stages."""

    def __init__(self, workers: int, show_progress: bool = True):
        self.workers, self.show_progress = workers, show_progress
        self.slots: list = []  # [process, connection] per worker; None once it has died
        self.context = multiprocessing.get_context("spawn")  # the parent may hold MindSpore's threads

    def run(self, executor, stage: str) -> list:
        """Run `executor`'s incomplete tasks; returns the TaskFailures (empty: every task completed)."""
        total = executor.world_size
        pending = executor.get_incomplete_ranks()
        if len(pending) < total:
            print(f"prepare: stage {stage}: {total - len(pending)} of its {total} tasks already completed"
                  + (f", running the other {len(pending)}" if pending else ""), file=sys.stderr, flush=True)
        failures, busy = [], {}  # slot index -> the rank it runs
        progress = tqdm(total=total, initial=total - len(pending), desc=f"{stage} tasks", unit="task",
                        disable=not self.show_progress)
        try:
            while busy or (pending and not failures):  # after a failure: the running tasks finish, no new one
                while pending and not failures:
                    slot = self._idle_slot(busy)
                    if slot is None:
                        break
                    busy[slot] = pending.pop(0)
                    self.slots[slot][1].send((executor, busy[slot]))
                waiting = {self.slots[s][1]: s for s in busy}
                waiting.update({self.slots[s][0].sentinel: s for s in busy})
                for ready in wait(list(waiting)):
                    slot = waiting[ready]
                    if slot not in busy:
                        continue  # its connection and its sentinel were both ready
                    outcome = self._outcome(slot, busy[slot])
                    del busy[slot]
                    if outcome is None:
                        progress.update()
                        continue
                    failures.append(outcome)
                    if outcome.kind == DIED:
                        print(f"prepare: stage {stage}: task {outcome.rank} {outcome.detail}"
                              + (f"; waiting for the {len(busy)} running tasks to finish" if busy else ""),
                              file=sys.stderr, flush=True)
        finally:
            progress.close()
        return failures

    def _idle_slot(self, busy: dict):
        for slot, entry in enumerate(self.slots):
            if slot not in busy:
                if entry is None:
                    self.slots[slot] = self._spawn()
                return slot
        if len(self.slots) < self.workers:
            self.slots.append(self._spawn())
            return len(self.slots) - 1
        return None

    def _spawn(self) -> list:
        mine, theirs = self.context.Pipe()
        process = self.context.Process(target=_worker, args=(theirs, os.getpid()), name="prepare-task")
        process.start()
        theirs.close()
        return [process, mine]

    def _outcome(self, slot: int, rank: int):
        """The finished task's TaskFailure (None: it completed), or a DIED one for a process that is gone."""
        process, conn = self.slots[slot]
        try:
            if conn.poll():
                return conn.recv()[1]
        except (EOFError, OSError):
            pass
        process.join(5)
        self.slots[slot] = None
        code = process.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            oom = " (by hand, or by the kernel when memory ran out)" if -code == signal.SIGKILL else ""
            how = f"was killed by {name}{oom}"
        else:
            how = f"exited with code {code} before finishing"
        return TaskFailure(rank, DIED, f"(pid {process.pid}) {how}")

    def close(self) -> None:
        """Stop the workers: idle ones are told to exit, any still running a task (Ctrl-C) are terminated."""
        for entry in self.slots:
            if entry is not None:
                try:
                    entry[1].send(None)
                except OSError:
                    pass
        for entry in self.slots:
            if entry is not None:
                entry[0].join(2)
                if entry[0].is_alive():
                    entry[0].terminate()
                    entry[0].join(5)
                entry[1].close()
        self.slots = []
