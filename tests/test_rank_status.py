"""Each rank's status and heartbeat files: written by the worker's writers, read by the launcher's supervision
and failure report, both through training/rank_status.py."""

import ast
import glob
import os
import time

from conftest import REPO_ROOT
from ascend_llm_recipes.training.launcher.failure_report import failed_ranks, failure_report
from ascend_llm_recipes.training.launcher.supervision import JobOutcome, rank_failing, stalled_ranks
from ascend_llm_recipes.training.rank_status import Heartbeat, read_heartbeat, read_status, write_status


def test_the_launcher_reads_what_the_worker_writes(tmp_path):
    run_dir, started = str(tmp_path), time.time()
    for rank, phase in ((0, "step 3"), (1, "eval"), (2, "done")):
        Heartbeat(run_dir, rank).beat(phase, 3)
    write_status(run_dir, 0, "running")
    write_status(run_dir, 1, "failed", error="ValueError: boom")
    write_status(run_dir, 2, "done", preempted=False, rollback=None)
    assert read_status(run_dir, 1)["error"] == "ValueError: boom" and read_status(run_dir, 1)["pid"] == os.getpid()
    assert read_heartbeat(run_dir, 0)["phase"] == "step 3" and read_heartbeat(run_dir, 3) is None

    later = time.time() + 60
    assert [(rank, phase) for rank, phase, *_ in stalled_ranks(run_dir, range(4), 30, started, later)] == \
        [(0, "step 3"), (1, "eval"), (3, "not started")]  # rank 2 is done
    assert stalled_ranks(run_dir, range(4), 30, started, time.time()) == []
    # monitoring.startup_timeout, when set, is the limit of a rank still starting (until its first step ends).
    Heartbeat(run_dir, 2).beat("compile")

    def limits(now):
        return [(rank, phase, limit) for rank, phase, _, limit in
                stalled_ranks(run_dir, range(4), 30, started, now, startup_timeout=120)]
    assert limits(later) == [(0, "step 3", 30), (1, "eval", 30)]
    assert limits(started + 180) == [(0, "step 3", 30), (1, "eval", 30), (2, "compile", 120), (3, "not started", 120)]
    Heartbeat(run_dir, 2).beat("done", 3)
    # Rank 0 says running and its process (this one) is alive; rank 1 said failed.
    assert [rank_failing(run_dir, rank, started) for rank in range(4)] == [False, True, False, False]
    assert not rank_failing(run_dir, 1, time.time() + 1)  # a status older than the launch is a previous run's
    assert failed_ranks(run_dir, range(4)) == [(0, "killed or crashed", ""), (1, "failed", "ValueError: boom"),
                                               (3, "never started", "")]
    report = failure_report(run_dir, range(4), JobOutcome(returncode=1, seen_failing={1: 2}))
    assert report.splitlines()[:2] == ["[launch] training failed (msrun exit code 1)",
                                       "[launch] rank 1 failed first: reported a failure in phase 'eval': "
                                       "ValueError: boom"]
    assert f"--- last 25 lines of {run_dir}/logs/worker_0.log (MindFormers' known lines left out, repeats folded) " \
           "---\n(no log at" in report
    assert "rank 1: failed (last phase 'eval'" in report and report.count("ValueError: boom") == 1  # in the headline


def test_only_rank_status_opens_the_ranks_files():
    """status_path and heartbeat_path are used by training/rank_status.py alone: one place for each file's format."""
    users = []
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "training", "**", "*.py"), recursive=True)
                       + glob.glob(os.path.join(REPO_ROOT, "scripts", "*.py"))):
        if os.path.basename(path) in ("run_files.py", "rank_status.py"):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        names = [(node.lineno, node.id if isinstance(node, ast.Name) else node.attr) for node in ast.walk(tree)
                 if isinstance(node, (ast.Name, ast.Attribute))]
        users += [f"{os.path.relpath(path, REPO_ROOT)}:{line}: {name}" for line, name in names
                  if name in ("status_path", "heartbeat_path")]
    assert users == [], "\n".join(users)


def test_a_finished_job_is_ended_without_its_scheduler_only_when_every_worker_exited_0(tmp_path):
    """The launcher reads how msrun's workers exited: a zombie's status before msrun reaps it, msrun's log after."""
    import subprocess
    from ascend_llm_recipes.training.launcher.supervision import (exit_statuses, msrun_done_with_workers,
                                                                  workers_ended_well)

    log = tmp_path / "msrun.log"
    log.write_text("Distributed job is spawned. Waiting all processes to exit...\n")
    running = subprocess.Popen(["sleep", "30"])
    good, bad = subprocess.Popen(["sh", "-c", "exit 0"]), subprocess.Popen(["sh", "-c", "exit 3"])
    try:
        deadline = time.time() + 10
        while len(exit_statuses([good.pid, bad.pid])) < 2:  # zombies until reaped below
            assert time.time() < deadline
            time.sleep(0.01)
        assert exit_statuses([good.pid, bad.pid]) == {good.pid: 0, bad.pid: 3 << 8}
        assert exit_statuses([good.pid, running.pid]) == {}  # one still runs
        assert workers_ended_well(log, [good.pid]) and not workers_ended_well(log, [good.pid, bad.pid])
        assert not workers_ended_well(log, [good.pid, running.pid])
        assert not msrun_done_with_workers(log, [good.pid, bad.pid])  # not reaped, nothing logged yet
    finally:
        running.kill()
        for p in (running, good, bad):
            p.wait()
    # Reaped: msrun logged the failure as it reaped it (mindspore/parallel/cluster/process_entity/_api.py:364).
    assert exit_statuses([good.pid, bad.pid]) == {good.pid: None, bad.pid: None}
    assert msrun_done_with_workers(log, [good.pid, bad.pid]) and workers_ended_well(log, [good.pid, bad.pid])
    with open(log, "a") as f:
        f.write(f"[ERROR] ME(1:2,MainProcess):2026-12-02-07:42:33.851.000 [mindspore/parallel/cluster/process_entity/"
                f"_api.py:364] Worker process {bad.pid} exit with exception. Error code: 3.\n")
    assert not workers_ended_well(log, [good.pid, bad.pid])
