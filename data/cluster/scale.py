"""Dataset preparation split over N tasks, run by datatrove's executors (local, Slurm) or on Ray
(data/cluster/executors.py), each stage a datatrove pipeline step built from data/text/steps.py's steps:

    plan        (the submitting process) N disjoint byte ranges of the inputs in input order: whole
                files, and line-based files (.jsonl, --lines) cut after a newline so that one huge
                file still spreads; each range knows its first line number
    signatures  (N tasks) Reader -> CleanTokenize (clean and hash only) -> every kept document's
                digest; with --near-dedup its band keys and 5-gram set; the tokenizer-sample candidates
    decide      (1 task) walk the signatures in input order with Dedup.judge: exact and near dedup keep
                the FIRST occurrence, as one machine does, and the tokenizer is trained once on the
                hash-chosen sample of all ranges (TokenizerSample, as one machine's)
    pack        (N tasks) Reader -> CleanTokenize -> Account -> Verdicts (what `decide` kept) ->
                SplitPack: the validation documents split off, the task's MindRecord shards written
    merge       (1 task) the shards moved into one dataset, one manifest (data/report.py, with per-task
                provenance), one validation dataset, one tokenizer

The kept documents and their tokens are the single-process run's; only the packing differs, each
task packing its own stream (so only each task's tail pads). Datatrove's dedup blocks are not used:
their MinHash differs from data/text/dedup.py's, and the result must equal the single-machine run's.

Restart: datatrove records each finished task (OUTPUT.logs/<stage>/completions/) and a rerun
skips those; a task writes under a scratch name and renames it when complete, so a killed task
leaves nothing that looks finished. Every task of a stage is a pure function of the inputs and
the earlier stages, so a rerun is byte-identical. Scratch lives in OUTPUT.partial/state/scale/.
"""

import json
import os
import resource
import shutil
import sys
import time

import numpy as np

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.data.text.clean import KEPT
from ascend_llm_recipes.data.text.corpus import JSONL, TEXT, Position, input_format
from ascend_llm_recipes.data.text.dedup import BANDS, NEAR_DUPLICATES, KeyIndex, NearDuplicateIndex, band_keys, \
    shingle_hashes, shingle_set
from ascend_llm_recipes.data.cluster.executors import (ClusterOptions, connect_ray, run_stage, sbatch_scripts,
                                                       stage_executor)
from ascend_llm_recipes.data.mindrecord_io import MANIFEST, logs_dir, write_json_atomic
from ascend_llm_recipes.data.packing import PackStats
from ascend_llm_recipes.data.report import Report, Tallies, dataset_entry, write_manifests
from ascend_llm_recipes.data.run_state import Job, RunState
from ascend_llm_recipes.data.text.steps import (TOKENIZER, Account, CleanTokenize, Dedup, Reader, SplitPack,
                                                TokenizerSample, TokenizerStep, Verdicts, make_splits, run_steps,
                                                sample_below, train_on)
from ascend_llm_recipes.data.cluster.tasks import RERUN, TaskPool
from ascend_llm_recipes.data.tokenizer import EOD_ID
from ascend_llm_recipes.data.text.workers import WorkerConfig

STAGES = ("signatures", "decide", "pack", "merge")
_NEWLINE_SCAN = 16 << 20


class ScaleRun:
    """A job cut into `job.tasks` ranges: its run state, the plan of ranges and the scratch of the stages."""

    def __init__(self, job: Job):
        self.job, self.tasks = job, job.tasks
        self.state = RunState(job, "rerun the same command: it redoes only the unfinished tasks")
        self.scratch = os.path.join(self.state.state, "scale")
        self.logs = logs_dir(job.output_dir)  # sbatch scripts name it
        self.parts: list = []

    def has_progress(self) -> bool:
        """Whether a task that writes the dataset (pack, merge) completed: signatures and decide are redone by
        any run with other arguments anyway, so a run that failed there (bad input) has nothing worth keeping."""
        return any(os.listdir(os.path.join(self.logs, stage, "completions"))
                   for stage in ("pack", "merge") if os.path.isdir(os.path.join(self.logs, stage, "completions")))

    def part(self, rank: int) -> tuple:
        start, stop = self.parts[rank]
        return Position(**start), Position(**stop)

    def reader(self, rank: int) -> Reader:
        start, stop = self.part(rank)
        return Reader(self.job, start, 0, stop)

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


class _Signatures:
    """The signatures stage's last step: digests (and near-dedup signatures) of the kept documents, and the
    tokenizer-sample candidates, collected over a task's batches."""

    def __init__(self, run: ScaleRun, sets):
        self.run, self.sets = run, sets
        self.below = 0 if run.job.tokenizer_source else sample_below(run.job)
        self.digests, self.files, self.lines, self.bands, self.counts, self.sample = [], [], [], [], [], []

    def __call__(self, data, rank: int = 0, world_size: int = 1):
        kept_before = 0
        for batch in data:
            result = batch.result
            is_kept = result.status == KEPT
            self.digests.append(result.digest)
            self.files.append(result.file[is_kept])
            self.lines.append(result.line[is_kept])
            for kept_index, digest, text in result.texts:
                if self.run.job.opts.near_dedup:
                    hashes = shingle_hashes(text)
                    self.bands.append(band_keys(text, hashes))
                    shingles = shingle_set(hashes)
                    self.counts.append(len(shingles))
                    self.sets.write(shingles.tobytes())
                if digest < self.below:
                    self.sample.append([kept_before + kept_index, str(digest), text])
            kept_before += len(result.digest)
            yield batch

    def arrays(self) -> dict:
        return {"digest": _cat(self.digests, np.uint64), "files": _cat(self.files, np.int32),
                "line": _cat(self.lines, np.int64), "bands": np.array(self.bands, np.uint64).reshape(-1, BANDS),
                "counts": np.array(self.counts, np.int64)}


def signatures(run: ScaleRun, rank: int) -> None:
    """Stage 1, per range: digests (and near-dedup signatures) of the kept documents, and sample candidates."""
    os.makedirs(run.path("signatures"), exist_ok=True)
    config = WorkerConfig(run.job.opts.clean(), run.job.opts.text_field, None, EOD_ID, False, 1 << 64)
    with open(run.path("signatures", f"{rank:05d}.sets.u32.tmp"), "wb") as sets:
        collect = _Signatures(run, sets)
        run_steps([run.reader(rank), CleanTokenize(config, 0), collect])
    with open(run.path("signatures", f"{rank:05d}.sample.json.tmp"), "w", encoding="utf-8") as f:
        json.dump(collect.sample, f)
    with open(run.path("signatures", f"{rank:05d}.npz.tmp"), "wb") as f:
        np.savez(f, **collect.arrays())
    for suffix in (".sets.u32", ".sample.json", ".npz"):  # the arrays last: their presence means complete
        name = run.path("signatures", f"{rank:05d}{suffix}")
        os.replace(name + ".tmp", name)


def decide(run: ScaleRun, rank: int = 0) -> None:
    """Stage 2, once: the dedup verdict of every kept document in input order (data/text/steps.py's Dedup), and the
    tokenizer."""
    job, work, final = run.job, run.path("decide.tmp"), run.path("decide")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    near = NearDuplicateIndex(work, os.path.join(work, NEAR_DUPLICATES), [os.path.abspath(f) for f in job.files]) \
        if job.opts.near_dedup else None
    dedup = Dedup(None, KeyIndex(os.path.join(work, "seen.u64")), near)
    sample = None if job.tokenizer_source else TokenizerSample(job.opts.tokenizer_sample_chars)
    order = 0
    for task in range(run.tasks):
        with np.load(run.path("signatures", f"{task:05d}.npz")) as npz:
            sig = {k: npz[k] for k in npz.files}
        sets = np.fromfile(run.path("signatures", f"{task:05d}.sets.u32"), np.uint32) if near else None
        verdict = dedup.judge(sig["digest"], sig["files"], sig["line"], sig["bands"], sig["counts"], sets)
        np.save(os.path.join(work, f"{task:05d}.npy"), verdict)
        if sample is not None:
            with open(run.path("signatures", f"{task:05d}.sample.json"), encoding="utf-8") as f:
                for kept_index, digest, text in json.load(f):
                    sample.offer(order + kept_index, int(digest), text)
        order += len(verdict)
    dedup.seen.close()
    if near is not None:
        near.close()
    if sample is not None:
        docs = sample.documents()
        if not docs:
            raise DataError(f"no usable document among {len(job.files)} input files of {job.corpus()}",
                            hint="check the inputs and the --min-chars/--max-chars filters; nothing was written")
        write_json_atomic(os.path.join(work, "trained_on.json"),
                          train_on(job, docs, os.path.join(work, "tokenizer"), os.path.join(work, TOKENIZER)))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(work, final)
    # The dataset's tokenizer in place once, before the parallel stages load it.
    if not job.tokenizer_source:
        TokenizerStep(run.state).install(run.path("decide", TOKENIZER), run.path("decide", "trained_on.json"))
    else:
        TokenizerStep(run.state).load()


def pack(run: ScaleRun, rank: int) -> None:
    """Stage 3, per range: tokenize, keep what decide kept, pack and write this task's shards."""
    job = run.job
    tok, _ = TokenizerStep(run.state).load()
    work, final = run.path("tasks", f".tmp-{rank:05d}"), run.path("tasks", f"{rank:05d}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    # Shard names unique across tasks: they are never renamed (MindRecord).
    splits = make_splits(job, work, tok.pad_id, task=f"-t{rank:05d}")
    tallies = Tallies(len(job.files))
    verdicts = Verdicts(tallies, np.load(run.path("decide", f"{rank:05d}.npy")))
    config = WorkerConfig(job.opts.clean(), job.opts.text_field, tok.path, tok.eod_id, False, threads=1)
    packer = SplitPack(tallies, splits, job.opts.val_fraction)
    run_steps([run.reader(rank), CleanTokenize(config, 0), Account(Report(job, tallies)), verdicts, packer])
    assert verdicts.at == len(verdicts.verdicts), \
        f"task {rank}: {verdicts.at} kept documents, decide judged {len(verdicts.verdicts)}"
    packer.finish()
    record = {"meta": tallies.meta(), "arrays": {k: v.tolist() for k, v in tallies.arrays().items()},
              "splits": {name: {**dataset_entry(split), "stats": split.packer.stats.as_dict()}
                         for name, split in splits.items()}}
    write_json_atomic(os.path.join(work, "task.json"), record)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(work, final)


class _Merged:
    """What data/report.py's manifest writer reads of a split, for shards that several tasks wrote."""

    def __init__(self, name: str, directory: str, mode: str, tail: str):
        self.name, self.directory, self.mode = name, directory, mode
        self.packer = type("Packer", (), {})()
        self.packer.stats, self.packer.tail = PackStats(), tail
        self.writer = type("Writer", (), {})()
        self.writer.shards = []


def merge(run: ScaleRun, rank: int = 0) -> dict:
    """Stage 4, once: one dataset from the tasks' shards; returns its manifest."""
    job, work = run.job, run.state.work
    tok, trained_on = TokenizerStep(run.state).load()
    tallies = Tallies(len(job.files))
    report = Report(job, tallies)
    report.record_missing()
    names = ["train"] + (["val"] if job.opts.val_fraction else [])
    splits = {name: _Merged(name, work if name == "train" else os.path.join(work, "val"), job.opts.packing,
                            job.opts.tail) for name in names}
    for split in splits.values():
        os.makedirs(split.directory, exist_ok=True)
    tasks = []
    for task in range(run.tasks):
        directory = run.path("tasks", f"{task:05d}")
        with open(os.path.join(directory, "task.json"), encoding="utf-8") as f:
            record = json.load(f)
        tallies.add(record["meta"], record["arrays"])
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
        tasks.append({"task": task, "start": {"input": job.files[start.file] if start.file < len(job.files)
                                              else None, **start.as_dict()},
                      "stop": stop.as_dict(), "documents": record["meta"]["documents"],
                      "samples": train["samples"], "tokens": train["tokens"],
                      "padding_tokens": train["padding_tokens"], "shards": [s["file"] for s in train["shards"]],
                      **({"validation_shards": [s["file"] for s in record["splits"]["val"]["shards"]]}
                         if "val" in splits else {})})
    if tallies.documents["kept"] == 0:
        raise report.no_usable_document()
    near_log = run.path("decide", NEAR_DUPLICATES)
    if os.path.isfile(near_log):
        os.replace(near_log, os.path.join(work, NEAR_DUPLICATES))
    return write_manifests(run.state, tok, trained_on, tallies, splits, {"tasks": {"count": run.tasks, "list": tasks}})


def _cat(parts: list, dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


# ---- the run ---------------------------------------------------------------------------------------

def build_executors(run: ScaleRun, cluster: ClusterOptions) -> list:
    """One datatrove executor per stage, in order (Slurm ones chained by job dependencies)."""
    executors, previous = [], None
    for name in STAGES:
        tasks = run.tasks if name in ("signatures", "pack") else 1
        previous = stage_executor([Stage(name, run)], tasks, cluster, os.path.join(run.logs, name),
                                  f"prepare-{name}", previous)
        executors.append(previous)
    return executors


def prepare_scaled(job: Job, cluster: ClusterOptions):
    """Plan, then run the four stages on the executor; returns the manifest (None when Slurm jobs were submitted
    or, with dry_run, scripts printed)."""
    run = ScaleRun(job)
    state = run.state
    state.check_outputs()
    finished = state.finished_manifest()
    if finished is not None:
        return state.publish(finished)
    run.parts = plan_parts(job.files, job.sizes, run.tasks, job.opts.lines)
    if cluster.dry_run:
        print(sbatch_scripts(STAGES, build_executors(run, cluster)))
        return None
    if cluster.executor == "ray":  # before OUTPUT.partial exists: a wrong --address leaves nothing behind
        import ray
        if not ray.is_initialized():
            connect_ray(cluster.address)
    fresh = not os.path.isfile(os.path.join(state.state, "run.json"))
    try:
        state.open_work(run.has_progress)  # refuses an interrupted run with other arguments, naming the differences
        if fresh or not run.has_progress():  # an earlier, abandoned run's records must not mark this one's tasks
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
        raise state.os_error(err) from None
    with open(os.path.join(job.output_dir, MANIFEST), encoding="utf-8") as f:
        return json.load(f)


def _run_stages(run: ScaleRun, cluster: ClusterOptions, executors: list) -> None:
    """Run the stages in order on this machine's watched processes (data/cluster/tasks.py) or on Ray; the first stage
    with
    a failed task stops the run with that task's error."""
    pool = TaskPool(min(run.tasks, cluster.workers if cluster.workers > 0 else os.cpu_count() or 1),
                    run.job.show_progress) if cluster.executor == "local" else None
    try:
        for name, executor in zip(STAGES, executors):
            run_stage(executor, name, pool, run.state.os_error,
                      lambda left: DataError(f"stage {name}: tasks {left} did not complete (logs: "
                                             f"{executor.logging_dir.path}/logs)", hint=RERUN))
    finally:
        if pool:
            pool.close()
