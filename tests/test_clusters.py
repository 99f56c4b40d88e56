"""The test clusters themselves: a real one-node Slurm cluster runs a dependency chain, a local Ray runs tasks."""

import os

import pytest


def test_slurm_cluster_runs_a_job_and_its_dependent(slurm_cluster, tmp_path):
    first = slurm_cluster.run("sbatch", "--parsable", f"--output={tmp_path}/first.out",
                              "--wrap", f"echo first on $SLURMD_NODENAME > {tmp_path}/first.txt").strip()
    # The second job reads what the first wrote: it may only start once the first has succeeded.
    second = slurm_cluster.run("sbatch", "--parsable", f"--dependency=afterok:{first}",
                               f"--output={tmp_path}/second.out", "--wrap", f"cat {tmp_path}/first.txt; echo second"
                               ).strip()
    assert slurm_cluster.wait(second) == "COMPLETED"
    assert slurm_cluster.job_state(first) == "COMPLETED"
    assert (tmp_path / "second.out").read_text() == f"first on {slurm_cluster.node}\nsecond\n"


def test_slurm_cluster_holds_a_dependent_of_a_failed_job(slurm_cluster, tmp_path):
    failed = slurm_cluster.run("sbatch", "--parsable", f"--output={tmp_path}/failed.out", "--wrap", "exit 3").strip()
    held = slurm_cluster.run("sbatch", "--parsable", f"--dependency=afterok:{failed}", "--kill-on-invalid-dep=yes",
                             f"--output={tmp_path}/held.out", "--wrap", "echo must not run").strip()
    assert slurm_cluster.wait(failed) == "FAILED"
    assert slurm_cluster.wait(held) == "CANCELLED"
    assert not (tmp_path / "held.out").exists()


def test_ray_cluster_runs_remote_tasks_in_its_own_workers(ray_cluster):
    ray = pytest.importorskip("ray")

    @ray.remote
    def square(x):
        return x * x, os.getpid()

    ray.init(address=ray_cluster.address, log_to_driver=False)
    try:
        results = ray.get([square.remote(x) for x in (2, 3)])
        cluster_pids = ray_cluster.processes()
    finally:
        ray.shutdown()
    assert [value for value, _ in results] == [4, 9]
    # The tasks ran in worker processes of the fixture's cluster, not in a Ray started on the side by ray.init.
    assert all(pid in cluster_pids for _, pid in results)
