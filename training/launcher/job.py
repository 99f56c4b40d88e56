"""One launch's job: its processes, the lock on its run directory, and the workers' watch on their launcher.

msrun starts its scheduler and every worker in sessions of their own, so neither a process group
nor a parent-death signal reaches them from the launcher (a worker the launcher starts itself, in a
one-process CPU run, runs in a session of its own too). The launcher therefore exports
LAUNCHER_ENV = "<pid>:<start time>" to msrun or that worker, which hand it down: the launcher finds
every process of its job by that value in /proc/PID/environ, and each worker runs a watchdog thread
(the scheduler a watchdog process: it blocks in init() holding the GIL) that stops their process when
that launcher is gone (e.g. killed with -9).
"""

import fcntl
import json
import os
import platform
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from ascend_llm_recipes.common.errors import LaunchError
from ascend_llm_recipes.training.run_files import LOCK_FILE

LAUNCHER_ENV = "ASCEND_RECIPES_LAUNCHER"
# Set on the worker the launcher starts itself, without msrun (cluster.starts_worker_directly): its role, where
# msrun's workers have MS_ROLE=MS_WORKER (which would make this one wait in init() for a scheduler).
DIRECT_WORKER_ENV = "ASCEND_RECIPES_DIRECT_WORKER"
DIRECT_WORKER = "direct worker"
# A worker whose launcher is gone saves at the end of its current step; past this it exits anyway
# (a step blocked on a rank that already left never ends).
ORPHAN_GRACE_SECONDS = 30
# A relaunch after the launcher was killed waits this long for the old job's processes: the grace
# above, plus the second the watchdog takes to notice and msrun's own poll of its workers.
ORPHAN_WAIT_SECONDS = ORPHAN_GRACE_SECONDS + 15


def start_time(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks after boot), or None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name in (...) may hold spaces
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def process_id(pid: int = None) -> str:
    """'<pid>:<start time>': names a process even after its PID is reused."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_time(pid)}"


def is_running(ident: str) -> bool:
    """The process `ident` (process_id) names is alive. An ident taken of a process already exiting reads
    '<pid>:None', and so does every process that is gone: never running."""
    pid, started = ident.split(":")
    now = start_time(int(pid))
    return now is not None and str(now) == started


@dataclass
class JobProcess:
    pid: int
    role: str      # msrun's MS_ROLE (MS_SCHED, MS_WORKER also for its log tails, "" for msrun), or DIRECT_WORKER
    command: str

    @property
    def is_worker(self) -> bool:
        """A training worker: by its role, with the worker script in its command (msrun's log tails have
        MS_WORKER too, and a program a worker runs inherits the role; msrun's own command names the script)."""
        from ascend_llm_recipes.training.launcher.preflight import WORKER_MARK
        return self.role in ("MS_WORKER", DIRECT_WORKER) and WORKER_MARK in self.command


def job_processes(launcher: str) -> list:
    """Every live process started under the launcher `launcher` (its LAUNCHER_ENV value)."""
    wanted = f"{LAUNCHER_ENV}={launcher}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if wanted not in env:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if start_time(int(entry)) is None:
            continue
        role = next((e[len(b"MS_ROLE="):].decode() for e in env if e.startswith(b"MS_ROLE=")), "")
        if f"{DIRECT_WORKER_ENV}=1".encode() in env:
            role = DIRECT_WORKER
        found.append(JobProcess(int(entry), role, command))
    return sorted(found, key=lambda p: p.pid)


def wait_for_job_end(launcher: str, run_dir: str, holder: dict, timeout: float = ORPHAN_WAIT_SECONDS,
                     poll: float = 0.5) -> list:
    """Wait (at most `timeout` s, saying so on stderr) for the processes of a dead launcher's job to exit.

    After `kill -9` of a launcher its workers save at the end of their step and exit within
    ORPHAN_GRACE_SECONDS (stop_orphan): a relaunch right away waits for that save instead of
    refusing. Returns the processes still there at the end (none: the run directory is free).
    """
    left = job_processes(launcher)
    if not left:
        return []
    started = time.time()
    print(f"[launch] the launcher that held {run_dir} (PID {holder.get('pid')}) is gone; waiting up to "
          f"{timeout:.0f} s for its job's {len(left)} process(es) ({', '.join(str(p.pid) for p in left)}) to save "
          "at the end of their step and exit", file=sys.stderr, flush=True)
    while left and time.time() - started < timeout:
        time.sleep(poll)
        left = job_processes(launcher)
    if not left:
        print(f"[launch] the previous job's processes exited after {time.time() - started:.0f} s; continuing",
              file=sys.stderr, flush=True)
    return left


def send(processes, sig: int) -> None:
    for process in processes:
        try:
            os.kill(process.pid, sig)
        except ProcessLookupError:
            pass


def watch_launcher(on_gone, poll: float = 1.0) -> bool:
    """Call on_gone(launcher_pid) from a daemon thread once the launcher of this process has exited.

    False (nothing watched) when this process was not started by the launcher.
    """
    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher:
        return False

    def watch():
        while is_running(launcher):
            time.sleep(poll)
        on_gone(int(launcher.split(":")[0]))

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()
    return True


def watch_launcher_from_a_child(who: str, poll: float = 1.0) -> bool:
    """Kill this process once its launcher has exited, watching from a forked child process.

    For a process about to block in a call that holds the GIL, where watch_launcher's thread never runs:
    msrun's scheduler in MindSpore's init() retries its cluster build for ~10 minutes when the launcher
    was killed during start-up (seen in the new-user pass). The child leaves when this process does.
    """
    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher:
        return False
    parent, parent_id = os.getpid(), process_id()
    if os.fork() == 0:
        try:
            while is_running(launcher):
                if not is_running(parent_id):
                    os._exit(0)
                time.sleep(poll)
            print(f"[{who}] the launcher (pid {launcher.split(':')[0]}) is gone: stopping", file=sys.stderr,
                  flush=True)
            os.kill(parent, signal.SIGKILL)
        finally:
            os._exit(0)
    return True


def stop_orphan(who: str, launcher_pid: int, graceful: bool) -> None:
    """The launcher is gone: stop this process (a worker first saves at the end of its step), within the grace."""
    print(f"[{who}] the launcher (pid {launcher_pid}) is gone: stopping"
          f"{' (saving at the end of the current step)' if graceful else ''}; exiting within "
          f"{ORPHAN_GRACE_SECONDS} s", file=sys.stderr, flush=True)
    if graceful:
        os.kill(os.getpid(), signal.SIGTERM)  # the worker's preemption path: save at the end of the step, stop
    time.sleep(ORPHAN_GRACE_SECONDS)
    os._exit(1)


class RunDirLock:
    """RUN_DIR/launch.lock: held by the launcher that owns the run directory; says which host, PID and since when.

    The lock is an flock on the file, so it is released when its holder dies, even by kill -9;
    the file's content names the holder (empty once released). A lock left by a process that is
    gone on this host is taken over with a warning; one naming another host is not (its holder
    may be alive: flock does not cross hosts on every filesystem).
    """

    def __init__(self, run_dir: str, name: str = LOCK_FILE):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, name)
        self._fd = None

    def acquire(self) -> Optional[dict]:
        """Take the lock; returns the record of a stale holder that was taken over (None when there was none)."""
        os.makedirs(self.run_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            raise LaunchError(f"output_dir {self.run_dir} is in use: {describe_holder(holder)} (lock {self.path})",
                              hint="wait for that launch to finish, stop it (Ctrl-C, or kill -INT "
                                   f"{holder.get('pid', 'PID')}), or choose another output_dir") from None
        holder = _read_record(fd)
        refusal = self._refusal(holder)
        if refusal:
            os.close(fd)
            raise refusal
        record = {"host": platform.node(), "pid": os.getpid(), "launcher": process_id(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": shlex.join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return holder or None

    def _refusal(self, holder: dict) -> Optional[LaunchError]:
        if not holder or "unreadable" in holder:
            return None  # released, or garbage under a lock nobody holds
        if holder.get("host") != platform.node():
            return LaunchError(f"output_dir {self.run_dir} is locked by {describe_holder(holder)} (lock {self.path}); "
                               "its process cannot be checked from this host",
                               hint=f"if that job is over, delete {self.path}; otherwise choose another output_dir")
        launcher = holder.get("launcher", "")
        if launcher and is_running(launcher):
            return LaunchError(f"output_dir {self.run_dir} is in use: {describe_holder(holder)} (lock {self.path})",
                               hint="wait for that launch to finish, or choose another output_dir")
        left = wait_for_job_end(launcher, self.run_dir, holder) if launcher else []
        if left:
            pids = " ".join(str(p.pid) for p in left)
            return LaunchError(f"output_dir {self.run_dir}: the launcher that held it ({describe_holder(holder)}) is "
                               f"gone, but its processes {', '.join(str(p.pid) for p in left)} are still running "
                               f"after {ORPHAN_WAIT_SECONDS} s (they should have exited within "
                               f"{ORPHAN_GRACE_SECONDS} s)",
                               hint=f"stop them (kill {pids}; kill -9 {pids} if they do not exit), then run the "
                                    "same command again")
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _read_record(fd: int) -> dict:
    data = os.pread(fd, 65536, 0)
    try:
        return json.loads(data) if data.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {"unreadable": data[:200].decode(errors="replace")}


def describe_holder(holder: dict) -> str:
    if not holder.get("pid"):
        return "another launch (its lock record is still being written, or unreadable)"
    return (f"launch on host {holder.get('host')} by PID {holder['pid']}, started {holder.get('started')} "
            f"(`{holder.get('command', '')}`)")
