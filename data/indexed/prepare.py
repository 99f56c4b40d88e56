"""Pack Megatron indexed corpora (PREFIX.bin + .idx, data/indexed/reader.py) into our MindRecord dataset, without
re-tokenizing: `prepare_data.py --from-megatron-indexed PREFIX [PREFIX ...] [--weights W ...]`.

The token stream is the text path's stream packing (data/packing.py StreamPacker, samples of
seq_length + 1 overlapping by one, as Megatron's GPTDataset builds them): documents in order
(the prefixes one after the other), each followed by one EOD id; a document that already ends
with it (preprocess_data.py --append-eod) gets no second one; empty documents are skipped.
Token ids >= the vocabulary are refused. --val-fraction holds documents out by a hash of their
tokens (as the text path hashes their text) into a validation dataset packed the same way.

--weights W1 .. Wn (Megatron's --data-path W1 P1 W2 P2 ...): weights of samples, hence of tokens,
not of documents. Each prefix is packed into its own stream (a sample never mixes two prefixes,
as in Megatron's BlendedDataset of GPTDatasets); the output holds as many samples as the prefixes
give together (one pass), interleaved so that every leading part of it holds prefix d in the
proportion w_d / sum(w): prefix d's k-th sample is placed at time (k + 0.5) / w_d and samples are
taken in time order (data/loader.py blend_order's rule; Megatron's greedy build_blending_indices
keeps the same proportions). A prefix drawn more often than it has samples is repeated (whole
passes, then evenly spaced samples of one more pass); one drawn less often contributes evenly
spaced samples. The manifest records each prefix's samples and draws.

The work is four steps (data/indexed/steps.py), each a callable that datatrove's executors run as a
pipeline step (data/cluster/executors.py; one task in this process when --tasks is 1):

    scan   (N tasks) documents in N ranges: check ids, find EODs, hash for the validation split
    plan   (1 task)  stream lengths -> samples, the blend order, shards per write task
    write  (N tasks) each task the shards assigned to it, built from the memmapped .bin files
    merge  (1 task)  the manifest(s), the validation dataset moved out, the dataset renamed into place

Every sample, and so every shard, is a function of the inputs alone: the dataset is byte-identical
whatever the number of tasks or the executor. Each task writes its result under a scratch name and
renames it when complete; a rerun with the same arguments redoes only what is missing.
"""

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass

import numpy as np

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.common.files import file_sha256
from ascend_llm_recipes.data.indexed.reader import open_indexed
from ascend_llm_recipes.data.indexed.steps import SOURCE, merge, plan, scan, write
from ascend_llm_recipes.data.mindrecord_io import MANIFEST, logs_dir, partial_dir
from ascend_llm_recipes.data.packing import TAILS
from ascend_llm_recipes.data.run_state import RunState
from ascend_llm_recipes.data.tokenizer import NO_PAD, load_tokenizer, resolve_tokenizer
from ascend_llm_recipes.models.arithmetic import ALIGN, round_up

STEPS = ("scan", "plan", "write", "merge")
_VOCAB_LIMIT = 1 << 31  # ids are stored as int32 in the MindRecord samples


@dataclass(frozen=True)
class IndexedOptions:
    """What shapes an indexed import; the CLI flag is in brackets."""

    prefixes: tuple                 # [--from-megatron-indexed]
    seq_length: int                 # [--seq-length]
    weights: tuple = ()             # [--weights] empty: the prefixes concatenated
    tokenizer: str = ""             # [--tokenizer] recorded in the dataset, gives the ids below
    vocab_size: int = 0             # [--vocab-size] without a tokenizer
    eod_id: int = -1                # [--eod-id] without a tokenizer, or to override its end-of-text id
    pad_id: int = NO_PAD            # [--pad-id] -1: no pad token (masked from the loss by the model)
    tail: str = "pad"               # [--tail]
    val_fraction: float = 0.0       # [--val-fraction]
    val_output: str = ""            # [--val-output] default OUTPUT-val
    samples_per_shard: int = 4096   # [--samples-per-shard]
    model_vocab_size: int = 0       # [--recipe]
    command: str = ""


class IndexedRun:
    """One import: its arguments checked, its scratch directory, and the four steps."""

    def __init__(self, output_dir: str, opts: IndexedOptions, tasks: int = 1):
        self.output_dir, self.opts, self.tasks = output_dir, opts, tasks
        self.work = partial_dir(output_dir)
        self.state = os.path.join(self.work, "state")
        self.scratch = os.path.join(self.state, "indexed")
        self.logs = logs_dir(output_dir)
        self.val_output = opts.val_output or output_dir.rstrip("/") + "-val"
        self._check_arguments()
        self.corpora = [open_indexed(p) for p in opts.prefixes]
        self.tokenizer = self._tokenizer()
        self.fingerprint = self._fingerprint()
        self.outputs = RunState(self, "rerun the same command: it redoes only the unfinished tasks")

    def __getstate__(self) -> dict:
        """What a task is sent: the prefixes, not their per-document arrays (it reopens them)."""
        return {k: v for k, v in self.__dict__.items() if k != "corpora"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.corpora = [open_indexed(p) for p in self.opts.prefixes]

    # ---- arguments --------------------------------------------------------------------------

    def _check_arguments(self) -> None:
        o, problems = self.opts, []
        if o.seq_length <= 0 or o.seq_length % ALIGN:
            problems.append(f"--seq-length {o.seq_length} must be a positive multiple of {ALIGN} (e.g. "
                            f"{round_up(max(o.seq_length, 1), ALIGN)})")
        if o.weights and len(o.weights) != len(o.prefixes):
            problems.append(f"--weights has {len(o.weights)} value(s) for {len(o.prefixes)} prefix(es): give one "
                            "weight per --from-megatron-indexed prefix, in the same order")
        if any(not w > 0 for w in o.weights):
            problems.append(f"--weights {' '.join(map(str, o.weights))}: every weight must be > 0 (leave a prefix "
                            "out instead of weighting it 0)")
        if len(set(map(os.path.abspath, o.prefixes))) != len(o.prefixes):
            problems.append("a prefix is given twice: give it once (with --weights, a larger weight repeats it)")
        if o.tail not in TAILS:
            problems.append(f"--tail {o.tail!r}: use pad or drop")
        if not 0.0 <= o.val_fraction < 0.5:
            problems.append(f"--val-fraction {o.val_fraction}: must be in [0, 0.5)")
        if o.samples_per_shard < 1:
            problems.append(f"--samples-per-shard {o.samples_per_shard}: must be >= 1")
        if self.tasks < 1:
            problems.append(f"--tasks {self.tasks}: must be >= 1")
        if o.tokenizer:
            if o.vocab_size:
                problems.append("--vocab-size comes from --tokenizer: give one or the other")
        else:
            if not 0 < o.vocab_size < _VOCAB_LIMIT:
                problems.append("without --tokenizer, give the corpus's --vocab-size (and its --eod-id)")
            if o.eod_id < 0:
                problems.append("without --tokenizer, give the corpus's --eod-id (the end-of-document token id its "
                                "preprocess_data.py used, e.g. 2 for Llama 2, 50256 for GPT-2)")
        if problems:
            raise DataError("; ".join(problems), hint="fix the arguments; nothing was written")

    def _tokenizer(self) -> dict:
        """The manifest's tokenizer entry: from the user's tokenizer (with --eod-id/--pad-id overrides) or flags."""
        o = self.opts
        if o.tokenizer:
            path = resolve_tokenizer(o.tokenizer)
            overrides = {k: v for k, v in (("eod_id", o.eod_id), ("pad_id", o.pad_id)) if v != -1}
            tok = load_tokenizer(path, special_ids=overrides or None)
            entry = {"file": tok.file, "source": os.path.abspath(path), **tok.describe()}
            if "eod_id" in overrides:
                entry["eod_token"] = tok.engine.id_to_piece(tok.eod_id) if tok.kind == "sentencepiece" else \
                    tok.engine.id_to_token(tok.eod_id)
            self.tokenizer_path = path
        else:
            entry = {"kind": "", "source": "flags", "vocab_size": o.vocab_size, "unk_id": -1, "bos_id": -1,
                     "eod_id": o.eod_id, "eod_token": "", "pad_id": o.pad_id,
                     "padding": "its pad id" if o.pad_id != NO_PAD else
                     f"{NO_PAD}: no pad id given; the model masks these labels from the loss"}
            if o.vocab_size % ALIGN:
                entry["vocab_note"] = (f"{o.vocab_size} is not a multiple of {ALIGN}: the model pads its "
                                       "embedding and output tables (model.model_config.vocab_pad_multiple)")
            self.tokenizer_path = None
        vocab, problems = entry["vocab_size"], []
        if not 0 <= entry["eod_id"] < vocab:
            problems.append(f"end-of-document id {entry['eod_id']} is outside the vocabulary of {vocab}")
        if not (entry["pad_id"] == NO_PAD or 0 <= entry["pad_id"] < vocab):
            problems.append(f"--pad-id {entry['pad_id']} is outside the vocabulary of {vocab} (use -1 for none)")
        if entry["pad_id"] == entry["eod_id"]:
            problems.append(f"--pad-id {entry['pad_id']} is the end-of-document id: every document end would be "
                            "masked from the loss (use -1 for no pad id)")
        if o.model_vocab_size and vocab > o.model_vocab_size:
            problems.append(f"vocabulary of {vocab} does not fit model.model_config.vocab_size {o.model_vocab_size}")
        if problems:
            raise DataError("; ".join(problems), hint="fix --tokenizer/--vocab-size/--eod-id/--pad-id; nothing was "
                                                      "written")
        return entry

    def _fingerprint(self) -> str:
        files = [[os.path.abspath(c.prefix + s), os.path.getsize(c.prefix + s), os.stat(c.prefix + s).st_mtime_ns]
                 for c in self.corpora for s in (".idx", ".bin")]
        identity = {**self.identity(), "files": files,
                    "tokenizer_sha256": file_sha256(self.tokenizer_path) if self.tokenizer_path else None}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def identity(self) -> dict:
        o = self.opts
        return {"source": SOURCE, "prefixes": [os.path.abspath(p) for p in o.prefixes], "weights": list(o.weights),
                "seq_length": o.seq_length, "tokenizer": o.tokenizer or None,
                "vocab_size": self.tokenizer["vocab_size"], "eod_id": self.tokenizer["eod_id"],
                "pad_id": self.tokenizer["pad_id"], "tail": o.tail, "val_fraction": o.val_fraction,
                "samples_per_shard": o.samples_per_shard, "tasks": self.tasks}

    # ---- layout ----------------------------------------------------------------------------

    def path(self, *names) -> str:
        return os.path.join(self.scratch, *names)

    @property
    def streams(self) -> int:
        """Separate sample streams: one per prefix with --weights, else one for all."""
        return len(self.corpora) if self.opts.weights else 1

    def scan_ranges(self, rank: int) -> list:
        """Task `rank`'s [(corpus, first document, stop)]: contiguous ranges of about equal tokens."""
        counts = [c.documents for c in self.corpora]
        weights = np.concatenate([c.lengths + 1 for c in self.corpora]) if sum(counts) else np.zeros(0)
        bounds = np.searchsorted(np.cumsum(weights), np.arange(self.tasks + 1) * weights.sum() / self.tasks,
                                 side="left") if len(weights) else np.zeros(self.tasks + 1, np.int64)
        bounds[0], bounds[-1] = 0, sum(counts)
        start, stop, ranges, offset = int(bounds[rank]), int(bounds[rank + 1]), [], 0
        for i, count in enumerate(counts):
            a, b = max(start, offset) - offset, min(stop, offset + count) - offset
            if a < b:
                ranges.append((i, a, b))
            offset += count
        return ranges


# ---- running the steps ------------------------------------------------------------------------------

class Step:
    """One step as a datatrove pipeline step: datatrove calls it with (data, rank, world_size)."""

    def __init__(self, name: str, run: IndexedRun):
        self.name, self.run = name, run

    def __call__(self, data=None, rank: int = 0, world_size: int = 1):
        {"scan": scan, "plan": plan, "write": write, "merge": merge}[self.name](self.run, rank)

    def __repr__(self) -> str:
        return f"indexed:{self.name}"


def step_tasks(run: IndexedRun, name: str) -> int:
    return run.tasks if name in ("scan", "write") else 1


def build_executors(run: IndexedRun, cluster) -> list:
    """One datatrove executor per step (data/cluster/executors.py's choices: local processes, Slurm jobs, Ray tasks)."""
    from ascend_llm_recipes.data.cluster.executors import stage_executor

    executors, previous = [], None
    for name in STEPS:
        previous = stage_executor([Step(name, run)], step_tasks(run, name), cluster, os.path.join(run.logs, name),
                                  f"indexed-{name}", previous)
        executors.append(previous)
    return executors


def prepare_indexed(output_dir: str, opts: IndexedOptions, executor: str = "local", tasks: int = 1,
                    cluster: dict = None, workers: int = -1):
    """Pack the prefixes into `output_dir`; returns the manifest (None when Slurm jobs were submitted).

    One task on the local executor runs the steps in this process; more tasks, or another executor,
    run them through datatrove (the `scale` extra), as data/cluster/scale.py does for text.
    """
    from ascend_llm_recipes.data.prepare import output_lock

    scaled = executor != "local" or tasks != 1
    options = None
    if scaled:
        from ascend_llm_recipes.data.cluster.executors import ClusterOptions
        options = ClusterOptions(executor=executor, tasks=tasks, workers=workers, **(cluster or {}))
        problems = options.problems()
        if problems:
            raise DataError("; ".join(problems), hint="fix the arguments; nothing was written")
    run = IndexedRun(output_dir, opts, tasks)
    with output_lock(output_dir):
        run.outputs.check_outputs()
        manifest = run.outputs.finished_manifest()
        if manifest is None:
            if options is not None and options.dry_run:
                raise DataError("--dry-run is not available with --from-megatron-indexed",
                                hint="submit the run (it is cheap to stop) or use --executor local")
            _open_work(run)
            try:
                manifest = _run_steps(run, options)
            except _Kept:
                raise
            except DataError:  # bad input found by a step: nothing is worth keeping
                shutil.rmtree(run.work, ignore_errors=True)
                shutil.rmtree(run.logs, ignore_errors=True)
                raise
            if manifest is None:
                return None
        shutil.rmtree(run.state, ignore_errors=True)
        shutil.rmtree(run.logs, ignore_errors=True)
        os.rename(run.work, run.output_dir)
    return manifest


def _run_steps(run: IndexedRun, options):
    if options is None:
        for name in STEPS[:-1]:
            for rank in range(step_tasks(run, name)):
                Step(name, run)(None, rank, step_tasks(run, name))
        return merge(run)
    if options.executor == "ray":
        import ray
        if not ray.is_initialized():
            from ascend_llm_recipes.data.cluster.executors import connect_ray
            connect_ray(options.address)
    executors = build_executors(run, options)
    if options.executor == "slurm":  # plan and merge run as one-task jobs there
        executors[-1].run()
        print(f"prepare: submitted {len(STEPS)} Slurm steps (last job id {executors[-1].job_id}); logs in "
              f"{run.logs}; rerun the same command when they are done to finish", file=sys.stderr)
        return None
    from ascend_llm_recipes.data.cluster.executors import run_stage
    from ascend_llm_recipes.data.cluster.tasks import TaskPool

    # Local tasks run in data/cluster/tasks.py's watched processes, as the text path's do: a killed task stops the run
    # naming it instead of leaving datatrove's Pool waiting forever.
    most = max(step_tasks(run, name) for name in STEPS)
    pool = TaskPool(min(most, options.workers if options.workers > 0 else os.cpu_count() or 1)) \
        if options.executor == "local" else None
    try:
        for name, executor in zip(STEPS, executors):
            if step_tasks(run, name) == 1:  # in this process: a bad id becomes our one-line error, not a traceback
                Step(name, run)()
                continue
            run_stage(executor, name, pool, lambda e: e,
                      lambda left: _Kept(f"step {name}: tasks {left} did not complete (logs: "
                                         f"{executor.logging_dir.path}/logs)",
                                         hint="rerun the same command: it redoes only the unfinished tasks"))
    finally:
        if pool:
            pool.close()
    with open(os.path.join(run.work, MANIFEST), encoding="utf-8") as f:
        return json.load(f)


class _Kept(DataError):
    """A failure after which the completed tasks are kept for a rerun."""


def _open_work(run: IndexedRun) -> None:
    """Start OUTPUT.partial, or keep an interrupted identical run's completed steps (data/run_state.py)."""
    if not run.outputs.open_work():
        shutil.rmtree(run.logs, ignore_errors=True)  # an earlier, abandoned run's records must not mark this one's
    os.makedirs(run.scratch, exist_ok=True)


# ---- describing the result --------------------------------------------------------------------------

def indexed_summary(output_dir: str, manifest: dict) -> str:
    """One paragraph: what was read, packed and written."""
    d, tok = manifest["documents"], manifest["tokenizer"]
    prefixes = [i["path"] for i in manifest["inputs"]["list"]]
    text = (f"dataset {output_dir}: {d['kept']:,} documents of {len(prefixes)} Megatron indexed corpus(es) "
            f"({d['empty']} empty ones skipped; {d['ended_with_eod']:,} already ended with EOD id {tok['eod_id']}, "
            f"the others got one), {manifest['tokens']:,} tokens in {manifest['samples']:,} samples of "
            f"{manifest['sample_length']} tokens, {len(manifest['shards'])} shard(s), padding "
            f"{manifest['padding_rate']:.4%}, vocabulary {tok['vocab_size']}, pad id {tok['pad_id']}.")
    text += (f" Tokenizer: {tok['kind']} ({tok['source']})." if tok.get("kind") else
             " No tokenizer recorded (ids from --vocab-size/--eod-id/--pad-id): --show prints token ids.")
    for member in manifest.get("blend", []):
        text += (f" {member['prefix']}: weight {member['weight']:g} ({member['share']:.1%}), {member['drawn']:,} of "
                 f"its {member['samples']:,} samples drawn ({member['repeats']:.2f}x).")
    if manifest.get("validation"):
        v = manifest["validation"]
        text += (f" Validation: {v['documents']:,} documents held out, {v['tokens']:,} tokens in {v['samples']:,} "
                 f"samples in {os.path.normpath(os.path.join(output_dir, v['dataset_dir']))}.")
    return text


def indexed_command(manifest: dict, output_dir: str, seq_length: int = None, vocab_size: int = None) -> str:
    """The command that builds `manifest`'s (indexed) dataset again into `output_dir`."""
    import shlex

    args = manifest["arguments"]
    parts = ["python", "scripts/prepare_data.py", "--from-megatron-indexed", *args["prefixes"]]
    if args["weights"]:
        parts += ["--weights", *map(str, args["weights"])]
    parts += ["--output", output_dir, "--seq-length", str(seq_length or args["seq_length"])]
    if args["tokenizer"]:
        parts += ["--tokenizer", args["tokenizer"]]
    else:
        parts += ["--vocab-size", str(vocab_size or args["vocab_size"]), "--eod-id", str(args["eod_id"])]
    if args["pad_id"] != NO_PAD:
        parts += ["--pad-id", str(args["pad_id"])]
    defaults = IndexedOptions(prefixes=(), seq_length=0)
    for key, flag in (("tail", "--tail"), ("val_fraction", "--val-fraction"),
                      ("samples_per_shard", "--samples-per-shard")):
        if args[key] != getattr(defaults, key):
            parts += [flag, str(args[key])]
    return " ".join(shlex.quote(p) for p in parts)
