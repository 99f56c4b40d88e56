"""Two nodes on one machine: each launcher runs in a network namespace of its own (tests/netns.py).

The run directory and the dataset are on the shared filesystem, as on a cluster. A node that
never comes, dies, runs another recipe or other code, or is given the wrong address is named.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from conftest import DP2_RECIPE, DP_STEPS, REPO_ROOT

LAUNCHER = os.path.join(REPO_ROOT, "scripts", "run_distributed.sh")
STOP = 30  # steps of the two-node runs: enough to kill one mid-run; the LR schedule ends at DP_STEPS as in the DP2 run


def settings(run_dir, dataset):
    return ["--set", "hardware.devices_per_node=1", "--set", f"output_dir={run_dir}",
            "--set", f"train_dataset.data_loader.dataset_dir={dataset}",
            "--set", "train_dataset.data_loader.shuffle=False",
            "--set", f"runner_config.stop_step={STOP}", "--set", f"lr_schedule.total_steps={DP_STEPS}",
            "--set", "callbacks.1.save_checkpoint_steps=4"]


class Launch:
    """One node's launcher, started inside its namespace; stdout and stderr go to files (a full pipe would block)."""

    started = []  # every launch of this module: any still running after a test is stopped (stop_leftovers)

    def __init__(self, node, args, out_prefix, env=None):
        self.out, self.err = f"{out_prefix}.stdout", f"{out_prefix}.stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            # ip netns exec and the launcher script exec: the launcher's Python keeps this PID
            self.proc = subprocess.Popen(node.command(["bash", LAUNCHER, *args]), stdout=out, stderr=err,
                                         env=dict(os.environ, **(env or {})))
        Launch.started.append(self)

    def finish(self, timeout=240):
        self.proc.wait(timeout)
        with open(self.out) as out, open(self.err) as err:
            return self.proc.returncode, out.read(), err.read()

    def stop(self):
        """Ctrl-C twice (the launcher kills its job at once), then SIGKILL if it is still there."""
        for sig in (signal.SIGINT, signal.SIGINT, signal.SIGKILL):
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(15 if sig == signal.SIGINT else None)
                except subprocess.TimeoutExpired:
                    pass


@pytest.fixture(autouse=True)
def stop_leftovers():
    """A failed or interrupted test leaves no launcher (nor, through it, any job process) running."""
    yield
    while Launch.started:
        Launch.started.pop().stop()


def cluster_args(nodes, rank, port, *extra):
    return ["--nodes", "2", "--node-rank", str(rank), "--master-addr", nodes[0].address, "--master-port", str(port),
            *extra]


def job_processes_of(*pids):
    """Live processes (anywhere on the machine) started under one of these launchers: the job marker env."""
    marks = [f"ASCEND_RECIPES_LAUNCHER={pid}:".encode() for pid in pids]
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, ValueError, IndexError):
            continue
        if not zombie and any(e.startswith(m) for e in env for m in marks):
            found.append(int(entry))
    return found


def losses(run_dir, name="metrics.jsonl"):
    with open(os.path.join(run_dir, name), encoding="utf-8") as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.fixture(scope="module")
def slurm_run(netns_nodes, tiny_dataset, tmp_path_factory):
    """An uninterrupted two-node run, each launcher told only what a two-node Slurm allocation sets."""
    run_dir = tmp_path_factory.mktemp("multinode") / "slurm"
    launches = [Launch(node, [DP2_RECIPE, *settings(run_dir, tiny_dataset)], f"{run_dir}.node{rank}",
                       env={"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": str(rank),
                            "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NODELIST": "node[01-02]",
                            "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2"})
                for rank, node in enumerate(netns_nodes)]
    results = [launch.finish() for launch in launches]
    for code, out, err in results:
        assert code == 0, out[-3000:] + err
    return run_dir, results


def test_two_nodes_through_slurm_train_as_one_node_with_two_workers(slurm_run, data_parallel_runs):
    run_dir, results = slurm_run
    (_, out0, _), (_, out1, _) = results
    assert "[launch] node 1 (10.231.0.2, ranks 1) joined" in out0
    assert "--master_addr=node01 --master_port=8118 --node_rank=1" in out1  # from SLURM_JOB_NODELIST
    assert "[launch] node 1 joined node 0 at node01:8119" in out1
    _, dp2 = data_parallel_runs
    assert losses(run_dir)[:DP_STEPS] == losses(dp2)  # exactly: the same global batch, the same all-reduce
    assert losses(run_dir, "metrics_rank_1.jsonl") == losses(run_dir)
    logs = ["msrun.node_0.log", "msrun.node_1.log", "scheduler.log", "worker_0.log", "worker_1.log"]
    assert sorted(os.listdir(run_dir / "logs")) == logs  # one msrun log per node in the shared run directory


def test_a_killed_node_is_named_and_both_nodes_resume_from_the_newest_checkpoint(netns_nodes, tiny_dataset, slurm_run,
                                                                                 tmp_path):
    run_dir = tmp_path / "run"
    args = [DP2_RECIPE, *settings(run_dir, tiny_dataset)]
    launches = [Launch(node, [*args, *cluster_args(netns_nodes, rank, 8120)], f"{run_dir}.node{rank}")
                for rank, node in enumerate(netns_nodes)]
    # both ranks' step-4 saves complete: each rank writes its own, and the kill must not land between them
    manifests = [run_dir / "checkpoints" / "step_00000004" / f"rank_{rank}" / "manifest.json" for rank in (0, 1)]
    deadline = time.time() + 200
    while not all(manifest.exists() for manifest in manifests):
        assert time.time() < deadline and all(la.proc.poll() is None for la in launches), "no step-4 checkpoint"
        time.sleep(0.02)
    node1 = launches[1].proc.pid
    victims = [node1, *job_processes_of(node1)]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    killed = time.time()
    code, _, err = launches[0].finish(timeout=120)
    took = time.time() - killed
    launches[1].finish()
    assert code == 6, err
    assert took < 30, took
    assert re.search(r"\[launch\] node 1 \(10\.231\.0\.2, ranks 1\) is gone \(its launcher's connection closed\); "
                     r"rank 1 in phase '(step \d+|data|save)' \(\d+ s before\)", err), err
    assert "stopped this node's part of the job (node 0, ranks 0-0); no process of it is left on this node" in err
    deadline = time.time() + 10  # processes SIGKILLed a moment ago may not be reaped yet
    while job_processes_of(launches[0].proc.pid, node1) and time.time() < deadline:
        time.sleep(0.2)
    assert job_processes_of(launches[0].proc.pid, node1) == []
    assert len(losses(run_dir)) < STOP  # it was stopped mid-run

    reruns = [Launch(node, [*args, *cluster_args(netns_nodes, rank, 8120)], f"{run_dir}.rerun{rank}")
              for rank, node in enumerate(netns_nodes)]
    (code0, out0, err0), (code1, out1, err1) = [r.finish() for r in reruns]
    assert code0 == code1 == 0, err0 + err1
    assert re.search(rf"\[launch\] resuming {run_dir} from step (4|8|12|16|20|24|28) ", out0), out0
    uninterrupted, _ = slurm_run
    assert losses(run_dir) == losses(uninterrupted)
    assert losses(run_dir, "metrics_rank_1.jsonl") == losses(uninterrupted, "metrics_rank_1.jsonl")


def test_a_node_that_never_comes_is_named_with_its_command_and_given_up_on(netns_nodes, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    started = time.time()
    alone = Launch(netns_nodes[0], [DP2_RECIPE, *settings(run_dir, tiny_dataset),
                                    *cluster_args(netns_nodes, 0, 8122, "--rendezvous-timeout", "4")],
                   f"{run_dir}.node0")
    code, out, err = alone.finish(timeout=120)
    assert code == 2, out + err
    assert time.time() - started < 60
    command = (f"bash scripts/run_distributed.sh {DP2_RECIPE} " + " ".join(settings(run_dir, tiny_dataset))
               + " --nodes 2 --node-rank 1 --master-addr 10.231.0.1 --master-port 8122 --rendezvous-timeout 4")
    assert ("[launch] node 0 of 2: waiting up to 4 s (--rendezvous-timeout) for node(s) 1 at 10.231.0.1:8123; on "
            f"each of them run:\n  {command}\n") in out
    assert "error: node(s) 1 did not join within 4 s (--rendezvous-timeout); nothing was started" in err
    assert f"start them with:\n  {command}\n" in err
    assert not (run_dir / "logs").exists() and job_processes_of(alone.proc.pid) == []


def test_a_node_with_another_recipe_and_other_code_is_refused_at_rendezvous(netns_nodes, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    args = [DP2_RECIPE, *settings(run_dir, tiny_dataset)]
    # Node 1 runs a copy of the package with one file changed (first on its PYTHONPATH), and another weight decay.
    other = tmp_path / "other_code" / "ascend_llm_recipes"
    for package in ("common", "models", "data", "training"):
        shutil.copytree(os.path.join(REPO_ROOT, package), other / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (other / "__init__.py").write_text("")
    (other / "scripts").mkdir()
    shutil.copy(os.path.join(REPO_ROOT, "scripts", "train.py"), other / "scripts")
    with open(other / "training" / "worker" / "optim.py", "a") as f:
        f.write("\n# a local edit\n")
    env = {"PYTHONPATH": f"{other.parent}:{os.environ.get('PYTHONPATH', '')}"}
    node0 = Launch(netns_nodes[0], [*args, *cluster_args(netns_nodes, 0, 8124)], f"{tmp_path}/node0")
    node1 = Launch(netns_nodes[1], [*args, "--set", "optimizer.weight_decay=0.1", *cluster_args(netns_nodes, 1, 8124)],
                   f"{tmp_path}/node1", env=env)
    (code0, _, err0), (code1, _, err1) = node0.finish(), node1.finish()
    assert code0 == code1 == 2
    differences = ("  - recipe key optimizer.weight_decay: 0.0 on node 0, 0.1 on node 1\n"
                   "  - code: 1 source file(s) differ (training/worker/optim.py)\n")
    assert "error: node 1 (10.231.0.2) does not match node 0 (10.231.0.1):\n" + differences in err0
    assert "error: refused by node 0 at 10.231.0.1:8125: node 1 (10.231.0.2) does not match" in err1
    assert differences in err1 and not (run_dir / "logs").exists()


def test_two_nodes_on_one_address_get_a_clear_message(netns_nodes, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    args = [DP2_RECIPE, *settings(run_dir, tiny_dataset), "--nodes", "2", "--master-port", "8128"]
    # Both "nodes" on 127.0.0.1, and node 1 given its own address: msrun would start a second scheduler there.
    for node, rank, address in ((netns_nodes[0], 1, "127.0.0.1"), (netns_nodes[1], 1, netns_nodes[1].address)):
        code, _, err = Launch(node, [*args, "--node-rank", str(rank), "--master-addr", address],
                              f"{tmp_path}/same{rank}").finish(timeout=60)
        assert code == 2 and "Traceback" not in err
        assert (f"error: --master-addr {address} is an address of this machine, but this is node 1: two nodes on "
                "one address cannot work (msrun would start a second scheduler on port 8128 here, which cannot "
                "bind)") in err
    code, _, err = Launch(netns_nodes[0], [*args, "--node-rank", "0", "--master-addr", "node02"],
                          f"{tmp_path}/wrong0").finish(timeout=60)
    assert code == 2
    assert ("error: --master-addr node02 (10.231.0.2) is not an address of this machine, but this is node 0, which "
            "runs msrun's scheduler and the rendezvous there") in err
    assert not run_dir.exists()


def test_a_silent_node_is_lost_after_the_node_timeout_and_a_closed_one_at_once():
    """The node heartbeat over a real socket pair; the clock of the last message is moved instead of waiting 30 s."""
    import socket
    from ascend_llm_recipes.training.launcher.rendezvous import NODE_TIMEOUT_SECONDS, Link

    def until(condition):
        deadline = time.time() + 10
        while not condition():
            assert time.time() < deadline
            time.sleep(0.01)

    ours, theirs = socket.socketpair()
    link, peer = Link(ours, "node 1 (10.0.0.2, ranks 2, 3)"), Link(theirs, "node 0")
    peer.send({"type": "beat", "phases": {"2": {"phase": "step 7", "time": time.time() - 3}, "3": None}})
    until(lambda: link.phases)
    assert link.problem() == ""
    link.last_seen -= NODE_TIMEOUT_SECONDS + 1
    assert link.problem() == (f"node 1 (10.0.0.2, ranks 2, 3) is gone (no heartbeat for {NODE_TIMEOUT_SECONDS + 1} "
                              "s); rank 2 in phase 'step 7' (3 s before), rank 3 not started")
    link.last_seen = time.time()
    peer.close()
    until(lambda: link.closed)
    assert link.problem().startswith("node 1 (10.0.0.2, ranks 2, 3) is gone (its launcher's connection closed); rank 2")

    ours, theirs = socket.socketpair()
    link, peer = Link(ours, "node 1"), Link(theirs, "node 0")
    peer.end(True, "")  # a node that finished says so before it closes: not lost
    until(lambda: link.closed)
    assert link.problem() == ""
