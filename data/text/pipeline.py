"""The single-machine preparation run behind `data.prepare.prepare_dataset`: data/text/steps.py's steps composed
for one task, streaming, with worker processes and a restartable state.

    Reader -> CleanTokenize (worker processes) -> Progress -> [snapshot mark] -> Account -> Dedup
           -> SplitPack (validation split, packing, MindRecord shards) -> [snapshot when a shard completes]
    then the manifest(s) (data/report.py) and the rename into place (data/run_state.py)

Everything that depends on order happens in the main process on results taken in input
order, so the shards are the same whatever the number of workers. At most two chunks per
worker are in flight, so memory does not grow with the corpus (only the dedup keys do:
~60 bytes per distinct document). Without --tokenizer, a first pass of the same steps
(Reader -> CleanTokenize -> Account) collects the tokenizer's sample.

The run lives in OUTPUT.partial/, its scratch state in state/: run.json (fingerprint of the
arguments), seen.u64 and near_* (dedup keys and 5-gram sets, append-only) and snapshot.json with
snapshot-N.npz, rewritten whenever a shard completes. A snapshot holds the state at the
start of the chunk in which the shard completed (reading position, counts, packer leftovers,
samples not yet in a shard). A rerun with the same arguments restores it, reads on from
that position, skips the samples that completed shards already hold and carries on;
anything written after the snapshot is deleted first. Same inputs and options, same shards.
"""

import json
import os
import shutil
import sys
from dataclasses import dataclass, fields

import numpy as np

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.common.files import write_json_atomic
from ascend_llm_recipes.data.text.clean import INVALID_UTF8_POLICIES, KEPT, NORMALIZATIONS, CleanOptions
from ascend_llm_recipes.data.text.corpus import Position
from ascend_llm_recipes.data.text.dedup import NEAR_DUPLICATES, KeyIndex, NearDuplicateIndex
from ascend_llm_recipes.data.packing import PACKINGS, TAILS
from ascend_llm_recipes.data.report import Report, Tallies, write_manifests
from ascend_llm_recipes.data.run_state import Job, RunState
from ascend_llm_recipes.data.text.steps import (Account, CleanTokenize, Dedup, PerBatch, Progress, Reader, SplitPack,
                                                TokenizerSample, TokenizerStep, make_splits, run_steps, sample_below)
from ascend_llm_recipes.data.tokenizer import EOD_ID
from ascend_llm_recipes.data.text.workers import WorkerConfig, pin_mmap_threshold

RERUN = "rerun the same command: it continues from the last completed shard"


@dataclass(frozen=True)
class PrepareOptions:
    """Everything beyond prepare_dataset's required arguments; the CLI flag is in brackets."""

    text_field: str = "text"          # [--text-field] .jsonl key and .parquet column holding the text
    lines: bool = False               # [--lines] .txt files hold one document per line
    normalization: str = "NFC"        # [--normalize] NFC | NFKC | none
    min_chars: int = 32               # [--min-chars] a CJK character counts 3 (data.text.clean.text_length)
    max_chars: int = 0                # [--max-chars] 0 = no limit
    invalid_utf8: str = "drop"        # [--invalid-utf8] drop | replace
    near_dedup: bool = False          # [--near-dedup] MinHash near-duplicate removal
    packing: str = "stream"           # [--packing] stream | best_fit
    tail: str = "pad"                 # [--tail] pad | drop the last partial sample
    val_fraction: float = 0.0         # [--val-fraction] documents held out into a validation dataset
    val_output: str = ""              # [--val-output] default: OUTPUT-val
    strict: bool = False              # [--strict] stop at the first bad input instead of skipping it
    workers: int = -1                 # [--workers] -1 = automatic, 0 = in this process
    tokenizer_sample_chars: int = 32_000_000   # [--tokenizer-sample-chars] text the tokenizer is trained on
    model_vocab_size: int = 0         # [--recipe] the tokenizer must fit this embedding table
    command: str = ""                 # the command that started the run (recorded in the manifest)

    def problems(self) -> list:
        checks = [
            (self.normalization in NORMALIZATIONS, f"normalization {self.normalization!r}: use one of "
                                                   f"{', '.join(NORMALIZATIONS)}"),
            (self.invalid_utf8 in INVALID_UTF8_POLICIES, f"invalid_utf8 {self.invalid_utf8!r}: use drop or replace"),
            (self.packing in PACKINGS, f"packing {self.packing!r}: use one of {', '.join(PACKINGS)}"),
            (self.tail in TAILS, f"tail {self.tail!r}: use pad or drop"),
            (0.0 <= self.val_fraction < 0.5, f"val_fraction {self.val_fraction}: must be in [0, 0.5)"),
            (self.min_chars >= 0 and self.max_chars >= 0, "min_chars and max_chars must be >= 0"),
            (not self.max_chars or self.max_chars >= self.min_chars, "max_chars must be >= min_chars"),
            (self.tokenizer_sample_chars > 0, "tokenizer_sample_chars must be > 0"),
        ]
        return [message for ok, message in checks if not ok]

    def clean(self) -> CleanOptions:
        return CleanOptions(self.normalization, self.min_chars, self.max_chars, self.invalid_utf8)

    def recorded(self) -> dict:
        """The options that shape the output (recorded in the manifest and the resume fingerprint)."""
        skip = {"workers", "command", "model_vocab_size", "strict"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}


def prepare_local(job: Job) -> dict:
    """Run the job in this process (and its workers); returns the manifest. Bad input leaves nothing behind; a
    failure or interruption keeps every completed shard for a rerun."""
    pin_mmap_threshold()
    state = RunState(job, RERUN)
    state.check_outputs()
    try:
        finished = state.finished_manifest()
        if finished is not None:
            return state.publish(finished)
        snapshot = _read_snapshot(state) if state.open_work() else None
    except OSError as err:
        raise state.write_error(err) from None
    try:
        tokenizer, trained_on = TokenizerStep(state).load(lambda: _sample(state))
        return _main_pass(state, tokenizer, trained_on, snapshot)
    except DataError:
        shutil.rmtree(state.work, ignore_errors=True)
        raise
    except KeyboardInterrupt:
        raise  # everything completed is kept; the caller says so in one line
    except OSError as err:
        raise state.os_error(err) from None  # completed shards and the saved state are kept
    except BaseException:
        print(f"\nprepare: stopped; {state.work} keeps every completed shard: rerun the same command to "
              "continue from there", file=sys.stderr, flush=True)
        raise


def _sample(state: RunState) -> tuple:
    """A deterministic sample of distinct cleaned documents: those with the smallest digests, up to a budget;
    returns it in corpus order with the Report of the pass (for --strict, and a message if nothing is usable).

    Hash order is independent of input order and needs one pass with bounded memory.
    """
    job = state.job
    below = sample_below(job)
    config = WorkerConfig(job.opts.clean(), job.opts.text_field, None, EOD_ID, False, below)
    # Cleaning is cheap next to shipping every text back from a worker: below the budget, stay inline.
    workers = job.workers if below < 1 << 64 else 0
    sample, tallies = TokenizerSample(job.opts.tokenizer_sample_chars), Tallies(len(job.files))
    report = Report(job, tallies)
    report.record_missing()
    offer = _Offer(sample)
    run_steps([Reader(job), CleanTokenize(config, workers), Progress(job, tallies, "sample for tokenizer", Position()),
               Account(report, count_read=False), offer])
    return sample.documents(), report


class _Offer(PerBatch):
    """The sample pass's last step: offer each chunk's candidates to the tokenizer sample."""

    def __init__(self, sample: TokenizerSample):
        self.sample, self.order = sample, 0

    def apply(self, batch) -> None:
        kept_before = int((batch.result.status[:batch.count] == KEPT).sum())
        for kept_index, digest, text in batch.result.texts:
            if kept_index < kept_before:
                self.sample.offer(self.order + kept_index, digest, text)
        self.order += kept_before


def _main_pass(state: RunState, tokenizer, trained_on, snapshot) -> dict:
    job = state.job
    tallies = Tallies(len(job.files))
    splits = make_splits(job, state.work, tokenizer.pad_id)
    position, chunk_index, seen_count, near_mark = Position(), 0, 0, None
    if snapshot is not None:
        meta, arrays = snapshot
        position, chunk_index = Position(**meta["position"]), meta["chunk"]
        seen_count, near_mark = meta["seen"], meta.get("near")
        tallies.restore(meta, arrays)
        for name, split in splits.items():
            saved = meta["splits"][name]
            prefix = f"{name}.packer."
            split.packer.restore(saved["packer"], {k[len(prefix):]: v for k, v in arrays.items()
                                                   if k.startswith(prefix)})
            split.writer.restore(saved["shards"], saved["rows"], [arrays[f"{name}.pending"]]
                                 if len(arrays[f"{name}.pending"]) else [])
        print(f"prepare: resuming {state.work} at shard {len(splits['train'].writer.shards)} (input "
              f"{job.files[position.file] if position.file < len(job.files) else 'end'}, line {position.line})",
              file=sys.stderr, flush=True)
    for split in splits.values():
        split.writer.remove_strays()
    seen = KeyIndex(os.path.join(state.state, "seen.u64"), seen_count)
    near = NearDuplicateIndex(state.state, os.path.join(state.work, NEAR_DUPLICATES),
                              [os.path.abspath(f) for f in job.files], near_mark) if job.opts.near_dedup else None
    config = WorkerConfig(job.opts.clean(), job.opts.text_field, tokenizer.path, tokenizer.eod_id,
                          job.opts.near_dedup, threads=1 if job.workers else (os.cpu_count() or 1))
    state.consumed = sum(job.sizes[:position.file])
    snapshots = _Snapshots(state, tallies, splits, seen, near)
    report = Report(job, tallies)
    pack = SplitPack(tallies, splits, job.opts.val_fraction)
    run_steps([Reader(job, position, chunk_index), CleanTokenize(config, job.workers),
               Progress(job, tallies, "prepare", position), snapshots.marker, Account(report),
               Dedup(tallies, seen, near), pack, snapshots])
    report.record_missing()
    if tallies.documents["kept"] == 0:
        raise report.no_usable_document()
    pack.finish()
    seen.close()
    if near:
        near.close()
    return write_manifests(state, tokenizer, trained_on, tallies, splits)


class _Snapshots(PerBatch):
    """snapshot.json + snapshot-N.npz in the state directory (the JSON names its arrays file). `marker` is the
    step that notes the run's state as a chunk enters; this step, after the chunk, saves that note when the chunk
    completed a shard."""

    def __init__(self, state: RunState, tallies: Tallies, splits: dict, seen: KeyIndex, near):
        self.state, self.tallies, self.splits, self.seen, self.near = state, tallies, splits, seen, near
        self.serial = 0
        self.marker = _Marker(self)

    def mark(self, batch) -> None:
        self.state.consumed += batch.chunk.disk_bytes
        batch.mark = (batch.chunk, self.tallies.copy(), self.seen.count, self.near.mark() if self.near else None,
                      {name: split.mark() for name, split in self.splits.items()})

    def apply(self, batch) -> None:
        if batch.written:
            for index in (self.seen, self.near):
                if index is not None:
                    index.sync()
            self.save(batch.mark)

    def save(self, mark: tuple) -> None:
        chunk, tallies, seen_count, near_mark, split_marks = mark
        arrays = dict(tallies.arrays())
        split_meta = {}
        for name, split in self.splits.items():
            packer_meta, packer_arrays, rows, pending = split_marks[name]
            uncovered = split.writer.uncovered(pending, rows)
            arrays[f"{name}.pending"] = uncovered[0] if uncovered else np.zeros((0, 1), np.int32)
            arrays.update({f"{name}.packer.{k}": v for k, v in packer_arrays.items()})
            split_meta[name] = {"packer": packer_meta, "rows": rows, "shards": split.writer.shards}
        self.serial += 1
        directory = self.state.state
        name = f"snapshot-{self.serial:06d}.npz"
        with open(os.path.join(directory, name), "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        write_json_atomic(os.path.join(directory, "snapshot.json"),
                          {"chunk": chunk.index, "position": chunk.start.as_dict(), "seen": seen_count,
                           "near": near_mark, "splits": split_meta, "arrays": name, **tallies.meta()}, indent=2)
        for old in os.listdir(directory):
            if old.startswith("snapshot-") and old != name:
                os.remove(os.path.join(directory, old))


class _Marker(PerBatch):
    def __init__(self, snapshots: _Snapshots):
        self.snapshots = snapshots

    def apply(self, batch) -> None:
        self.snapshots.mark(batch)


def _read_snapshot(state: RunState):
    """The saved state of the interrupted run OUTPUT.partial holds (None: none saved yet)."""
    path = os.path.join(state.state, "snapshot.json")
    try:
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        with np.load(os.path.join(state.state, meta["arrays"])) as npz:
            return meta, {k: npz[k] for k in npz.files}
    except (OSError, ValueError, KeyError) as err:
        raise DataError(f"{state.work} holds an interrupted run whose saved state is damaged ({err})",
                        hint=f"delete {state.work} and rerun the command to start over") from None
