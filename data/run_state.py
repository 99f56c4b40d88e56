"""What a preparation run was asked to do (`Job`) and where it stands on disk (`RunState`).

A run lives in OUTPUT.partial/ until it is complete, its scratch state in OUTPUT.partial/state/
with run.json (the fingerprint of the job and the identity it was computed from). A rerun
with the same job reopens an interrupted run; one with other arguments is refused, naming the
differences (or starts over when nothing completed). When the manifest is written, the state
is removed and OUTPUT.partial/ renamed to OUTPUT. The single-machine run (data/text/pipeline.py)
and the run in N tasks (data/cluster/scale.py) share both objects; only the task count differs.
"""

import hashlib
import json
import os
import shutil
import sys

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.common.files import disk_full, file_sha256, free_bytes, write_json_atomic
from ascend_llm_recipes.common.units import byte_size
from ascend_llm_recipes.data.mindrecord_io import MANIFEST, MINDRECORD_MIN_FREE, partial_dir
from ascend_llm_recipes.data.tokenizer import resolve_tokenizer
from ascend_llm_recipes.data.text.workers import default_workers

STATE = "state"
# Output bytes (shards, index files) per input byte, on the high side: measured 0.9 for Python source with
# 2,048 pieces and 0.5 for Chinese text with 8,192 (int32 tokens; smaller vocabularies give more of them).
# The disk-full estimate uses it only before the main pass has written anything to measure.
OUTPUT_PER_INPUT_BYTE = 1.5
# Identity keys one kind of run does not record, with the value that kind means (the single pass is one task).
IDENTITY_DEFAULTS = {"tasks": 1}


def val_output_dir(output_dir: str, val_output: str = "") -> str:
    """The validation dataset's directory: --val-output, else OUTPUT-val."""
    return val_output or output_dir.rstrip("/") + "-val"


class Job:
    """The inputs, arguments and options of one run; `tasks` is None for the single pass, else the number of
    ranges data/cluster/scale.py cuts the work into (part of the identity: it shapes the samples). `skipped`:
    [(path, reason)] the input folders held but are not read (data/text/inputs.py), for the manifest."""

    def __init__(self, output_dir: str, seq_length: int, vocab_size: int, source: str, patterns: list,
                 files: list, missing: list, max_documents: int, tokenizer: str, samples_per_shard: int,
                 show_progress: bool, opts, tasks: int = None, skipped: list = ()):
        self.output_dir, self.seq_length, self.vocab_size = output_dir, seq_length, vocab_size
        self.source, self.patterns, self.files, self.missing = source, patterns, files, missing
        self.skipped = list(skipped)
        self.max_documents, self.tasks = max_documents, tasks
        self.tokenizer_source = resolve_tokenizer(tokenizer) if tokenizer else None  # a directory names its file
        self.samples_per_shard, self.show_progress, self.opts = samples_per_shard, show_progress, opts
        self.val_output = val_output_dir(output_dir, opts.val_output)
        self.sizes = [_size(f) for f in files]
        self.workers = default_workers(sum(self.sizes)) if opts.workers < 0 else opts.workers
        self.fingerprint = self._fingerprint()

    def _fingerprint(self) -> str:
        identity = {"seq_length": self.seq_length, "vocab_size": self.vocab_size, "source": self.source,
                    "files": [[os.path.abspath(f), size, _mtime(f)] for f, size in zip(self.files, self.sizes)],
                    "max_documents": self.max_documents,
                    "tokenizer": file_sha256(self.tokenizer_source) if self.tokenizer_source else None,
                    "samples_per_shard": self.samples_per_shard, "options": self.opts.recorded()}
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        return digest if self.tasks is None else hashlib.sha256(f"{digest} tasks={self.tasks}".encode()).hexdigest()

    def identity(self) -> dict:
        """The arguments as the manifest records them (and as a refused rerun's differences name them)."""
        return {"seq_length": self.seq_length, "vocab_size": self.vocab_size, "source": self.source,
                "inputs": self.patterns, "files": len(self.files), "max_documents": self.max_documents,
                "tokenizer": self.tokenizer_source, "samples_per_shard": self.samples_per_shard,
                **self.opts.recorded(), **({"tasks": self.tasks} if self.tasks is not None else {})}

    def corpus(self) -> str:
        """The user's input, for messages."""
        if not self.patterns:
            return f"the {self.source} corpus"
        shown = " ".join(self.patterns[:3]) + (f" ... ({len(self.patterns)} in all)" if len(self.patterns) > 3 else "")
        return f"--input {shown}"


class RunState:
    """OUTPUT.partial/ of one job: refusing occupied outputs, reopening an interrupted run, publishing the result,
    and the errors that name the output. `rerun` is the hint of how a rerun continues."""

    def __init__(self, job: Job, rerun: str):
        self.job, self.rerun = job, rerun
        self.work = partial_dir(job.output_dir)
        self.state = os.path.join(self.work, STATE)
        self.consumed = 0  # input bytes the run has read (estimates the space a full disk lacks)

    def check_outputs(self) -> None:
        check_outputs(self.job.output_dir, self.job.val_output, self.ours)

    def ours(self, directory: str) -> bool:
        """True for a validation dataset this very run finished before it was interrupted."""
        try:
            with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
                return json.load(f).get("run_fingerprint") == self.job.fingerprint and os.path.isdir(self.work)
        except (OSError, json.JSONDecodeError):
            return False

    def finished_manifest(self):
        """The manifest of an earlier identical run that stopped between writing it and renaming the directory."""
        try:
            with open(os.path.join(self.work, MANIFEST), encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, json.JSONDecodeError):
            return None
        return manifest if manifest.get("run_fingerprint") == self.job.fingerprint else None

    def open_work(self, has_progress=lambda: True) -> bool:
        """Start OUTPUT.partial, or reopen an interrupted identical run (True). An interrupted run with other
        arguments is refused, unless `has_progress()` says it completed nothing worth keeping."""
        run_file = os.path.join(self.state, "run.json")
        if os.path.isdir(self.work):
            try:
                with open(run_file, encoding="utf-8") as f:
                    previous = json.load(f)
            except (OSError, json.JSONDecodeError):
                previous = None  # interrupted before it recorded anything worth keeping
            if previous is not None and previous["fingerprint"] != self.job.fingerprint:
                changed = _differences(previous["identity"], self.job.identity())
                if changed and not has_progress():
                    # Nothing completed (e.g. it failed on a vocabulary too large for the corpus): the rerun with
                    # the fixed arguments starts over instead of being refused.
                    print(f"prepare: {self.work} holds a failed run with other arguments ({', '.join(changed)}) and "
                          "nothing completed: starting over", file=sys.stderr, flush=True)
                    previous = None
                else:
                    raise DataError(f"{self.work} holds an interrupted run with other arguments or inputs (differs "
                                    f"in: {', '.join(changed) or 'inputs'})",
                                    hint=f"rerun it with the same arguments to continue it, or delete {self.work} to "
                                         "start over with these")
            if previous is not None:
                if self.ours(self.job.val_output):  # stopped while moving the validation dataset out
                    os.rename(self.job.val_output, os.path.join(self.work, "val"))
                return True
            shutil.rmtree(self.work)
        os.makedirs(self.state)
        write_json_atomic(run_file, {"fingerprint": self.job.fingerprint, "identity": self.job.identity()}, indent=2)
        return False

    def publish(self, manifest: dict) -> dict:
        """Drop the scratch state and rename OUTPUT.partial into place; returns `manifest`."""
        shutil.rmtree(self.state, ignore_errors=True)
        for name in os.listdir(self.work):  # temporaries of writes a kill interrupted
            if name.endswith(".tmp"):
                os.remove(os.path.join(self.work, name))
        os.rename(self.work, self.job.output_dir)
        return manifest

    def os_error(self, err: OSError) -> Exception:
        """What to raise for an OSError: a full disk or a failed write of the output as write_error's DataError,
        anything else as it is."""
        outputs = (self.job.output_dir, self.work, self.job.val_output)
        if not disk_full(err) and not _under(err.filename, outputs):
            return err
        return self.write_error(err)

    def write_error(self, err: OSError) -> DataError:
        """A DataError naming the output for an OSError met while writing it (disk full: with the space needed)."""
        job = self.job
        if not disk_full(err):
            return DataError(f"cannot write dataset {job.output_dir}: {err.strerror or err} "
                             f"({err.filename or self.work})",
                             hint="choose an --output (and --val-output) where you can write"
                                  + (f", or fix it and {self.rerun}" if os.path.isdir(self.state) else ""))
        free = free_bytes(self.work)  # or its parent's, before the work directory exists
        written = _disk_usage(self.work) + (_disk_usage(job.val_output) if job.opts.val_fraction else 0)
        total_input = max(1, sum(job.sizes))
        if self.consumed > total_input // 100:
            expected = written * total_input // self.consumed
            basis = f"{byte_size(written)} written for {self.consumed / total_input:.0%} of the input"
        else:
            expected = int(total_input * OUTPUT_PER_INPUT_BYTE)
            basis = f"about {OUTPUT_PER_INPUT_BYTE}x the {byte_size(total_input)} of input"
        remaining = max(0, expected - written)
        needed = remaining + MINDRECORD_MIN_FREE + (1 << 20)  # 1 MiB for the state files
        return DataError(f"disk full while writing dataset {job.output_dir}: {byte_size(free)} free, "
                         f"{byte_size(needed)} needed to finish ({byte_size(remaining)} more output, estimated from "
                         f"{basis}, plus the {byte_size(MINDRECORD_MIN_FREE)} MindRecord insists on keeping free)",
                         hint=f"free at least {byte_size(max(needed - free, 1 << 20))} more on that disk, then "
                              f"{self.rerun} (kept in {self.work})")


def check_outputs(output_dir: str, val_output: str, ours) -> None:
    """Refuse an existing dataset or validation set at the outputs, unless `ours(directory)` says this very run
    finished that validation set before it was interrupted."""
    for directory, what in ((output_dir, "dataset"), (val_output, "validation dataset")):
        if not os.path.exists(directory) or (what != "dataset" and ours(directory)):
            continue
        if os.path.isfile(os.path.join(directory, MANIFEST)):
            raise DataError(f"{what} {directory} already exists (complete)",
                            hint="reuse it, or choose another --output" if what == "dataset" else
                            "move it away, or choose another --val-output")
        raise DataError(f"{directory} exists but is not a complete dataset (no {MANIFEST})",
                        hint="remove it or choose another --output; nothing was written")


def _differences(before: dict, now: dict) -> list:
    before, now = {**IDENTITY_DEFAULTS, **before}, {**IDENTITY_DEFAULTS, **now}
    return [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(before) | set(now))
            if before.get(k) != now.get(k)]


def _under(path, roots: tuple) -> bool:
    path = os.path.abspath(os.fsdecode(path)) if path else ""
    return any(path == os.path.abspath(r) or path.startswith(os.path.abspath(r) + os.sep) for r in roots if r)


def _disk_usage(directory: str) -> int:
    """Bytes of disk the files below `directory` occupy (sparse MindRecord pages count as written)."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0
