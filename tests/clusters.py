"""Real clusters on this machine for tests: a one-node Slurm cluster (munged, slurmctld, slurmd) and a Ray head.

Each cluster lives in its own temporary directory and marks every process it starts (and, through the inherited
environment, every process those start: slurmstepd, job scripts, Ray workers) with an environment variable naming
that directory, so that stopping it ends exactly its own processes and never another cluster on the same machine.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

MARK = "TEST_CLUSTER_ROOT"


def find_program(name):
    """Full path of a program, also looking in the sbin folders a non-root PATH often lacks; None when absent."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def free_port():
    """A TCP port nobody listens on now (the kernel's choice), so the daemons never collide with anything."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msrun_workers(tmp_path, script_text: str, env: dict = None, workers: int = 2) -> tuple:
    """Run `script_text` as `workers` msrun CPU workers in tmp_path (msrun started by this Python, so its workers
    import the package the tests run, not another install): (every "RESULT ..." line they printed, sorted, and the
    tails of their logs). A non-zero exit fails the test with those tails."""
    import glob

    script = tmp_path / "worker.py"
    script.write_text(script_text)
    logs = tmp_path / "logs"
    msrun = [sys.executable, "-c", "import sys; from mindspore.parallel.cluster.run import main; sys.exit(main())"]
    result = subprocess.run([*msrun, f"--worker_num={workers}", f"--local_worker_num={workers}",
                             f"--master_port={free_port()}", f"--log_dir={logs}", "--join=True", str(script)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, **(env or {})})
    paths = sorted(glob.glob(str(logs / "worker_*.log")))
    tails = "".join(open(p, encoding="utf-8").read()[-2000:] for p in paths)
    assert result.returncode == 0, result.stdout[-2000:] + tails
    lines = sorted(line for p in paths for line in open(p, encoding="utf-8") if line.startswith("RESULT"))
    return lines, tails


def _stat(pid):
    """(state, parent pid, start time) of a process; the start time (clock ticks since boot) with the pid is an
    identity that survives pid reuse."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[19])


def _processes():
    """{pid: (parent pid, start time)} of every live (not zombie) process now."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                state, ppid, started = _stat(int(entry))
            except OSError:  # exited meanwhile
                continue
            if state != "Z":
                table[int(entry)] = (ppid, started)
    return table


def marked_processes(root):
    """Pids of the processes whose environment carries MARK=root (read from /proc; the caller's own excluded)."""
    wanted = f"{MARK}={root}".encode()
    pids = []
    for pid in _processes():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if wanted in f.read().split(b"\0"):
                    pids.append(pid)
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return pids


def cluster_processes(root, parents):
    """{pid: start time} of a cluster's processes: those marked with root and every descendant of `parents`.

    Both are needed: Ray workers rewrite their command line and environment (setproctitle), and slurmstepd
    detaches from slurmd, so neither the environment nor the process tree alone finds everything.
    """
    table = _processes()
    children = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = set(marked_processes(root))
    stack = [p for p in parents if p in table]
    while stack:
        pid = stack.pop()
        found.add(pid)
        stack.extend(children.get(pid, []))
    return {pid: table[pid][1] for pid in found if pid in table}


def _alive(procs):
    alive = []
    for pid, started in procs.items():
        try:
            state, _, now_started = _stat(pid)
        except OSError:
            continue
        if state != "Z" and now_started == started:  # a zombie has exited; it only awaits its parent
            alive.append(pid)
    return alive


def rss_mb(pids):
    """Resident memory of these processes together, in MB."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):  # exited, or a zombie without memory
            continue
    return total / 1024


def end_processes(procs, grace=10.0):
    """Wait up to `grace` s for these processes ({pid: start time}) to exit, then SIGKILL the rest; returns those."""
    deadline = time.monotonic() + grace
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _alive(procs)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _tail(path, lines=20):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


class SlurmCluster:
    """A one-node Slurm cluster: its own munge key and munged, slurmctld and slurmd, all files under one tmp dir.

    Use `env` for every Slurm command (it sets SLURM_CONF); jobs go to `partition` on node `node`.
    """

    partition = "debug"
    cpus = 2
    programs = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "scontrol", "scancel")

    @classmethod
    def missing_programs(cls):
        """The programs this cluster needs that are not installed."""
        return [p for p in cls.programs if find_program(p) is None]

    def __init__(self):
        # A short path: munged's socket lives here and Unix socket paths stop at 108 bytes.
        self.root = tempfile.mkdtemp(prefix="slurm-")
        os.chmod(self.root, 0o711)  # munged refuses a socket in a directory others cannot traverse
        self.conf = os.path.join(self.root, "slurm.conf")
        self.munge_socket = os.path.join(self.root, "munge.socket")
        self.node = socket.gethostname().split(".")[0]
        self.env = dict(os.environ, SLURM_CONF=self.conf, **{MARK: self.root})
        self.daemons = {}
        self.startup_seconds = None

    def _write_config(self):
        key = os.path.join(self.root, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o400), "wb") as f:
            f.write(os.urandom(1024))
        os.makedirs(os.path.join(self.root, "state"))
        os.makedirs(os.path.join(self.root, "spool"))
        total_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        r = self.root
        lines = [
            "ClusterName=pytest",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/slurmctld.log",
            f"SlurmdLogFile={r}/slurmd.log",
            # No cgroups: containers and CI machines rarely delegate them; linuxproc finds a job's processes by parent.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            # Schedule on each submission or completion (default: batched every 3 s), so a dependency chain of
            # short jobs takes seconds, not tens of seconds.
            "SchedulerParameters=batch_sched_delay=0",
            "MpiDefault=none",
            "ReturnToService=2",
            # The node is declared with 2 CPUs whatever the machine has, so tests see the same cluster everywhere.
            "SlurmdParameters=config_overrides",
            # Cancelled jobs get SIGKILL 2 s after SIGTERM (default 30 s), so teardown is quick.
            "KillWait=2",
            # Finished jobs stay visible to scontrol for an hour (default 5 min), so a test can read a job's end
            # state whenever it looks, late in a long session too.
            "MinJobAge=3600",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={min(2048, total_mb // 2)}"
            " State=UNKNOWN",
            f"PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        return key

    def _spawn(self, name, argv):
        log = open(os.path.join(self.root, f"{name}.out"), "wb")
        self.daemons[name] = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True)
        log.close()

    def _check_alive(self):
        for name, proc in self.daemons.items():
            if proc.poll() is not None:
                logs = "\n".join(f"--- {f}\n{_tail(os.path.join(self.root, f))}"
                                 for f in (f"{name}.out", f"{name}.log") if os.path.exists(os.path.join(self.root, f)))
                raise RuntimeError(f"{name} exited with code {proc.returncode} while the test cluster started "
                                   f"(files in {self.root}):\n{logs}")

    def start(self, timeout=60.0):
        """Write the configuration, start the daemons and wait until the node is idle."""
        t0 = time.monotonic()
        key = self._write_config()
        self._spawn("munged", [find_program("munged"), "--foreground", f"--key-file={key}",
                               f"--socket={self.munge_socket}", f"--pid-file={self.root}/munged.pid",
                               f"--log-file={self.root}/munged.log", f"--seed-file={self.root}/munged.seed"])
        deadline = t0 + timeout
        while not os.path.exists(self.munge_socket):
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not create {self.munge_socket} within {timeout} s")
            time.sleep(0.05)
        self._spawn("slurmctld", [find_program("slurmctld"), "-D", "-f", self.conf])
        self._spawn("slurmd", [find_program("slurmd"), "-D", "-f", self.conf, "-N", self.node])
        state = ""
        while state != "idle":
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {self.node} not idle after {timeout} s (state {state!r}); "
                                   f"slurmctld log:\n{_tail(os.path.join(self.root, 'slurmctld.log'))}")
            time.sleep(0.2)
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T", "-n", self.node], env=self.env,
                                 capture_output=True, text=True)
            state = out.stdout.strip()
        self.startup_seconds = time.monotonic() - t0
        # In-process clients (ray.init in the test) read it from os.environ; restored by stop().
        self._saved_auth = (os.environ.get("RAY_AUTH_MODE"),)
        os.environ["RAY_AUTH_MODE"] = "disabled"

    def run(self, *argv):
        """Run a Slurm client command against this cluster; returns its stdout, raises with its stderr on failure."""
        out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout

    def job_state(self, job_id):
        """The job's state as slurmctld reports it (PENDING, RUNNING, COMPLETED, FAILED, ...)."""
        fields = dict(f.split("=", 1) for f in self.run("scontrol", "-o", "show", "job", str(job_id)).split()
                      if "=" in f)
        return fields["JobState"]

    def wait(self, job_id, timeout=60.0):
        """Wait until the job has ended and return its final state."""
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job_id)) in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout} s")
            time.sleep(0.2)
        return state

    def processes(self):
        """{pid: start time} of the cluster's processes now: daemons, job steps and jobs."""
        return cluster_processes(self.root, [p.pid for p in self.daemons.values()])

    def stop(self):
        """Cancel every job, stop the daemons, remove the cluster's files; returns the pids that had to be killed."""
        try:
            if self.daemons.get("slurmctld") and self.daemons["slurmctld"].poll() is None:
                subprocess.run(["scancel", "--partition", self.partition], env=self.env, capture_output=True,
                               timeout=30)
            procs = self.processes()
            for name in ("slurmd", "slurmctld", "munged"):
                proc = self.daemons.get(name)
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            return end_processes({**procs, **self.processes()})
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


class RayCluster:
    """A local Ray head (`ray start --head --block` on 127.0.0.1) whose processes all end with `stop`.

    Connect with `ray.init(address=cluster.address)`, pass `address` to a tool's --address, or run a subprocess
    with `env` (it sets RAY_ADDRESS, which a bare `ray.init()` follows).
    """

    num_cpus = 2

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="ray-")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Like a user's `ray start`: without the protobuf variable mindspore sets in its importer only (so a test
        # sees what a user's cluster does), and with token auth off whatever ~/.ray/auth_token holds.
        self.env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
        self.env.update(RAY_ADDRESS=self.address, RAY_AUTH_MODE="disabled", **{MARK: self.root})
        self._saved_auth = None
        self.log = os.path.join(self.root, "ray-start.out")
        self.proc = None
        self.startup_seconds = None

    def start(self, timeout=60.0):
        """Start the head and wait until `ray start` reports the runtime started."""
        t0 = time.monotonic()
        # This Python's Ray (not the first `ray` on PATH): its workers run this Python, so they import the
        # package under test.
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                "--node-ip-address", "127.0.0.1", "--port", str(self.port), "--num-cpus", str(self.num_cpus),
                "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", os.path.join(self.root, "t"),
                # Ports Ray fixes by default (8265, 52365) would collide with any other Ray on the machine.
                "--dashboard-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
                # It forwards workers' prints to drivers; tests read results, and it costs a process (~4 s, 80 MB).
                "--include-log-monitor", "false",
                # Nor the autoscaler's monitor (ray/scripts/scripts.py --no-monitor, "the ray autoscaler monitor for
                # this cluster will not be started"): a one-node cluster of fixed size never scales, and `ray start`
                # starts it in series before the raylet (~2-3 s of the start-up, ~1 CPU-s).
                "--no-monitor",
                # Ray's default object store takes 30% of RAM; tests move kilobytes.
                "--object-store-memory", str(100 * 2**20)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        while "Ray runtime started" not in _tail(self.log, 200):
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with code {self.proc.returncode}:\n{_tail(self.log)}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"ray start not ready after {timeout} s:\n{_tail(self.log)}")
            time.sleep(0.1)
        self.startup_seconds = time.monotonic() - t0
        # In-process clients (ray.init in the test) read it from os.environ; restored by stop().
        self._saved_auth = (os.environ.get("RAY_AUTH_MODE"),)
        os.environ["RAY_AUTH_MODE"] = "disabled"

    def processes(self):
        """{pid: start time} of the cluster's processes now: head services, agents and workers."""
        return cluster_processes(self.root, [self.proc.pid] if self.proc is not None else [])

    def stop(self):
        """Stop the head (its --block process shuts its own processes down) and remove its files.

        Returns the pids that outlived the graceful stop and had to be killed (none when Ray cleaned up).
        """
        if self._saved_auth is not None:
            if self._saved_auth[0] is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = self._saved_auth[0]
            self._saved_auth = None
        try:
            procs = self.processes()
            if self.proc is not None and self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            return end_processes({**procs, **self.processes()})
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
