"""Where the stages of a preparation run execute: datatrove's executors (local processes, Slurm jobs) or Ray
tasks, chosen by `ClusterOptions` (prepare_data.py --executor/--tasks). data/cluster/scale.py (text) and
data/indexed/prepare.py (Megatron indexed corpora) hand their pipeline steps to `stage_executor`.
Needs the `scale` extra (datatrove, and ray for --executor ray); nothing here is imported by the
single-machine run.
"""

import os
import socket
import sys
from dataclasses import dataclass

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.data.cluster.tasks import DIED, TaskFailure, failure_of, raise_failures

EXECUTORS = ("local", "slurm", "ray")


@dataclass(frozen=True)
class ClusterOptions:
    """How the stages run: which executor, how many tasks at once, and the scheduler's settings."""

    executor: str = "local"
    tasks: int = 1
    workers: int = -1           # tasks running at once (-1: local, one per core; Slurm and Ray, no limit)
    partition: str = ""         # Slurm
    time: str = "24:00:00"      # Slurm
    cpus_per_task: int = 1      # Slurm
    address: str = ""           # Ray: an existing cluster ("" starts a local one)
    dry_run: bool = False       # Slurm: print the sbatch scripts, submit nothing

    def problems(self) -> list:
        from importlib.util import find_spec

        needs = [name for name in ("datatrove", "ray") if (name != "ray" or self.executor == "ray")
                 and not find_spec(name)]
        checks = [(not needs, f"--executor/--tasks need {' and '.join(needs)}: pip install -e '.[scale]'"),
                  (self.executor in EXECUTORS, f"executor {self.executor!r}: use one of {', '.join(EXECUTORS)}"),
                  (self.tasks >= 1, f"tasks {self.tasks}: must be >= 1"),
                  (self.workers >= 1 or self.workers == -1,
                   f"--workers {self.workers}: tasks at once, must be >= 1 (or -1: no limit)"),
                  (self.executor != "slurm" or bool(self.partition), "--executor slurm needs --partition"),
                  (not self.dry_run or self.executor == "slurm", "--dry-run applies to --executor slurm"),
                  (self.cpus_per_task >= 1, f"cpus_per_task {self.cpus_per_task}: must be >= 1"),
                  (not self.address or self.executor == "ray", "--address applies to --executor ray")]
        return [message for ok, message in checks if not ok]


def _ray_run_rank(executor, rank: int):
    return executor._run_for_rank(rank)


def ray_executor_class():
    """datatrove 0.3 (the newest for numpy < 2) has no Ray executor: this one runs its tasks as Ray tasks,
    with datatrove's own per-task run, logging and completion records."""
    from datatrove.executor.base import PipelineExecutor

    class RayPipelineExecutor(PipelineExecutor):
        def __init__(self, pipeline, tasks: int = 1, workers: int = -1, logging_dir=None, cpus_per_task: int = 1):
            super().__init__(pipeline, logging_dir)
            self.tasks, self.workers, self.cpus_per_task = tasks, workers, cpus_per_task

        @property
        def world_size(self) -> int:
            return self.tasks

        def run(self) -> list:
            """Run the incomplete tasks; returns the TaskFailures (after a failure, the running tasks finish and
            no new one starts)."""
            import ray
            # Per task too: a Ray that was already initialised (by the caller) did not get ray.init's runtime_env.
            remote = ray.remote(num_cpus=self.cpus_per_task, max_retries=0,
                                runtime_env=ray_runtime_env())(_ray_run_rank)
            pending, running, ranks, failures = self.get_incomplete_ranks(), [], {}, []
            limit = self.workers if self.workers > 0 else len(pending)
            while running or (pending and not failures):
                while pending and len(running) < limit and not failures:
                    running.append(remote.remote(self, pending[0]))
                    ranks[running[-1]] = pending.pop(0)
                done, running = ray.wait(running, num_returns=1)
                try:
                    ray.get(done)
                except ray.exceptions.RayTaskError as err:  # the task raised: its own exception, as if local
                    failures.append(failure_of(ranks[done[0]], err.cause, str(err)))
                except ray.exceptions.RayError as err:  # its worker process, or the node, died
                    failures.append(TaskFailure(ranks[done[0]], DIED, f"died with its Ray worker ({type(err).__name__}"
                                                f": {str(err).strip().splitlines()[0]})"))
            return failures

    return RayPipelineExecutor


def stage_executor(pipeline: list, tasks: int, cluster: ClusterOptions, logging_dir: str, job_name: str,
                   previous=None):
    """The datatrove executor of one stage on the chosen cluster (Slurm jobs depend on the `previous` stage's).
    A local one is run by data/cluster/tasks.py's watched processes (TaskPool), not by datatrove's own Pool."""
    if cluster.executor == "local":
        from datatrove.executor.local import LocalPipelineExecutor
        workers = cluster.workers if cluster.workers > 0 else (os.cpu_count() or 1)
        return LocalPipelineExecutor(pipeline, tasks=tasks, workers=min(workers, tasks), logging_dir=logging_dir,
                                     start_method="spawn")
    if cluster.executor == "ray":
        return ray_executor_class()(pipeline, tasks=tasks, workers=cluster.workers, logging_dir=logging_dir)
    return slurm_executor_class()(
        pipeline, tasks=tasks, time=cluster.time, partition=cluster.partition, cpus_per_task=cluster.cpus_per_task,
        workers=cluster.workers, job_name=job_name, logging_dir=logging_dir, depends=previous, qos="",
        env_command=_env_command(), slurm_logs_folder=os.path.join(logging_dir, "slurm_logs"))


def slurm_executor_class():
    """datatrove's Slurm executor without its stats-merging jobs: SlurmPipelineExecutor.launch_job submits, after each
    stage's array, one more job (launch_merge_stats: `merge_stats` into stats.json) that nothing here reads (the local
    and Ray runs write no stats.json either). Each took a CPU slot and a Python start beside the next stage's tasks,
    and --dry-run, which prints the stages' scripts, never showed them: a run now submits exactly those scripts."""
    from datatrove.executor.slurm import SlurmPipelineExecutor

    class StagePipelineExecutor(SlurmPipelineExecutor):
        def launch_merge_stats(self):
            pass

    return StagePipelineExecutor


def _env_command() -> str:
    """What an sbatch script runs first: this Python's bin directory on PATH (datatrove's launch_pickled_pipeline
    lives there), and this PYTHONPATH if one is set."""
    command = f"export PATH={os.path.dirname(sys.executable)}:$PATH"
    if os.environ.get("PYTHONPATH"):
        command += f"; export PYTHONPATH={os.environ['PYTHONPATH']}"
    return command


def sbatch_scripts(names: tuple, executors: list) -> str:
    """The sbatch script of each stage, as SlurmPipelineExecutor writes it, with the dependency it is submitted
    with (--dry-run)."""
    out = []
    for index, (name, executor) in enumerate(zip(names, executors)):
        max_array = min(executor.tasks, executor.max_array_size)
        script = executor.get_launch_file_contents(
            executor.get_sbatch_args(max_array),
            f"srun -l launch_pickled_pipeline {executor.logging_dir.resolve_paths('executor.pik')}")
        dependency = f" --dependency=afterok:<job id of stage {names[index - 1]}>" if index else ""
        out.append(f"# stage {index + 1}/{len(names)} {name}: {executor.tasks} task(s), submitted as: "
                   f"sbatch{dependency} {executor.logging_dir.resolve_paths('launch_script.slurm')}\n{script}")
    return "\n".join(out)


# Set in this (driver) process by common/ (as MindSpore's import sets it): a Ray worker started by a user's
# `ray start` lacks it and loads protobuf (Ray's own) before this package, so its mindspore import would die in
# protobuf ("Descriptors cannot be created directly").
WORKER_ENV = ("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION",)
CONNECT_SECONDS = 10.0


def ray_runtime_env() -> dict:
    """The runtime_env that gives Ray tasks the variables this process needs for its imports."""
    return {"env_vars": {name: os.environ[name] for name in WORKER_ENV if name in os.environ}}


def check_ray_address(address: str, seconds: float = CONNECT_SECONDS) -> None:
    """Refuse an --address that is not host:port, does not resolve or does not answer (ray.init would retry forever)."""
    check = ("check the address printed by `ray start --head` (or `ray status` on the head) and that its port is "
             "reachable from here")
    host, colon, port = address.strip().rpartition(":")
    if address.startswith(("ray://", "auto")) or address == "local":
        return  # Ray's own forms: Ray Client, and "find the cluster on this machine"
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DataError(f"--address {address!r} is not HOST:PORT", hint=f"pass the head's GCS address, e.g. "
                        f"10.0.0.1:6379; {check}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=seconds).close()
    except socket.gaierror as err:
        raise DataError(f"--address {address}: cannot resolve {host!r} ({err.strerror or err})",
                        hint=check + "; nothing was written") from None
    except OSError as err:
        raise DataError(f"--address {address}: no Ray head answers there within {seconds:g} s "
                        f"({err.strerror or err})", hint=check + "; nothing was written") from None


def connect_ray(address: str) -> None:
    """ray.init on `address` ("" starts a local Ray), its failures turned into a DataError naming the address."""
    import ray
    if address:
        check_ray_address(address)
    try:
        ray.init(address=address or None, log_to_driver=False, runtime_env=ray_runtime_env())
    except (ConnectionError, TimeoutError, ValueError, RuntimeError) as err:
        raise DataError(f"cannot connect to the Ray cluster at {address or '(a new local Ray)'}: {err}",
                        hint="check `ray status` on the head; token authentication (RAY_AUTH_MODE, "
                             "~/.ray/auth_token) must match the cluster's") from None


def run_stage(executor, name: str, pool, os_error, incomplete) -> None:
    """Run one stage's executor: on `pool` (data/cluster/tasks.py's watched processes) or by itself (Ray). A failed task
    raises its own error (data/cluster/tasks.py raise_failures, OSErrors through `os_error`); tasks left incomplete
    raise `incomplete(ranks)`."""
    failures = pool.run(executor, name) if pool else executor.run()
    left = executor.get_incomplete_ranks()
    if failures:
        raise_failures(name, failures, executor.world_size, executor.world_size - len(left), os_error)
    if left:
        raise incomplete(left)
