"""Dataset preparation in N tasks on datatrove (data/cluster/scale.py): the same documents and tokens as one process,
duplicates removed across tasks, a killed task redone alone, changed arguments refused, Ray and Slurm."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT, load_script
from ascend_llm_recipes.data.text.corpus import python_stdlib_files
from ascend_llm_recipes.data.loader import load_sources
from ascend_llm_recipes.data.mindrecord_io import partial_dir, read_manifest, read_samples, verify_files
from ascend_llm_recipes.data.prepare import check_dataset, prepare_dataset
from ascend_llm_recipes.data.tokenizer import EOD_ID, PAD_ID, load_tokenizer
from ascend_llm_recipes.common.errors import DataError

pytest.importorskip("datatrove", reason="datatrove is not installed: pip install -e .[scale]")

SCRIPT = os.path.join(REPO_ROOT, "scripts", "prepare_data.py")
# Small enough to be quick, large enough that the tokenizer trains on a hash-chosen sample (4x this < input).
OPTIONS = {"near_dedup": True, "val_fraction": 0.1, "vocab_size": 512, "tokenizer_sample_chars": 25_000,
           "samples_per_shard": 64}
FLAGS = ["--near-dedup", "--val-fraction", "0.1", "--vocab-size", "512", "--tokenizer-sample-chars", "25000",
         "--samples-per-shard", "64", "--seq-length", "64", "--no-progress"]
DOC_CHARS = 4000  # each stdlib module's head: ~280k characters in all, ~8 shards per task


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two JSONL files of stdlib modules (the second one large enough to be cut inside), with exact and near
    duplicates across files (so across tasks); the single-process dataset and the 4-task one built from them."""
    root = tmp_path_factory.mktemp("scale")
    texts = [f.read_text(encoding="utf-8") for f in python_stdlib_files()[60:150]]
    texts = [t[:DOC_CHARS] for t in texts if len(t) > 200]
    near = [t.replace("def ", "def  ", 2) + "\n# one more comment line" for t in texts[3:6]]
    first = texts[:30]
    second = texts[30:] + texts[10:14] + near  # exact copies of first-file documents, then near copies
    inputs = []
    for name, docs in (("a.jsonl", first), ("b.jsonl", second)):
        with open(root / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in docs)
        inputs.append(str(root / name))
    one = prepare_dataset(str(root / "one"), 64, inputs=inputs, show_progress=False, workers=0, **OPTIONS)
    four = prepare_dataset(str(root / "four"), 64, inputs=inputs, show_progress=False, tasks=4, workers=1, **OPTIONS)
    return root, inputs, one, four


def task_documents(dataset_dir):
    """Each task's stream-packed shards -> its token stream -> documents split at EOD, decoded; tasks in order."""
    manifest = read_manifest(dataset_dir)
    sp = load_tokenizer(os.path.join(dataset_dir, "tokenizer.model"))
    rows, by_file = list(read_samples(dataset_dir, manifest)), {}
    for shard in manifest["shards"]:
        by_file[shard["file"]], rows = rows[:shard["samples"]], rows[shard["samples"]:]
    key = "validation_shards" if manifest["split"] == "validation" else "shards"
    groups = [t[key] for t in manifest["tasks"]["list"]] if "tasks" in manifest else \
        [[s["file"] for s in manifest["shards"]]]
    docs = []
    for shards in groups:
        samples = [row for name in shards for row in by_file[name]]
        if not samples:
            continue
        stream = list(samples[0]) + [t for s in samples[1:] for t in s[1:]]
        while stream and stream[-1] == PAD_ID:
            stream.pop()
        current = []
        for token in stream:
            if token == EOD_ID:
                docs.append(sp.decode(current))
                current = []
            else:
                current.append(int(token))
        assert not current
    return docs


def shard_bytes(dataset_dir):
    return [open(os.path.join(dataset_dir, s["file"]), "rb").read() for s in read_manifest(dataset_dir)["shards"]]


def test_four_tasks_keep_the_single_process_documents_and_tokens(corpus):
    root, _, one, four = corpus
    assert four["documents"] == one["documents"]
    assert (one["documents"]["duplicates"], one["documents"]["near_duplicates"]) == (4, 3)  # across files/tasks
    assert four["tokens"] == one["tokens"] and four["validation"]["tokens"] == one["validation"]["tokens"]
    assert task_documents(str(root / "four")) == task_documents(str(root / "one"))
    assert task_documents(str(root / "four-val")) == task_documents(str(root / "one-val"))
    # The tokenizer is trained once, on the same hash-chosen sample as the single process's.
    assert four["tokenizer"]["sha256"] == one["tokenizer"]["sha256"] and four["tokenizer"]["trained_on"] \
        == one["tokenizer"]["trained_on"]
    assert (root / "four" / "near_duplicates.jsonl").read_bytes() == \
        (root / "one" / "near_duplicates.jsonl").read_bytes()
    tasks = four["tasks"]["list"]
    assert len(tasks) == 4 and sum(t["tokens"] for t in tasks) == four["tokens"]
    assert any(t["start"]["offset"] > 0 for t in tasks), "no task starts inside a file"
    assert four["padding_rate"] < 0.001 and four["samples"] >= one["samples"]
    # One dataset that training reads as it reads any other: verified, checked against the model, blendable.
    verify_files(str(root / "four"), four)
    check_dataset(str(root / "four"), 64, 512, PAD_ID, EOD_ID)
    sources = load_sources([(str(root / "four"), 1.0, "four"), (str(root / "one"), 1.0, "one")])
    assert [s.samples for s in sources] == [four["samples"], one["samples"]]
    assert not os.path.exists(partial_dir(str(root / "four")))


def command(inputs, out, tokenizer):
    # The 4-task dataset's own tokenizer: the same tokens as training it again, for less CPU.
    return [sys.executable, SCRIPT, "--input", *inputs, "--output", str(out), "--tasks", "4", "--workers", "1",
            "--tokenizer", tokenizer, *FLAGS]


def linked_inputs(inputs, directory):
    """`directory` holding links to the corpus files and one dangling link, as a user's input folder might."""
    directory.mkdir()
    for path in inputs:
        os.symlink(path, directory / os.path.basename(path))
    os.symlink(directory / "moved-away.jsonl", directory / "c.jsonl")
    return [str(directory)]


@pytest.mark.drill
def test_a_killed_task_is_redone_alone_and_changed_arguments_are_refused(corpus, tmp_path, capsys):
    root, inputs, _, four = corpus
    out = tmp_path / "ds"
    done = tmp_path / "ds.logs" / "pack" / "completions" / "00000"
    tokenizer = str(root / "four" / "tokenizer.model")
    inputs = linked_inputs(inputs, tmp_path / "in")
    proc = subprocess.Popen(command(inputs, out, tokenizer), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 240
    while not done.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the job, in the middle of its pack stage
    proc.wait()
    assert done.exists() and not out.exists(), "the run ended before it could be killed"
    finished = sorted(os.listdir(done.parent))
    assert "00003" not in finished
    task0 = partial_dir(str(out)) + "/state/scale/tasks/00000"
    inodes = {name: os.stat(os.path.join(task0, name)).st_ino for name in os.listdir(task0)
              if name.endswith("mindrecord")}

    options = {**OPTIONS, "samples_per_shard": 32}
    with pytest.raises(DataError, match=r"holds an interrupted run with other arguments .*samples_per_shard 64 -> 32"
                                        r".*tasks 4 -> 3"):
        prepare_dataset(str(out), 64, inputs=inputs, tokenizer=tokenizer, show_progress=False, tasks=3, workers=1,
                        **options)

    # The user removes the dangling link the first run warned about: nothing it read changes, so it continues.
    os.remove(tmp_path / "in" / "c.jsonl")
    capsys.readouterr()
    code, err = run_cli(command(inputs, out, tokenizer)[2:], capsys)  # the same command, in this process
    assert code == 0, err[-3000:]
    assert f"stage pack: {len(finished)} of its 4 tasks already completed, running the other" in err
    assert {name: os.stat(out / name).st_ino for name in inodes} == inodes  # task 0's shards were not rewritten
    manifest = read_manifest(str(out))
    assert manifest["shards"] == four["shards"] and manifest["documents"] == four["documents"]
    assert manifest["bad_input"]["counts"]["unreadable"] == 0 and manifest["inputs"]["missing"] == []
    assert shard_bytes(str(out)) == shard_bytes(str(root / "four"))


def descendants(pid):
    """The pids below `pid` in the process tree (from /proc)."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        below = children.get(stack.pop(), [])
        found += below
        stack += below
    return found


def holding(pids, fragment):
    """(pid, path) of a process among `pids` with an open file whose path contains `fragment`, or None."""
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
                if fragment in path:
                    return pid, path
        except OSError:
            continue
    return None


def kill_a_pack_task(pids, deadline, relist=0.25):
    """SIGKILL the process running a pack task (it holds datatrove's task log open); returns (pid, task).
    `pids()` walks all of /proc, so it runs every `relist` s; the few processes it found are watched every 5 ms."""
    watched, listed = [], 0.0
    while time.time() < deadline:
        if time.time() - listed >= relist:
            watched, listed = pids(), time.time()
        found = holding(watched, "/pack/logs/task_")
        if found:
            os.kill(found[0], signal.SIGKILL)
            return found[0], int(found[1].rsplit("task_", 1)[1][:5])
        time.sleep(0.005)
    raise AssertionError("no pack task was seen running")


@pytest.mark.drill
def test_a_task_killed_by_a_signal_stops_the_run_naming_it_and_a_rerun_continues(corpus, tmp_path, capsys):
    root, inputs, _, four = corpus
    out = tmp_path / "ds"
    tokenizer = str(root / "four" / "tokenizer.model")
    argv = command(inputs, out, tokenizer)
    argv[argv.index("--workers") + 1] = "2"
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pid, task = kill_a_pack_task(lambda: descendants(proc.pid), time.time() + 240)
        _, stderr = proc.communicate(timeout=120)  # datatrove's own pool waited forever here
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, stderr
    assert f"error: stage pack: task {task} (pid {pid}) was killed by SIGKILL" in stderr, stderr
    assert "HINT: rerun the same command to continue: it redoes only the unfinished tasks" in stderr
    assert "Traceback" not in stderr and not out.exists()
    capsys.readouterr()
    code, err = run_cli(argv[2:], capsys)  # the same command, in this process
    assert code == 0, err[-3000:]
    assert "stage pack:" in err and "already completed, running the other" in err
    assert shard_bytes(str(out)) == shard_bytes(str(root / "four"))


@pytest.fixture(scope="module")
def ray_driver(ray_cluster):
    """ray_cluster's address for the module's Ray runs, which leave this process connected (prepare_dataset connects
    it on the first run, connect_ray, and later runs use that connection) until the module's end. A Ray worker belongs
    to its driver's job: one connection for all the runs keeps the workers that imported the package, datatrove and
    MindSpore (~7 CPU-s each) for the next run, where a disconnect after each test had every test start its own."""
    import ray

    try:
        yield ray_cluster.address
    finally:
        ray.shutdown()


@pytest.mark.drill
def test_a_dead_ray_worker_names_its_task_and_a_rerun_continues(corpus, tmp_path, ray_driver):
    import threading

    root, inputs, _, four = corpus
    out = str(tmp_path / "ray")
    killed = []

    def ray_workers():  # idle ones too ("ray::IDLE"): a worker is renamed by the task it takes, between two listings
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).startswith("ray::")]

    watcher = threading.Thread(target=lambda: killed.append(kill_a_pack_task(ray_workers, time.time() + 240)),
                               daemon=True)
    kwargs = dict(inputs=inputs, tokenizer=str(root / "four" / "tokenizer.model"), show_progress=False, tasks=4,
                  executor="ray", cluster={"address": ray_driver}, **OPTIONS)
    watcher.start()
    with pytest.raises(DataError, match=r"(?s)stage pack: task \d died with its Ray worker \(WorkerCrashedError"
                                        r".*rerun the same command to continue") as err:
        prepare_dataset(out, 64, **kwargs)
    watcher.join(5)
    assert f"task {killed[0][1]} died" in str(err.value)
    manifest = prepare_dataset(out, 64, **kwargs)
    assert manifest["shards"] == four["shards"] and shard_bytes(out) == shard_bytes(str(root / "four"))


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.drill
def test_a_full_disk_in_a_task_names_the_output_and_space_needed_and_a_rerun_continues(corpus, tmp_path, capsys):
    """A real full disk (tmpfs) under a 4-task run: the pack tasks cannot write their shards."""
    root, inputs, _, four = corpus
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    used = sum(os.lstat(os.path.join(root / "four", n)).st_blocks * 512 for n in os.listdir(root / "four"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={(10 << 10) + used // 2 // 1024}k", "tmpfs",
                              str(disk)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        out = disk / "ds"
        argv = command(inputs, out, str(root / "four" / "tokenizer.model"))
        full = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert full.returncode == 2, full.stderr
        assert "Traceback" not in full.stderr and "Loguru" not in full.stderr, full.stderr
        assert re.search(rf"error: disk full while writing dataset {re.escape(str(out))}: "
                         r"[\d.,]+ (GiB|MiB|KiB|B) free, [\d.,]+ (GiB|MiB|KiB|B) "
                         r"needed to finish", full.stderr), full.stderr
        assert re.search(r"HINT: free at least [\d.,]+ (GiB|MiB|KiB|B) more on that disk, "
                         r"then rerun the same command: it redoes "
                         r"only the unfinished tasks", full.stderr), full.stderr
        assert not out.exists()
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        capsys.readouterr()
        code, err = run_cli(argv[2:], capsys)  # the same command, in this process
        assert code == 0, err[-3000:]
        assert shard_bytes(str(out)) == shard_bytes(str(root / "four"))
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_dangling_link_among_the_inputs_is_announced_and_counted_as_unreadable(corpus, tmp_path, capsys):
    root, inputs, _, _ = corpus
    tokenizer = str(root / "four" / "tokenizer.model")
    inputs = linked_inputs(inputs[:1], tmp_path / "in")
    link = f"{tmp_path / 'in' / 'c.jsonl'}: a symbolic link to {tmp_path / 'in' / 'moved-away.jsonl'}, which does " \
           "not exist"
    with pytest.raises(DataError, match=r"(?s)bad input: .*c\.jsonl: a symbolic link to .*nothing was written"):
        prepare_dataset(str(tmp_path / "strict"), 64, inputs=inputs, tokenizer=tokenizer, strict=True, tasks=2)
    assert sorted(os.listdir(tmp_path)) == ["in"]
    manifests = [prepare_dataset(str(tmp_path / f"t{tasks}"), 64, inputs=inputs, tokenizer=tokenizer,
                                 show_progress=False, tasks=tasks, workers=0 if tasks == 1 else 1)
                 for tasks in (1, 2)]
    assert capsys.readouterr().err.count(f"prepare: skipping 1 unreadable input(s), counted in the manifest "
                                         f"(--strict stops instead): {link}") == 2
    for manifest in manifests:
        assert manifest["bad_input"]["counts"]["unreadable"] == 1 and manifest["bad_input"]["first"]["unreadable"] \
            == link
        assert manifest["inputs"]["files"] == 1 and manifest["inputs"]["missing"] == [str(tmp_path / "in" / "c.jsonl")]
    assert manifests[0]["documents"] == manifests[1]["documents"]


def test_ray_run_writes_the_same_dataset_as_local_tasks(corpus, tmp_path, ray_driver):
    root, inputs, _, four = corpus
    manifest = prepare_dataset(str(tmp_path / "ray"), 64, inputs=inputs, show_progress=False, tasks=4,
                               executor="ray", cluster={"address": ray_driver}, **OPTIONS)
    assert manifest["documents"] == four["documents"] and manifest["shards"] == four["shards"]
    assert shard_bytes(str(tmp_path / "ray")) == shard_bytes(str(root / "four"))


def test_slurm_dry_run_prints_one_sbatch_script_per_stage_with_dependencies(corpus, tmp_path, capsys):
    _, inputs, _, _ = corpus
    out = tmp_path / "slurm"
    result = prepare_dataset(str(out), 64, inputs=inputs, show_progress=False, tasks=3, executor="slurm",
                             cluster={"partition": "batch", "time": "02:00:00", "cpus_per_task": 2, "dry_run": True},
                             **OPTIONS)
    assert result is None and not out.exists() and not os.path.exists(partial_dir(str(out)))
    printed = capsys.readouterr().out
    stages = printed.split("# stage ")[1:]
    assert [s.split(":")[0] for s in stages] == ["1/4 signatures", "2/4 decide", "3/4 pack", "4/4 merge"]
    for stage, array in zip(stages, ("0-2", "0-0", "0-2", "0-0")):
        header, script = stage.split("\n", 1)
        assert f"#SBATCH --array={array}\n" in script and "#SBATCH --partition=batch\n" in script
        assert "#SBATCH --time=02:00:00\n" in script and "#SBATCH --cpus-per-task=2\n" in script
        assert "srun -l launch_pickled_pipeline " in script and os.path.dirname(sys.executable) in script
        assert ("--dependency=afterok:" in header) == (not stage.startswith("1/4"))
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # a valid script


def test_slurm_run_on_a_real_cluster(corpus, tmp_path, slurm_cluster):
    cluster = slurm_cluster
    root, inputs, one, _ = corpus
    out = tmp_path / "slurm"
    # Shards of 1024 samples (the last flag wins): 2 per task instead of ~20, each a MindRecord writer and a hash of
    # its 17 MB file, ~10 s of the pack stage; documents and tokens do not depend on where shards end.
    submit = subprocess.run([sys.executable, SCRIPT, "--input", *inputs, "--output", str(out), "--tasks", "2",
                             "--executor", "slurm", "--partition", cluster.partition, "--time", "00:10:00", *FLAGS,
                             "--samples-per-shard", "1024"],
                            capture_output=True, text=True, timeout=120, env=cluster.env, cwd=tmp_path)
    assert submit.returncode == 0, submit.stderr[-3000:]
    deadline = time.time() + 240
    while not (out / "manifest.json").exists() and time.time() < deadline:
        time.sleep(0.1)
    assert (out / "manifest.json").exists(), "the Slurm stages did not finish: " + \
        "".join(open(os.path.join(d, f)).read()[-2000:] for d, _, fs in os.walk(str(out) + ".logs") for f in fs
                if f.endswith(".out"))
    manifest = read_manifest(str(out))
    assert manifest["documents"] == one["documents"] and manifest["tokens"] == one["tokens"]
    assert task_documents(str(out)) == task_documents(str(root / "one"))


def test_the_single_machine_default_imports_neither_datatrove_nor_ray(corpus, tmp_path):
    root, inputs, _, _ = corpus
    code = ("import sys\nfrom ascend_llm_recipes.data.prepare import prepare_dataset\n"
            f"prepare_dataset({str(tmp_path / 'one')!r}, 64, inputs={inputs[:1]!r}, "
            f"tokenizer={str(root / 'one' / 'tokenizer.model')!r}, show_progress=False, workers=0)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('datatrove', 'ray')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_scheduler_arguments_are_checked_before_anything_is_written(corpus, tmp_path):
    _, inputs, _, _ = corpus
    with pytest.raises(DataError, match="--executor slurm needs --partition.*--max-documents needs the single"):
        prepare_dataset(str(tmp_path / "x"), 64, inputs=inputs, executor="slurm", tasks=2, max_documents=5)
    with pytest.raises(DataError, match="tasks 0: must be >= 1"):
        prepare_dataset(str(tmp_path / "x"), 64, inputs=inputs, tasks=0)
    assert not os.listdir(tmp_path)


def run_cli(args, capsys):
    """scripts/prepare_data.py's main in this process: (exit code, stderr)."""
    code = load_script("prepare_data").main(args)
    return code, capsys.readouterr().err


def test_a_wrong_ray_address_is_refused_at_once_and_leaves_nothing(corpus, tmp_path, capsys):
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e .[scale]")
    from clusters import free_port
    ray.shutdown()  # prepare_dataset runs on a Ray this process is already connected to (ray_driver), whatever address
    _, inputs, _, _ = corpus
    out = str(tmp_path / "out")
    for address, message in (("garbage", "--address 'garbage' is not HOST:PORT"),
                             (f"127.0.0.1:{free_port()}", "no Ray head answers there"),
                             ("no-such-host.invalid:6379", "cannot resolve 'no-such-host.invalid'")):
        began = time.monotonic()
        code, err = run_cli(["--input", *inputs, "--output", out, *FLAGS, "--executor", "ray", "--tasks", "2",
                             "--address", address], capsys)
        assert code == 2 and message in err and "ray status" in err and "internal error" not in err, err
        assert time.monotonic() - began < 15
    assert sorted(os.listdir(tmp_path)) == []


def test_options_of_another_executor_are_refused(corpus, tmp_path, capsys):
    _, inputs, _, _ = corpus
    base = ["--input", *inputs, "--output", str(tmp_path / "out"), *FLAGS]
    for extra, message in ((["--dry-run"], "--dry-run applies to --executor slurm"),
                           (["--executor", "local", "--tasks", "2", "--dry-run"], "--dry-run applies to --executor"),
                           (["--address", "127.0.0.1:6379"], "--address applies to --executor ray"),
                           (["--tasks", "2", "--partition", "batch"], "--partition/--time/--cpus-per-task apply to"),
                           (["--time", "1:00:00"], "--partition/--time/--cpus-per-task apply to"),
                           (["--tasks", "2", "--workers", "0"], "--workers 0: tasks at once, must be >= 1")):
        code, err = run_cli(base + extra, capsys)
        assert code == 2 and message in err, (extra, err)
    assert os.listdir(tmp_path) == []


def test_a_second_run_into_the_same_output_is_refused_naming_the_holder(corpus, tmp_path):
    from ascend_llm_recipes.data.prepare import output_lock
    root, inputs, _, _ = corpus
    out = str(tmp_path / "out")
    tokenizer = str(root / "one" / "tokenizer.model")
    with output_lock(out):  # another open file description: flock refuses it as it would another process
        for tasks in (1, 2):
            with pytest.raises(DataError, match=rf"out is being prepared by pid {os.getpid()} \(lock .*out\.lock\)"):
                prepare_dataset(out, 64, inputs=inputs, tokenizer=tokenizer, tasks=tasks, show_progress=False)
    assert os.listdir(tmp_path) == []
    prepare_dataset(out, 64, inputs=inputs[:1], tokenizer=tokenizer, show_progress=False, workers=0)
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the lock file goes with its holder


def test_a_run_that_failed_before_writing_shards_restarts_with_the_fixed_arguments(corpus, tmp_path, capsys):
    _, inputs, _, _ = corpus
    out, work = str(tmp_path / "out"), str(tmp_path / "out.partial")
    kwargs = {**OPTIONS, "near_dedup": False, "val_fraction": 0.0}
    with pytest.raises(DataError, match="a tokenizer of 65536 pieces cannot be trained"):
        prepare_dataset(out, 64, inputs=inputs[:1], show_progress=False, tasks=2, workers=1,
                        **{**kwargs, "vocab_size": 65536})
    refused = r"(?s)differs in: tasks 2 -> 1, vocab_size 65536 -> 512\).*delete .*out\.partial"
    with pytest.raises(DataError, match=refused):  # the single pass is one task, not None
        prepare_dataset(out, 64, inputs=inputs[:1], show_progress=False, workers=0, **kwargs)
    capsys.readouterr()
    manifest = prepare_dataset(out, 64, inputs=inputs[:1], show_progress=False, tasks=2, workers=1, **kwargs)
    assert "vocab_size 65536 -> 512) and nothing completed: starting over" in capsys.readouterr().err
    assert manifest["tokenizer"]["vocab_size"] == 512 and not os.path.exists(work)
