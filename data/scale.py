"""Dataset preparation split over N tasks, run by datatrove's executors (local, Slurm) or on Ray.

    plan        (the submitting process) N disjoint byte ranges of the inputs in input order: whole
                files, and line-based files (.jsonl, --lines) cut after a newline so that one huge
                file still spreads; each range knows its first line number
    signatures  (N tasks) clean and hash every document of a range (data/workers.py); with
                --near-dedup its band keys and 5-gram set; the tokenizer-sample candidates
    decide      (1 task) walk the signatures in input order: exact and near dedup keep the FIRST
                occurrence, as one machine does (the same keys and data/dedup.py's Jaccard check), and
                the tokenizer is trained once on the hash-chosen sample of all ranges
    pack        (N tasks) clean and tokenize the range again, keep what `decide` kept, split off the
                validation documents, pack and write the task's MindRecord shards (data/pipeline.py)
    merge       (1 task) the shards moved into one dataset, one manifest (per-task provenance), one
                validation dataset, one tokenizer

The kept documents and their tokens are the single-process run's; only the packing differs, each
task packing its own stream (so only each task's tail pads). Datatrove's dedup blocks are not used:
their MinHash differs from data/dedup.py's, and the result must equal the single-machine run's.

Restart: datatrove records each finished task (OUTPUT.logs/<stage>/completions/) and a rerun
skips those; a task writes under a scratch name and renames it when complete, so a killed task
leaves nothing that looks finished. Every task of a stage is a pure function of the inputs and
the earlier stages, so a rerun is byte-identical. Scratch lives in OUTPUT.partial/state/scale/.
"""

import hashlib
import json
import os
import resource
import shutil
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np

from ascend_llm_recipes.data.clean import KEPT
from ascend_llm_recipes.data.corpus import JSONL, TEXT, ChunkReader, Position, input_format
from ascend_llm_recipes.data.dedup import BANDS, NEAR_DUPLICATES, NearDuplicateIndex, band_keys, shingle_hashes, \
    shingle_set
from ascend_llm_recipes.data.mindrecord_io import MANIFEST, ShardWriter, write_json_atomic
from ascend_llm_recipes.data.packing import PackStats
from ascend_llm_recipes.data.pipeline import TOKENIZER, Run, Split, Tallies, TokenizerSample, _dataset
from ascend_llm_recipes.data.tokenizer import EOD_ID, train_tokenizer
from ascend_llm_recipes.data.tasks import DIED, RERUN, TaskFailure, TaskPool, failure_of, raise_failures
from ascend_llm_recipes.data.workers import WorkerConfig, init_worker, process_chunk
from ascend_llm_recipes.common.errors import DataError

EXECUTORS = ("local", "slurm", "ray")
STAGES = ("signatures", "decide", "pack", "merge")
KEEP, DUPLICATE, NEAR_DUPLICATE = 0, 1, 2   # decide's verdict per kept document
_NEWLINE_SCAN = 16 << 20


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


class ScaleRun(Run):
    """A Run whose work is cut into `tasks` ranges; the task count is part of its identity (it shapes the samples)."""

    def __init__(self, *args, tasks: int, **kwargs):
        self.tasks = tasks
        super().__init__(*args, **kwargs)
        self.scratch = os.path.join(self.state, "scale")
        self.logs = os.path.abspath(self.output_dir.rstrip("/") + ".logs")  # sbatch scripts name it
        self.parts: list = []

    RERUN = "rerun the same command: it redoes only the unfinished tasks"

    def _fingerprint(self) -> str:
        return hashlib.sha256(f"{super()._fingerprint()} tasks={self.tasks}".encode()).hexdigest()

    def _identity(self) -> dict:
        return {**super()._identity(), "tasks": self.tasks}

    def _has_progress(self) -> bool:
        """Whether a task that writes the dataset (pack, merge) completed: signatures and decide are redone by
        any run with other arguments anyway, so a run that failed there (bad input) has nothing worth keeping."""
        return any(os.listdir(os.path.join(self.logs, stage, "completions"))
                   for stage in ("pack", "merge") if os.path.isdir(os.path.join(self.logs, stage, "completions")))

    def part(self, rank: int) -> tuple:
        start, stop = self.parts[rank]
        return Position(**start), Position(**stop)

    def chunks(self, rank: int):
        start, stop = self.part(rank)
        return ChunkReader(self.files, self.opts.lines, self.opts.text_field).chunks(start, 0, stop)

    def path(self, *names) -> str:
        return os.path.join(self.scratch, *names)


# ---- plan -------------------------------------------------------------------------------------------

def plan_parts(files: list, sizes: list, tasks: int, lines: bool) -> list:
    """[(start, stop) Position dicts] for `tasks` contiguous ranges of about equal bytes, in input order."""
    bounds, cumulative = [], np.concatenate([[0], np.cumsum(sizes)]).tolist()
    previous = Position(0)
    for k in range(1, tasks):
        target = cumulative[-1] * k // tasks
        index = max(0, int(np.searchsorted(cumulative, target, side="right")) - 1)
        cut = Position(len(files))
        if index < len(files):
            fmt, compressed = input_format(files[index])
            inside = target - cumulative[index]
            if not inside:
                cut = Position(index)
            elif (fmt == JSONL or (fmt == TEXT and lines)) and not compressed:
                cut = _after_newline(files[index], index, inside, sizes[index])
            else:
                cut = Position(index + 1)
        if (cut.file, cut.offset) < (previous.file, previous.offset):
            cut = previous
        bounds.append(cut)
        previous = cut
    starts, stops = [Position(0)] + bounds, bounds + [Position(len(files))]
    return [(a.as_dict(), b.as_dict()) for a, b in zip(starts, stops)]


def _after_newline(path: str, index: int, offset: int, size: int) -> Position:
    """The position just after the first newline at or after `offset` (with its line number)."""
    with open(path, "rb") as f:
        f.seek(offset)
        while True:
            block = f.read(1 << 16)
            if not block:
                return Position(index + 1)
            at = block.find(b"\n")
            if at >= 0:
                cut = offset + at + 1
                break
            offset += len(block)
        if cut >= size:
            return Position(index + 1)
        f.seek(0)
        newlines, read = 0, 0
        while read < cut:
            block = f.read(min(_NEWLINE_SCAN, cut - read))
            newlines += block.count(b"\n")
            read += len(block)
    return Position(index, cut, newlines + 1)


# ---- the stages ----------------------------------------------------------------------------------

class Stage:
    """One stage as a datatrove pipeline step: datatrove calls it with (data, rank, world_size)."""

    def __init__(self, name: str, run: ScaleRun):
        self.name, self.run = name, run

    def __call__(self, data, rank: int = 0, world_size: int = 1):
        began, cpu = time.perf_counter(), time.process_time()
        {"signatures": signatures, "decide": decide, "pack": pack, "merge": merge}[self.name](self.run, rank)
        # Per-task cost, beside datatrove's logs (never in the dataset, which must not depend on timing).
        os.makedirs(os.path.join(self.run.logs, self.name, "costs"), exist_ok=True)
        write_json_atomic(os.path.join(self.run.logs, self.name, "costs", f"{rank:05d}.json"),
                          {"seconds": time.perf_counter() - began, "cpu_seconds": time.process_time() - cpu,
                           "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})

    def __repr__(self) -> str:
        return f"prepare:{self.name}"


def signatures(run: ScaleRun, rank: int) -> None:
    """Stage 1, per range: digests (and near-dedup signatures) of the kept documents, and sample candidates."""
    os.makedirs(run.path("signatures"), exist_ok=True)
    init_worker(WorkerConfig(run.opts.clean(), run.opts.text_field, None, EOD_ID, False, 1 << 64))
    below = 0 if run.tokenizer_source else run._sample_below()
    digests, files, lines, bands, counts, sample = [], [], [], [], [], []
    sets_path = run.path("signatures", f"{rank:05d}.sets.u32")
    kept_before = 0
    with open(sets_path + ".tmp", "wb") as sets:
        for chunk in run.chunks(rank):
            result = process_chunk(chunk.pieces)
            is_kept = result.status == KEPT
            digests.append(result.digest)
            files.append(result.file[is_kept])
            lines.append(result.line[is_kept])
            for kept_index, digest, text in result.texts:
                if run.opts.near_dedup:
                    hashes = shingle_hashes(text)
                    bands.append(band_keys(text, hashes))
                    shingles = shingle_set(hashes)
                    counts.append(len(shingles))
                    sets.write(shingles.tobytes())
                if digest < below:
                    sample.append([kept_before + kept_index, str(digest), text])
            kept_before += len(result.digest)
    with open(run.path("signatures", f"{rank:05d}.sample.json.tmp"), "w", encoding="utf-8") as f:
        json.dump(sample, f)
    arrays = {"digest": _cat(digests, np.uint64), "files": _cat(files, np.int32), "line": _cat(lines, np.int64),
              "bands": np.array(bands, np.uint64).reshape(-1, BANDS), "counts": np.array(counts, np.int64)}
    with open(run.path("signatures", f"{rank:05d}.npz.tmp"), "wb") as f:
        np.savez(f, **arrays)
    for suffix in (".sets.u32", ".sample.json", ".npz"):  # the arrays last: their presence means complete
        name = run.path("signatures", f"{rank:05d}{suffix}")
        os.replace(name + ".tmp", name)


def decide(run: ScaleRun, rank: int = 0) -> None:
    """Stage 2, once: the dedup verdict of every kept document in input order, and the tokenizer."""
    work, final = run.path("decide.tmp"), run.path("decide")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    seen = set()
    near = NearDuplicateIndex(work, os.path.join(work, NEAR_DUPLICATES), [os.path.abspath(f) for f in run.files]) \
        if run.opts.near_dedup else None
    sample = None if run.tokenizer_source else TokenizerSample(run.opts.tokenizer_sample_chars)
    order = 0
    for task in range(run.tasks):
        with np.load(run.path("signatures", f"{task:05d}.npz")) as npz:
            sig = {k: npz[k] for k in npz.files}
        digests = sig["digest"].tolist()
        verdict = np.zeros(len(digests), np.uint8)
        for i, digest in enumerate(digests):
            if digest in seen:
                verdict[i] = DUPLICATE
            else:
                seen.add(digest)
        if near is not None:
            sets = np.fromfile(run.path("signatures", f"{task:05d}.sets.u32"), np.uint32)
            ends = np.cumsum(sig["counts"])
            for i in np.flatnonzero(verdict == KEEP):
                shingles = sets[ends[i] - sig["counts"][i]:ends[i]]
                if near.check(sig["bands"][i], shingles, int(sig["files"][i]), int(sig["line"][i]), digests[i]):
                    verdict[i] = NEAR_DUPLICATE
        np.save(os.path.join(work, f"{task:05d}.npy"), verdict)
        if sample is not None:
            with open(run.path("signatures", f"{task:05d}.sample.json"), encoding="utf-8") as f:
                for kept_index, digest, text in json.load(f):
                    sample.offer(order + kept_index, int(digest), text)
        order += len(digests)
    if near is not None:
        near.close()
    if sample is not None:
        docs = sample.documents()
        if not docs:
            raise DataError(f"no usable document among {len(run.files)} input files of {run._corpus()}",
                            hint="check the inputs and the --min-chars/--max-chars filters; nothing was written")
        model = train_tokenizer(docs, run.vocab_size, os.path.join(work, "tokenizer"), corpus=run._corpus())
        shutil.move(model, os.path.join(work, TOKENIZER))
        write_json_atomic(os.path.join(work, "trained_on.json"),
                          {"documents": len(docs), "chars": sum(len(d) for d in docs)})
    shutil.rmtree(final, ignore_errors=True)
    os.rename(work, final)
    _install_tokenizer(run)


def _install_tokenizer(run: ScaleRun) -> None:
    """Put the dataset's tokenizer in place once, before the parallel stages load it: decide's trained one (with
    data/pipeline.py's record of what it was trained on), or a copy of the user's."""
    if not run.tokenizer_source:
        path, record = os.path.join(run.work, TOKENIZER), os.path.join(run.state, "tokenizer.json")
        shutil.copyfile(run.path("decide", TOKENIZER), path + ".tmp")
        os.replace(path + ".tmp", path)
        shutil.copyfile(run.path("decide", "trained_on.json"), record + ".tmp")
        os.replace(record + ".tmp", record)
    run._tokenizer()


def pack(run: ScaleRun, rank: int) -> None:
    """Stage 3, per range: tokenize, keep what decide kept, pack and write this task's shards."""
    tok, _ = run._tokenizer()
    work, final = run.path("tasks", f".tmp-{rank:05d}"), run.path("tasks", f"{rank:05d}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    splits = {"train": Split("train", work, run.seq_length, run.samples_per_shard, run.opts, tok.pad_id)}
    if run.opts.val_fraction:
        splits["val"] = Split("val", os.path.join(work, "val"), run.seq_length, run.samples_per_shard, run.opts,
                              tok.pad_id)
    for name, split in splits.items():  # shard names unique across tasks: they are never renamed (MindRecord)
        split.writer = ShardWriter(split.directory, f"{name}-t{rank:05d}", run.samples_per_shard, tok.pad_id)
    verdicts = np.load(run.path("decide", f"{rank:05d}.npy"))
    init_worker(WorkerConfig(run.opts.clean(), run.opts.text_field, tok.path, tok.eod_id, False, threads=1))
    tallies, at = Tallies(len(run.files)), 0
    val_below = int(run.opts.val_fraction * (1 << 64))
    for chunk in run.chunks(rank):
        result = process_chunk(chunk.pieces)
        count = len(result.status)
        run._record_bad(chunk, result, count, tallies)
        run._record_filtered(result, count, tallies)
        _, kept = run._count_read(result, count, tallies)
        verdict = verdicts[at:at + kept]
        at += kept
        tallies.documents["duplicates"] += int((verdict == DUPLICATE).sum())
        tallies.documents["near_duplicates"] += int((verdict == NEAR_DUPLICATE).sum())
        run._take(result, count, tallies, splits, verdict == KEEP, val_below)
    assert at == len(verdicts), f"task {rank}: {at} kept documents, decide judged {len(verdicts)}"
    for split in splits.values():
        split.finish()
    record = {"meta": tallies.meta(), "arrays": {k: v.tolist() for k, v in tallies.arrays().items()},
              "splits": {name: {**_dataset(split), "stats": split.packer.stats.as_dict()}
                         for name, split in splits.items()}}
    write_json_atomic(os.path.join(work, "task.json"), record)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(work, final)


class _Merged:
    """What data/pipeline.py's manifest writer reads of a split, for shards that several tasks wrote."""

    def __init__(self, name: str, directory: str, mode: str, tail: str):
        self.name, self.directory, self.mode = name, directory, mode
        self.packer = type("Packer", (), {})()
        self.packer.stats, self.packer.tail = PackStats(), tail
        self.writer = type("Writer", (), {})()
        self.writer.shards = []


def merge(run: ScaleRun, rank: int = 0) -> dict:
    """Stage 4, once: one dataset from the tasks' shards; returns its manifest."""
    tok, trained_on = run._tokenizer()
    tallies = Tallies(len(run.files))
    run._record_missing(tallies)
    names = ["train"] + (["val"] if run.opts.val_fraction else [])
    splits = {name: _Merged(name, run.work if name == "train" else os.path.join(run.work, "val"), run.opts.packing,
                            run.opts.tail) for name in names}
    for split in splits.values():
        os.makedirs(split.directory, exist_ok=True)
    tasks = []
    for task in range(run.tasks):
        directory = run.path("tasks", f"{task:05d}")
        with open(os.path.join(directory, "task.json"), encoding="utf-8") as f:
            record = json.load(f)
        _add_tallies(tallies, record)
        for name, split in splits.items():
            done = record["splits"][name]
            source = directory if name == "train" else os.path.join(directory, "val")
            for shard in done["shards"]:
                for file in (shard["file"], shard["file"] + ".db"):
                    if os.path.exists(os.path.join(source, file)):  # a merge killed midway moved some already
                        os.replace(os.path.join(source, file), os.path.join(split.directory, file))
            split.writer.shards += done["shards"]
            stats = split.packer.stats
            for key, value in done["stats"].items():
                setattr(stats, key, getattr(stats, key) + value)
        start, stop = run.part(task)
        train = record["splits"]["train"]
        tasks.append({"task": task, "start": {"input": run.files[start.file] if start.file < len(run.files)
                                              else None, **start.as_dict()},
                      "stop": stop.as_dict(), "documents": record["meta"]["documents"],
                      "samples": train["samples"], "tokens": train["tokens"],
                      "padding_tokens": train["padding_tokens"], "shards": [s["file"] for s in train["shards"]],
                      **({"validation_shards": [s["file"] for s in record["splits"]["val"]["shards"]]}
                         if "val" in splits else {})})
    if tallies.documents["kept"] == 0:
        raise run._no_usable_document(tallies)
    near_log = run.path("decide", NEAR_DUPLICATES)
    if os.path.isfile(near_log):
        os.replace(near_log, os.path.join(run.work, NEAR_DUPLICATES))
    run.provenance = {"tasks": {"count": run.tasks, "list": tasks}}
    return run._write_manifests(tok, trained_on, tallies, splits)


def _add_tallies(tallies: Tallies, record: dict) -> None:
    """Add one task's counts; the first offending file:line of each kind is the earliest task's, as in one pass."""
    meta = record["meta"]
    for key, value in meta["documents"].items():
        tallies.documents[key] += value
    for key, value in meta["bad"].items():
        tallies.bad[key] += value
    for kind, message in meta["first"].items():
        tallies.first.setdefault(kind, message)
    for kind, (count, first) in meta["filtered"].items():
        entry = tallies.filtered.setdefault(kind, [0, ""])
        entry[0] += count
        entry[1] = entry[1] or first
    for key, value in record["arrays"].items():
        getattr(tallies, key)[:] += np.asarray(value, np.int64)


def _cat(parts: list, dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


# ---- executors -------------------------------------------------------------------------------------

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
    A local one is run by data/tasks.py's watched processes (TaskPool), not by datatrove's own Pool."""
    if cluster.executor == "local":
        from datatrove.executor.local import LocalPipelineExecutor
        workers = cluster.workers if cluster.workers > 0 else (os.cpu_count() or 1)
        return LocalPipelineExecutor(pipeline, tasks=tasks, workers=min(workers, tasks), logging_dir=logging_dir,
                                     start_method="spawn")
    if cluster.executor == "ray":
        return ray_executor_class()(pipeline, tasks=tasks, workers=cluster.workers, logging_dir=logging_dir)
    from datatrove.executor.slurm import SlurmPipelineExecutor
    return SlurmPipelineExecutor(
        pipeline, tasks=tasks, time=cluster.time, partition=cluster.partition, cpus_per_task=cluster.cpus_per_task,
        workers=cluster.workers, job_name=job_name, logging_dir=logging_dir, depends=previous, qos="",
        env_command=_env_command(), slurm_logs_folder=os.path.join(logging_dir, "slurm_logs"))


def build_executors(run: ScaleRun, cluster: ClusterOptions) -> list:
    """One datatrove executor per stage, in order (Slurm ones chained by job dependencies)."""
    executors, previous = [], None
    for name in STAGES:
        tasks = run.tasks if name in ("signatures", "pack") else 1
        previous = stage_executor([Stage(name, run)], tasks, cluster, os.path.join(run.logs, name),
                                  f"prepare-{name}", previous)
        executors.append(previous)
    return executors


def _env_command() -> str:
    """What an sbatch script runs first: this Python's bin directory on PATH (datatrove's launch_pickled_pipeline
    lives there), and this PYTHONPATH if one is set."""
    command = f"export PATH={os.path.dirname(sys.executable)}:$PATH"
    if os.environ.get("PYTHONPATH"):
        command += f"; export PYTHONPATH={os.environ['PYTHONPATH']}"
    return command


def sbatch_scripts(executors: list) -> str:
    """The sbatch script of each stage, as SlurmPipelineExecutor writes it, with the dependency it is submitted
    with (--dry-run)."""
    out = []
    for index, (name, executor) in enumerate(zip(STAGES, executors)):
        max_array = min(executor.tasks, executor.max_array_size)
        script = executor.get_launch_file_contents(
            executor.get_sbatch_args(max_array),
            f"srun -l launch_pickled_pipeline {executor.logging_dir.resolve_paths('executor.pik')}")
        dependency = f" --dependency=afterok:<job id of stage {STAGES[index - 1]}>" if index else ""
        out.append(f"# stage {index + 1}/{len(STAGES)} {name}: {executor.tasks} task(s), submitted as: "
                   f"sbatch{dependency} {executor.logging_dir.resolve_paths('launch_script.slurm')}\n{script}")
    return "\n".join(out)


# Set by mindspore in this (driver) process only: a Ray worker started by a user's `ray start` lacks it, and its
# mindspore import then dies in protobuf ("Descriptors cannot be created directly").
WORKER_ENV = ("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION",)
CONNECT_SECONDS = 10.0


def ray_runtime_env() -> dict:
    """The runtime_env that gives Ray tasks the variables this process needs for its imports."""
    env = {name: os.environ[name] for name in WORKER_ENV if name in os.environ}
    env.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
    return {"env_vars": env}


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


# ---- the run ---------------------------------------------------------------------------------------

def prepare_scaled(run: ScaleRun, cluster: ClusterOptions):
    """Plan, then run the four stages on the executor; returns the manifest (None when Slurm jobs were submitted
    or, with dry_run, scripts printed)."""
    run._check_outputs()
    finished = run._finished_manifest()
    if finished is not None:
        return run._publish(finished)
    run.parts = plan_parts(run.files, run.sizes, run.tasks, run.opts.lines)
    if cluster.dry_run:
        print(sbatch_scripts(build_executors(run, cluster)))
        return None
    if cluster.executor == "ray":  # before OUTPUT.partial exists: a wrong --address leaves nothing behind
        import ray
        if not ray.is_initialized():
            connect_ray(cluster.address)
    fresh = not os.path.isfile(os.path.join(run.state, "run.json"))
    try:
        run._open_work()  # refuses an interrupted run with other arguments, naming the differences
        if fresh or not run._has_progress():  # an earlier, abandoned run's records must not mark this one's tasks
            shutil.rmtree(run.logs, ignore_errors=True)
        os.makedirs(run.scratch, exist_ok=True)
        write_json_atomic(run.path("plan.json"), {"tasks": run.tasks, "parts": run.parts})
        executors = build_executors(run, cluster)
        if cluster.executor == "slurm":
            executors[-1].run()  # submits every stage, each depending on the one before
            print(f"prepare: submitted {len(STAGES)} Slurm stages (last job id {executors[-1].job_id}); logs and "
                  f"completion records in {run.logs}; rerun the same command to resubmit unfinished tasks",
                  file=sys.stderr)
            return None
        _run_stages(run, cluster, executors)
    except OSError as err:  # this process's own writes (plan, records): a full disk is named as in a task
        raise run.os_error(err) from None
    with open(os.path.join(run.output_dir, MANIFEST), encoding="utf-8") as f:
        return json.load(f)


def _run_stages(run: ScaleRun, cluster: ClusterOptions, executors: list) -> None:
    """Run the stages in order on this machine's watched processes (data/tasks.py) or on Ray; the first stage with
    a failed task stops the run with that task's error."""
    pool = TaskPool(min(run.tasks, cluster.workers if cluster.workers > 0 else os.cpu_count() or 1),
                    run.show_progress) if cluster.executor == "local" else None
    try:
        for name, executor in zip(STAGES, executors):
            failures = pool.run(executor, name) if pool else executor.run()
            left = executor.get_incomplete_ranks()
            if failures:
                raise_failures(name, failures, executor.world_size, executor.world_size - len(left), run.os_error)
            if left:
                raise DataError(f"stage {name}: tasks {left} did not complete (logs: {executor.logging_dir.path}"
                                "/logs)", hint=RERUN)
    finally:
        if pool:
            pool.close()
