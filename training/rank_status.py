"""Each rank's two small files, written by the worker and read by the launcher: their format, in one place.

RUN_DIR/status/rank_N.json      the rank's state: "running" (from the start), then "done" or "failed".
                                {"rank", "state", "time", "pid", ...}: "error" when failed; "preempted" and
                                "rollback" (the loss-spike record, or None) when done. The PID in every state:
                                the launcher matches it with how the process ended (msrun's report, or
                                the exit status of a worker it started itself).
RUN_DIR/heartbeat/rank_N.json   the rank's phase (start, setup, compile, step N, data, save, eval, done):
                                {"rank", "phase", "step", "time", "pid"}; the launcher names a rank whose
                                heartbeat stopped for monitoring.hang_timeout seconds.

Both are rewritten whole (atomic replace, no fsync: they describe a live process, not saved state).
The file names are training/run_files.py's; the worker writes with `write_status` and `Heartbeat`,
the launcher reads with `read_status` and `read_heartbeat`.
"""

import json
import os
import time

from ascend_llm_recipes.common.files import write_json_atomic
from ascend_llm_recipes.training.run_files import heartbeat_path, status_path


def write_status(run_dir: str, rank: int, state: str, **extra) -> None:
    """RUN_DIR/status/rank_N.json: `state` (running, done or failed) and its details (`extra`)."""
    path = status_path(run_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # The PID in every state: the launcher matches it with how the process ended (msrun's report, or its own wait).
    write_json_atomic(path, {"rank": rank, "state": state, "time": time.time(), "pid": os.getpid(), **extra},
                      fsync=False)


def read_status(run_dir: str, rank: int):
    """RUN_DIR/status/rank_N.json (running, done or failed, with details), or None before the rank wrote one."""
    return _read(status_path(run_dir, rank))


class Heartbeat:
    """RUN_DIR/heartbeat/rank_N.json: this rank's phase (start, setup, compile, step N, data, save, eval, done)."""

    def __init__(self, run_dir: str, rank: int):
        self.path = heartbeat_path(run_dir, rank)
        self.rank = rank
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def beat(self, phase: str, step: int = 0) -> None:
        write_json_atomic(self.path, {"rank": self.rank, "phase": phase, "step": step, "time": time.time(),
                                      "pid": os.getpid()}, fsync=False)


def read_heartbeat(run_dir: str, rank: int):
    """RUN_DIR/heartbeat/rank_N.json (phase, step, time, pid), or None before the rank's first beat."""
    return _read(heartbeat_path(run_dir, rank))


def _read(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
