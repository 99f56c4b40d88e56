"""What the launcher says when a run fails, and what it relays of the workers' output: a disk that fills at a save,
a worker killed with -9, MindFormers' known lines, the progress line, printed commands."""

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, TINY_RECIPE

LAUNCHER = os.path.join(REPO_ROOT, "scripts", "run_distributed.sh")


@contextlib.contextmanager
def small_disk(path, size: str):
    """A tmpfs of `size` mounted at PATH, unmounted afterwards; the test is skipped where mounting is not permitted."""
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs at {path} here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(disk) -> None:
    """Write a file on DISK until the disk is full."""
    with open(os.path.join(disk, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


SIZE = r"([\d.,]+ (?:GiB|MiB|KiB|B))"  # common/units.py byte_size


def size_bytes(text: str) -> float:
    number, unit = text.split()
    return float(number.replace(",", "")) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[unit]


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.mark.drill
def test_a_disk_filled_at_a_save_names_the_save_and_the_space_free_and_the_rerun_resumes(tiny_dataset, tmp_path):
    """A 5 MiB disk holds two of the tiny recipe's 1.8 MiB checkpoints, not the third while the oldest is still kept:
    the save that fills it is named, with the free space measured after its own files are removed, in phase
    'save'; the same command on a larger disk resumes from the step before and finishes."""
    with small_disk(tmp_path / "disk", "5m") as disk:
        run_dir = disk / "run"
        command = ["bash", LAUNCHER, TINY_RECIPE, "--set", f"output_dir={run_dir}",
                   "--set", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                   "--set", "callbacks.1.save_checkpoint_steps=1", "--set", "callbacks.1.keep_checkpoint_max=2",
                   "--set", "runner_config.stop_step=6"]
        first = subprocess.run(command, capture_output=True, text=True, timeout=400)
        assert first.returncode == 1, first.stderr
        named = re.search(r"\[launch\] rank 0 failed first: exited with code 1 in phase 'save': disk full at the "
                          rf"step-(\d+) save: {SIZE} free on (.+?); this rank's checkpoint takes about {SIZE}, "
                          r"and a save needs room for one more than the 2 kept \(keep_checkpoint_max\)", first.stderr)
        assert named, first.stderr
        step, free, where, size = int(named.group(1)), size_bytes(named.group(2)), named.group(3), \
            size_bytes(named.group(4))
        assert where == f"{run_dir}/checkpoints" and step >= 3
        assert free < size + 2**19 and abs(free - shutil.disk_usage(disk).free) < 2**19
        assert not (run_dir / "checkpoints" / f"step_{step:08d}" / "rank_0").exists()  # its files removed
        assert first.stderr.rstrip().endswith(
            f"[launch] next: once the cause above is fixed, rerun the same command to resume from step {step - 1} "
            f"(the newest complete checkpoint, {run_dir}/checkpoints/step_{step - 1:08d})"), first.stderr

        subprocess.run(["mount", "-o", "remount,size=32m", str(disk)], check=True)
        second = subprocess.run(command, capture_output=True, text=True, timeout=400)
        assert second.returncode == 0, second.stderr
        assert f"[launch] resuming {run_dir} from step {step - 1}" in second.stdout
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, 7))


def test_a_rank_that_died_without_a_word_on_a_full_disk_is_said_to_have(tmp_path):
    """A rank that could not write its status (the disk was full) is named with the full disk and the save that was
    underway; its log, cut mid-line, says so."""
    from ascend_llm_recipes.training.launcher.failure_report import failure_report
    from ascend_llm_recipes.training.launcher.supervision import JobOutcome
    from ascend_llm_recipes.training.rank_status import Heartbeat, write_status

    with small_disk(tmp_path / "disk", "1m") as disk:
        run_dir = str(disk / "run")
        pid = dead_pid()
        write_status(run_dir, 0, "running", pid=pid)
        Heartbeat(run_dir, 0).beat("data", 7)
        os.makedirs(os.path.join(run_dir, "checkpoints", "step_00000007", "rank_0"))
        os.makedirs(os.path.join(run_dir, "logs"))
        with open(os.path.join(run_dir, "logs", "worker_0.log"), "w") as f:
            f.write("[step 7] loss 5.5680\n[CRITICAL] ME(16485:139631842741120,MainProcess) [mindspore/train/serial")
        fill(disk)
        report = failure_report(run_dir, [0], JobOutcome(returncode=-9, worker_pid=pid))
    lines = report.splitlines()
    headline = re.fullmatch(rf"\[launch\] rank 0 failed first: killed by signal 9 \(SIGKILL\) in phase 'data': disk "
                            rf"full at the step-7 save: {SIZE} free on (.+)/checkpoints \(the rank could not say so "
                            r"itself, and its log may be cut short\)", lines[1])
    assert headline and size_bytes(headline.group(1)) < 2**16 and headline.group(2) == run_dir, lines[1]
    assert "[mindspore/train/serial\n(the log ends here, mid-line: it was cut short)\n---" in report
    assert lines[-1] == "[launch] next: once the cause above is fixed, rerun the same command to start over (no " \
                        "checkpoint is complete)"


def test_a_killed_worker_is_reported_with_the_step_a_rerun_resumes_from_and_its_log_folded(tiny_run, tmp_path):
    """kill -9 of the worker after step 20 of the shared tiny run (steps 10, 15 and 20 saved): the report names the
    signal and the phase, shows the log's end without MindFormers' progress lines and with its step lines folded,
    and ends with the rerun that resumes from step 20, as Ctrl-C's does."""
    from ascend_llm_recipes.training.launcher.failure_report import failure_report
    from ascend_llm_recipes.training.launcher.supervision import JobOutcome
    from ascend_llm_recipes.training.rank_status import Heartbeat, write_status

    run_dir = str(tmp_path / "run")
    shutil.copytree(tiny_run[0], run_dir)
    pid = dead_pid()
    write_status(run_dir, 0, "running", pid=pid)
    Heartbeat(run_dir, 0).beat("step 21", 21)
    report = failure_report(run_dir, [0], JobOutcome(returncode=-9, worker_pid=pid))
    assert report.splitlines()[1] == "[launch] rank 0 failed first: killed by signal 9 (SIGKILL) in phase 'step 21'"
    assert report.splitlines()[-1] == ("[launch] next: rerun the same command to resume from step 20 (the newest "
                                       f"complete checkpoint, {run_dir}/checkpoints/step_00000020)")
    shown = report.split(" (MindFormers' known lines left out, repeats folded) ---\n")[1].split("\n---")[0].splitlines()
    assert len(shown) <= 25 and not any("Epoch:[" in line or "samples/s/p" in line for line in shown), shown
    steps = [line for line in shown if line.startswith("[step ")]
    folds = [i for i, line in enumerate(shown) if re.fullmatch(r"\.\.\. \(\d+ more like these\)", line)]
    assert steps and folds, shown
    for i in folds:  # between two step lines, which say how many were left out between them
        before, after = (int(re.match(r"\[step (\d+)\]", shown[j]).group(1)) for j in (i - 1, i + 1))
        assert after - before - 1 == int(re.search(r"\d+", shown[i]).group()), shown


def test_each_step_line_gives_the_progress_and_eta_to_stop_step(tiny_run):
    """MindFormers' own progress line counts to the end of the epoch (2474 steps of the tiny dataset); ours to the
    run's stop_step (20)."""
    with open(os.path.join(tiny_run[0], "logs", "worker_0.log"), encoding="utf-8") as f:
        lines = [line for line in f if line.startswith("[step ")]
    assert len(lines) == 20
    for step, line in enumerate(lines, 1):
        eta = r"ETA \d+:\d\d:\d\d, " if step > 1 else ""
        assert re.search(rf" tok/s, {step / 20:.0%} of 20 steps, {eta}MFU ", line), line
    assert " ETA 0:00:00, " in lines[-1]


def test_a_cpu_run_leaves_no_empty_folders_of_mindformers(tiny_run):
    """MindFormers' Trainer makes checkpoint/ and strategy/ in the run directory; a CPU run writes nothing there."""
    run_dir = tiny_run[0]
    assert not os.path.exists(os.path.join(run_dir, "checkpoint"))
    assert not os.path.exists(os.path.join(run_dir, "strategy"))
    assert os.listdir(os.path.join(run_dir, "log"))  # MindFormers' own log files, kept


def test_the_console_leaves_out_mindformers_known_lines_saying_why_once(tiny_run, capsys):
    """The launcher relays the worker's log: each [step N] line as it is, MindFormers' hyper_parallel warnings and
    progress lines left out (one note each, with the reason), its logger named without the run directory."""
    from ascend_llm_recipes.training.launcher.supervision import KNOWN_LINES, OutputEcho

    log = os.path.join(tiny_run[0], "logs", "worker_0.log")
    echo = OutputEcho(log)
    echo.close()
    shown = capsys.readouterr().out.splitlines()
    with open(log, encoding="utf-8") as f:
        written = f.read().splitlines()
    assert [line for line in shown if line.startswith("[step ")] == [w for w in written if w.startswith("[step ")]
    assert any("hyper_parallel" in w for w in written) and any("Epoch:[" in w for w in written)
    notes = [line for line in shown if line.startswith("[launch] ") and "left out of this output" in line]
    assert [n.split(" are left out")[0] for n in notes] == [f"[launch] {k.what}" for k in KNOWN_LINES[1:]]
    assert not any("Epoch:[" in line or "samples/s/p" in line for line in shown)
    assert [line for line in shown if "hyper_parallel" in line] == [notes[0]]
    assert not any(f"mindformers{tiny_run[0]}" in line for line in shown)
    assert any(" - mindformers[mindformers/" in line for line in shown)


def test_printed_commands_are_shell_quoted(tmp_path):
    """A path with a space in the command the launcher prints reads back as one argument."""
    run_dir = tmp_path / "my run"
    result = subprocess.run(["bash", LAUNCHER, TINY_RECIPE, "--set", f"output_dir={run_dir}"], capture_output=True,
                            text=True, env=dict(os.environ, DRY_RUN="1"), timeout=120)
    assert result.returncode == 0, result.stderr
    line = [x for x in result.stdout.splitlines() if x.startswith("[dry-run] ")][0]
    words = shlex.split(line[len("[dry-run] "):])
    assert words[words.index("--run-dir") + 1] == str(run_dir)
    assert sys.executable in words
