"""The corpus-scale preparation run behind `data.prepare.prepare_dataset`.

    inputs --ChunkReader (main process)--> chunks of ~1 MB of raw text
           --worker processes-----------> per document: status, digest, tokens + EOD
           --main process, in order-----> exact/near dedup, validation split, packing
           --ShardWriter----------------> MindRecord shards, then the manifest(s)

Everything that depends on order happens in the main process on results taken in input
order, so the shards are the same whatever the number of workers. At most two chunks per
worker are in flight, so memory does not grow with the corpus (only the dedup keys do:
~60 bytes per distinct document).

The run lives in OUTPUT.partial/, its scratch state in state/: run.json (fingerprint of the
arguments), seen.u64 and near_* (dedup keys and 5-gram sets, append-only) and snapshot.json with
snapshot-N.npz, rewritten whenever a shard completes. A snapshot holds the state at the
start of the chunk in which the shard completed (reading position, counts, packer leftovers,
samples not yet in a shard). A rerun with the same arguments restores it, reads on from
that position, skips the samples that completed shards already hold and carries on;
anything written after the snapshot is deleted first. Same inputs and options, same shards.
"""

import collections
import errno
import hashlib
import heapq
import json
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import dataclass, fields

import numpy as np
from tqdm import tqdm

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.common.files import file_sha256, write_json_atomic
from ascend_llm_recipes.data.clean import (INVALID_UTF8, INVALID_UTF8_POLICIES, KEPT, NORMALIZATIONS, TOO_LONG,
                                           TOO_SHORT, CleanOptions)
from ascend_llm_recipes.data.corpus import ChunkReader, Position, input_format
from ascend_llm_recipes.data.dedup import (JACCARD_THRESHOLD, MIN_SHINGLES, NEAR_DUPLICATES, SHINGLE, KeyIndex,
                                           NearDuplicateIndex)
from ascend_llm_recipes.data.mindrecord_io import (MANIFEST, MINDRECORD_MIN_FREE, ShardWriter, partial_dir,
                                                   write_manifest)
from ascend_llm_recipes.data.packing import PACKINGS, TAILS, make_packer
from ascend_llm_recipes.data.tokenizer import (EOD_ID, FILES, SENTENCEPIECE, check_vocab_size,
                                               load_tokenizer, resolve_tokenizer, train_tokenizer)
from ascend_llm_recipes.data.workers import (BAD_STATUSES, MALFORMED_JSON, MISSING_FIELD, STATUS_NAMES, WorkerConfig,
                                             default_workers, init_pool_worker, init_worker, pin_mmap_threshold,
                                             process_chunk)

STATE = "state"
TOKENIZER = FILES[SENTENCEPIECE]  # a trained tokenizer's name in the dataset (a user's keeps its kind's name)
LENGTH_BINS = 32  # document lengths (tokens) bucketed by powers of two: bin k holds [2^k, 2^(k+1))
DOCUMENT_COUNTS = ("read", "kept", "invalid_utf8", "too_short", "too_long", "malformed_json", "missing_field",
                   "duplicates", "near_duplicates", "validation")
# Output bytes (shards, index files) per input byte, on the high side: measured 0.9 for Python source with
# 2,048 pieces and 0.5 for Chinese text with 8,192 (int32 tokens; smaller vocabularies give more of them).
# The disk-full estimate uses it only before the main pass has written anything to measure.
OUTPUT_PER_INPUT_BYTE = 1.5
BAD_KINDS = ("unreadable", "empty_file", "binary_file", "malformed_json", "missing_field", "invalid_utf8")


@dataclass(frozen=True)
class PrepareOptions:
    """Everything beyond prepare_dataset's required arguments; the CLI flag is in brackets."""

    text_field: str = "text"          # [--text-field] .jsonl key and .parquet column holding the text
    lines: bool = False               # [--lines] .txt files hold one document per line
    normalization: str = "NFC"        # [--normalize] NFC | NFKC | none
    min_chars: int = 32               # [--min-chars] a CJK character counts 3 (data.clean.text_length)
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


class Tallies:
    """Every count a manifest reports; small enough to copy at each chunk start."""

    def __init__(self, files: int):
        self.documents = dict.fromkeys(DOCUMENT_COUNTS, 0)
        self.bad = dict.fromkeys(BAD_KINDS, 0)
        self.first: dict = {}                        # kind -> "path:line: what"
        self.filtered: dict = {}                     # too_short / too_long -> [count, "path:line"] (messages)
        self.file_docs = np.zeros(files, np.int64)   # kept documents per input file
        self.file_tokens = np.zeros(files, np.int64)
        self.lengths = np.zeros(LENGTH_BINS, np.int64)

    def copy(self) -> "Tallies":
        other = Tallies(0)
        other.documents, other.bad, other.first = dict(self.documents), dict(self.bad), dict(self.first)
        other.filtered = {k: list(v) for k, v in self.filtered.items()}
        other.file_docs, other.file_tokens, other.lengths = \
            self.file_docs.copy(), self.file_tokens.copy(), self.lengths.copy()
        return other

    def meta(self) -> dict:
        return {"documents": self.documents, "bad": self.bad, "first": self.first, "filtered": self.filtered}

    def arrays(self) -> dict:
        return {"file_docs": self.file_docs, "file_tokens": self.file_tokens, "lengths": self.lengths}

    def restore(self, meta: dict, arrays: dict) -> None:
        self.documents, self.bad, self.first = dict(meta["documents"]), dict(meta["bad"]), dict(meta["first"])
        self.filtered = {k: list(v) for k, v in meta.get("filtered", {}).items()}
        self.file_docs, self.file_tokens, self.lengths = \
            arrays["file_docs"], arrays["file_tokens"], arrays["lengths"]

    def documents_report(self) -> dict:
        d = self.documents
        removed = d["duplicates"] + d["near_duplicates"]
        return {**d, "train": d["kept"] - d["validation"],
                "duplicate_ratio": round(removed / d["read"], 6) if d["read"] else 0.0}


class TokenizerSample:
    """The tokenizer's training sample: distinct documents with the smallest digests, up to a character budget."""

    def __init__(self, budget: int):
        self.budget, self.heap, self.digests, self.chars = budget, [], set(), 0

    def offer(self, order: int, digest: int, text: str) -> None:
        """Consider one kept document; `order` is its place among the kept documents in corpus order."""
        if digest in self.digests:
            return
        heapq.heappush(self.heap, (-digest, order, text))
        self.digests.add(digest)
        self.chars += len(text)
        while self.chars > self.budget and len(self.heap) > 1:
            neg, _, dropped = heapq.heappop(self.heap)
            self.digests.discard(-neg)
            self.chars -= len(dropped)

    def documents(self) -> list:
        """The sample in corpus order."""
        return [text for _, _, text in sorted(self.heap, key=lambda item: item[1])]


class Split:
    """One output dataset (train or validation): its packer and its shard writer."""

    def __init__(self, name: str, directory: str, seq_length: int, samples_per_shard: int, opts: PrepareOptions,
                 pad_id: int):
        self.name, self.directory, self.mode = name, directory, opts.packing
        os.makedirs(directory, exist_ok=True)
        self.packer = make_packer(opts.packing, seq_length, pad_id, opts.tail)
        self.writer = ShardWriter(directory, "train" if name == "train" else "val", samples_per_shard, pad_id)

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> int:
        return self.writer.add(self.packer.add(tokens, lengths))

    def finish(self) -> None:
        self.writer.add(self.packer.finish())
        self.writer.finish()

    def mark(self) -> tuple:
        """What a snapshot needs of this split as it is now (references: packers never mutate arrays)."""
        meta, arrays = self.packer.state()
        return meta, arrays, self.writer.rows, list(self.writer.pending)


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


class Run:
    def __init__(self, output_dir: str, seq_length: int, vocab_size: int, source: str, patterns: list,
                 files: list, missing: list, max_documents: int, tokenizer: str, samples_per_shard: int,
                 show_progress: bool, opts: PrepareOptions):
        self.output_dir, self.seq_length, self.vocab_size = output_dir, seq_length, vocab_size
        self.source, self.patterns, self.files, self.missing = source, patterns, files, missing
        self.max_documents = max_documents
        self.tokenizer_source = resolve_tokenizer(tokenizer) if tokenizer else None  # a directory names its file
        self.samples_per_shard, self.show_progress, self.opts = samples_per_shard, show_progress, opts
        self.work = partial_dir(output_dir)
        self.consumed = 0  # input bytes the main pass has read (estimates the space a full disk lacks)
        self.state = os.path.join(self.work, STATE)
        self.val_output = opts.val_output or output_dir.rstrip("/") + "-val"
        self.sizes = [_size(f) for f in files]
        self.workers = default_workers(sum(self.sizes)) if opts.workers < 0 else opts.workers
        self.fingerprint = self._fingerprint()
        self.provenance: dict = {}  # extra manifest entries (data/scale.py: the tasks that built the dataset)

    # ---- the run -------------------------------------------------------------------------------

    def execute(self) -> dict:
        pin_mmap_threshold()
        self._check_outputs()
        try:
            finished = self._finished_manifest()
            if finished is not None:
                return self._publish(finished)
            snapshot = self._open_work()
        except OSError as err:
            raise self._write_error(err) from None
        try:
            tokenizer, trained_on = self._tokenizer()
            manifest = self._main_pass(tokenizer, trained_on, snapshot)
        except DataError:
            shutil.rmtree(self.work, ignore_errors=True)
            raise
        except KeyboardInterrupt:
            raise  # everything completed is kept; the caller says so in one line
        except OSError as err:
            raise self.os_error(err) from None  # completed shards and the saved state are kept
        except BaseException:
            print(f"\nprepare: stopped; {self.work} keeps every completed shard: rerun the same command to "
                  "continue from there", file=sys.stderr, flush=True)
            raise
        return manifest

    def _outputs(self) -> tuple:
        return self.output_dir, self.work, self.val_output

    def os_error(self, err: OSError) -> Exception:
        """What to raise for an OSError: a full disk or a failed write of the output as _write_error's DataError,
        anything else as it is."""
        if err.errno not in (errno.ENOSPC, errno.EDQUOT) and not _under(err.filename, self._outputs()):
            return err
        return self._write_error(err)

    RERUN = "rerun the same command: it continues from the last completed shard"

    def _write_error(self, err: OSError) -> DataError:
        """A DataError naming the output for an OSError met while writing it (disk full: with the space needed)."""
        rerun = self.RERUN
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            return DataError(f"cannot write dataset {self.output_dir}: {err.strerror or err} "
                             f"({err.filename or self.work})",
                             hint="choose an --output (and --val-output) where you can write"
                                  + (f", or fix it and {rerun}" if os.path.isdir(self.state) else ""))
        free = _free_bytes(self.work if os.path.isdir(self.work) else os.path.dirname(self.work) or ".")
        written = _disk_usage(self.work) + (_disk_usage(self.val_output) if self.opts.val_fraction else 0)
        total_input = max(1, sum(self.sizes))
        if self.consumed > total_input // 100:
            expected = written * total_input // self.consumed
            basis = f"{_mb(written)} written for {self.consumed / total_input:.0%} of the input"
        else:
            expected = int(total_input * OUTPUT_PER_INPUT_BYTE)
            basis = f"about {OUTPUT_PER_INPUT_BYTE}x the {_mb(total_input)} of input"
        remaining = max(0, expected - written)
        needed = remaining + MINDRECORD_MIN_FREE + (1 << 20)  # 1 MB for the state files
        return DataError(f"disk full while writing dataset {self.output_dir}: {_mb(free)} free, {_mb(needed)} needed "
                         f"to finish ({_mb(remaining)} more output, estimated from {basis}, plus the "
                         f"{_mb(MINDRECORD_MIN_FREE)} MindRecord insists on keeping free)",
                         hint=f"free at least {_mb(max(needed - free, 1 << 20))} more on that disk, then {rerun} "
                              f"(kept in {self.work})")

    def _fingerprint(self) -> str:
        identity = {"seq_length": self.seq_length, "vocab_size": self.vocab_size, "source": self.source,
                    "files": [[os.path.abspath(f), size, _mtime(f)] for f, size in zip(self.files, self.sizes)],
                    "max_documents": self.max_documents,
                    "tokenizer": file_sha256(self.tokenizer_source) if self.tokenizer_source else None,
                    "samples_per_shard": self.samples_per_shard, "options": self.opts.recorded()}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def _check_outputs(self) -> None:
        check_outputs(self.output_dir, self.val_output, self._ours)

    def _ours(self, directory: str) -> bool:
        """True for a validation dataset this very run finished before it was interrupted."""
        try:
            with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
                return json.load(f).get("run_fingerprint") == self.fingerprint and os.path.isdir(self.work)
        except (OSError, json.JSONDecodeError):
            return False

    def _finished_manifest(self):
        """The manifest of an earlier identical run that stopped between writing it and renaming the directory."""
        try:
            with open(os.path.join(self.work, MANIFEST), encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, json.JSONDecodeError):
            return None
        return manifest if manifest.get("run_fingerprint") == self.fingerprint else None

    def _open_work(self):
        """Start OUTPUT.partial, or reopen an interrupted identical run; returns its snapshot (or None)."""
        run_file = os.path.join(self.state, "run.json")
        if os.path.isdir(self.work):
            try:
                with open(run_file, encoding="utf-8") as f:
                    previous = json.load(f)
            except (OSError, json.JSONDecodeError):
                previous = None  # interrupted before it recorded anything worth keeping
            if previous is not None and previous["fingerprint"] != self.fingerprint:
                changed = _differences(previous["identity"], self._identity())
                if changed and not self._has_progress():
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
                if self._ours(self.val_output):  # stopped while moving the validation dataset out
                    os.rename(self.val_output, os.path.join(self.work, "val"))
                try:
                    return _read_snapshot(self.state)
                except (OSError, ValueError, KeyError) as err:
                    raise DataError(f"{self.work} holds an interrupted run whose saved state is damaged ({err})",
                                    hint=f"delete {self.work} and rerun the command to start over") from None
            shutil.rmtree(self.work)
        os.makedirs(self.state)
        write_json_atomic(run_file, {"fingerprint": self.fingerprint, "identity": self._identity()}, indent=2)
        return None

    def _has_progress(self) -> bool:
        """Whether OUTPUT.partial holds completed work a rerun would lose (the single pass keeps it on failure)."""
        return True

    def _identity(self) -> dict:
        return {"seq_length": self.seq_length, "vocab_size": self.vocab_size, "source": self.source,
                "inputs": self.patterns, "files": len(self.files), "max_documents": self.max_documents,
                "tokenizer": self.tokenizer_source, "samples_per_shard": self.samples_per_shard,
                **self.opts.recorded()}

    # ---- tokenizer ------------------------------------------------------------------------------

    def _tokenizer(self) -> tuple:
        """(the tokenizer, loaded from its copy inside the dataset; what it was trained on, or None).

        Trains one on a sample unless given or done. A user's tokenizer keeps the special ids
        read from its source (an HF directory's tokenizer_config.json is not copied).
        """
        path = os.path.join(self.work, TOKENIZER)
        record = os.path.join(self.state, "tokenizer.json")
        if self.tokenizer_source:
            tok = load_tokenizer(self.tokenizer_source)  # messages name the user's file, not the work copy
            check_vocab_size(self.tokenizer_source, tok.vocab_size, self.opts.model_vocab_size,
                             "model.model_config.vocab_size")
            path = os.path.join(self.work, tok.file)
            if not os.path.isfile(path):
                shutil.copyfile(self.tokenizer_source, path + ".tmp")  # a half-copied model must not look complete
                os.replace(path + ".tmp", path)
            tok.path = path
            return tok, None
        if os.path.isfile(record):
            with open(record, encoding="utf-8") as f:
                return load_tokenizer(path), json.load(f)
        docs, tallies = self._sample()
        if not docs:
            raise self._no_usable_document(tallies)
        prefix = os.path.join(self.state, "tokenizer")
        shutil.move(train_tokenizer(docs, self.vocab_size, prefix, corpus=self._corpus()), path)
        trained_on = {"documents": len(docs), "chars": sum(len(d) for d in docs)}
        write_json_atomic(record, trained_on, indent=2)
        return load_tokenizer(path), trained_on

    def _sample(self) -> list:
        """A deterministic sample of distinct cleaned documents: those with the smallest digests, up to a budget.

        Hash order is independent of input order and needs one pass with bounded memory;
        the sample is returned in corpus order.
        """
        below = self._sample_below()
        config = WorkerConfig(self.opts.clean(), self.opts.text_field, None, EOD_ID, False, below)
        # Cleaning is cheap next to shipping every text back from a worker: below the budget, stay inline.
        workers = self.workers if below < 1 << 64 else 0
        sample, order = TokenizerSample(self.opts.tokenizer_sample_chars), 0
        tallies = Tallies(len(self.files))
        self._record_missing(tallies)
        for chunk, result, count in self._results(config, Position(), 0, "sample for tokenizer", tallies, workers):
            self._record_bad(chunk, result, count, tallies)  # counts are the main pass's; this is for --strict
            self._record_filtered(result, count, tallies)     # and these for a message if nothing is usable
            kept_before = int((result.status[:count] == KEPT).sum())
            for kept_index, digest, text in result.texts:
                if kept_index < kept_before:
                    sample.offer(order + kept_index, digest, text)
            order += kept_before
        return sample.documents(), tallies

    def _sample_below(self) -> int:
        """Digests below this are sample candidates (4x the budget's share of the input: headroom for
        compressed inputs and filtered documents); below the budget every document is one."""
        budget, total = self.opts.tokenizer_sample_chars, max(1, sum(self.sizes))
        return 1 << 64 if 4 * budget >= total else int((1 << 64) * 4 * budget / total)

    # ---- the main pass ---------------------------------------------------------------------------

    def _main_pass(self, tokenizer, trained_on, snapshot) -> dict:
        tallies = Tallies(len(self.files))
        splits = {"train": Split("train", self.work, self.seq_length, self.samples_per_shard, self.opts,
                                 tokenizer.pad_id)}
        if self.opts.val_fraction:
            splits["val"] = Split("val", os.path.join(self.work, "val"), self.seq_length, self.samples_per_shard,
                                  self.opts, tokenizer.pad_id)
        position, chunk_index, seen_count, near_mark = Position(), 0, 0, None
        if snapshot is not None:
            meta, arrays = snapshot
            position, chunk_index = Position(**meta["position"]), meta["chunk"]
            seen_count, near_mark = meta["seen"], meta.get("near")
            tallies.restore(meta, arrays)
            for name, split in splits.items():
                state = meta["splits"][name]
                prefix = f"{name}.packer."
                split.packer.restore(state["packer"], {k[len(prefix):]: v for k, v in arrays.items()
                                                       if k.startswith(prefix)})
                split.writer.restore(state["shards"], state["rows"], [arrays[f"{name}.pending"]]
                                     if len(arrays[f"{name}.pending"]) else [])
            print(f"prepare: resuming {self.work} at shard {len(splits['train'].writer.shards)} (input "
                  f"{self.files[position.file] if position.file < len(self.files) else 'end'}, line {position.line})",
                  file=sys.stderr, flush=True)
        for split in splits.values():
            split.writer.remove_strays()
        seen = KeyIndex(os.path.join(self.state, "seen.u64"), seen_count)
        near = NearDuplicateIndex(self.state, os.path.join(self.work, NEAR_DUPLICATES),
                                  [os.path.abspath(f) for f in self.files], near_mark) if self.opts.near_dedup else None
        val_below = int(self.opts.val_fraction * (1 << 64))
        config = WorkerConfig(self.opts.clean(), self.opts.text_field, tokenizer.path, tokenizer.eod_id,
                              self.opts.near_dedup,
                              threads=1 if self.workers else (os.cpu_count() or 1))
        snapshots = _Snapshots(self.state)
        self.consumed = sum(self.sizes[:position.file])
        for chunk, result, count in self._results(config, position, chunk_index, "prepare", tallies, self.workers):
            self.consumed += chunk.disk_bytes
            mark = (chunk, tallies.copy(), seen.count, near.mark() if near else None,
                    {name: split.mark() for name, split in splits.items()})
            self._record_bad(chunk, result, count, tallies)
            self._record_filtered(result, count, tallies)
            written = self._consume(result, count, tallies, splits, seen, near, val_below)
            if written:
                for index in (seen, near):
                    if index is not None:
                        index.sync()
                snapshots.save(mark, splits)
        self._record_missing(tallies)
        if tallies.documents["kept"] == 0:
            raise self._no_usable_document(tallies)
        for split in splits.values():
            split.finish()
        seen.close()
        if near:
            near.close()
        return self._write_manifests(tokenizer, trained_on, tallies, splits)

    def _results(self, config: WorkerConfig, start: Position, chunk_index: int, desc: str, tallies: Tallies,
                 workers: int):
        """(chunk, worker result, raw documents to take) in input order, up to max_documents."""
        chunks = ChunkReader(self.files, self.opts.lines, self.opts.text_field).chunks(start, chunk_index)
        quota = self.max_documents - tallies.documents["read"] if self.max_documents else None
        progress = tqdm(total=sum(self.sizes), initial=sum(self.sizes[:start.file]), unit="B", unit_scale=True,
                        unit_divisor=1024, desc=desc, disable=not self.show_progress, mininterval=0.5)
        began, docs_at_start = time.perf_counter(), tallies.documents["kept"]
        tokens = 0
        try:
            for chunk, result in self._processed(config, chunks, workers):
                count = len(result.status) if quota is None else min(len(result.status), quota)
                yield chunk, result, count
                progress.update(chunk.disk_bytes)
                if result.lengths is not None:
                    tokens += int(result.lengths[:int((result.status[:count] == KEPT).sum())].sum())
                elapsed = max(time.perf_counter() - began, 1e-9)
                docs = tallies.documents["kept"] - docs_at_start
                progress.set_postfix_str(f"{docs:,} docs ({docs / elapsed:,.0f}/s), {tokens / 1e6:,.1f}M tokens "
                                         f"({tokens / elapsed / 1e6:,.2f}M/s)", refresh=False)
                if quota is not None:
                    quota -= count
                    if quota <= 0:
                        return
        finally:
            progress.close()

    def _processed(self, config: WorkerConfig, chunks, workers: int):
        """Run process_chunk over the chunks, in order: inline, or in a pool with at most 2 chunks per worker queued."""
        if not workers:
            init_worker(config)
            for chunk in chunks:
                yield chunk, process_chunk(chunk.pieces)
            return
        # spawn, not fork: this process may hold MindSpore's threads, which fork does not copy safely.
        with multiprocessing.get_context("spawn").Pool(workers, init_pool_worker, (config,)) as pool:
            queued = collections.deque()
            try:
                for chunk in chunks:
                    queued.append((chunk, pool.apply_async(process_chunk, (chunk.pieces,))))
                    if len(queued) > 2 * workers:
                        done, pending = queued.popleft()
                        yield done, pending.get()
                while queued:
                    done, pending = queued.popleft()
                    yield done, pending.get()
            except GeneratorExit:
                # The caller stopped early (a document quota): let the chunks in flight finish. The `with` would
                # otherwise terminate (SIGTERM) workers that may be writing a result, leaving the result queue's
                # lock held, and CPython's Pool.terminate then waits forever for its task handler (seen in the
                # suite: a fixture hung in Pool._terminate_pool with both workers killed).
                for _, pending in queued:
                    pending.wait()
            # Workers leave on their own (sentinels), so the `with`'s terminate has nobody left to kill.
            pool.close()
            pool.join()

    def _record_missing(self, tallies: Tallies) -> None:
        """Count the inputs that name nothing readable (--strict refused them before the run started). They are
        counted at the end, not saved with the run's state: removing a dangling link from an interrupted run's
        inputs changes nothing it read, so the rerun continues it."""
        tallies.bad["unreadable"] += len(self.missing)
        if self.missing:  # checked before anything was read: the first
            tallies.first["unreadable"] = "{}: {}".format(*self.missing[0])

    def _record_bad(self, chunk, result, count: int, tallies: Tallies) -> None:
        """Count this chunk's bad input in input order; with --strict, stop at the first."""
        events = [(b.file, b.line, b.kind, b.detail) for b in chunk.bad]
        status = result.status[:count]
        for code in BAD_STATUSES:
            hits = np.flatnonzero(status == code)
            if len(hits):
                first = hits[0]
                events.append((int(result.file[first]), int(result.line[first]), STATUS_NAMES[code],
                               result.detail.get(code, STATUS_NAMES[code])))
                tallies.bad[STATUS_NAMES[code]] += len(hits) - 1  # the first is counted by _bad below
        for file, line, kind, detail in sorted(events):
            where = self.files[file] + (f":{line}" if line else "")
            self._bad(tallies, kind, where, detail)

    def _record_filtered(self, result, count: int, tallies: Tallies) -> None:
        """Count documents the length filters drop, with the first one's file:line."""
        status = result.status[:count]
        for code in (TOO_SHORT, TOO_LONG):
            hits = np.flatnonzero(status == code)
            if len(hits):
                entry = tallies.filtered.setdefault(STATUS_NAMES[code], [0, ""])
                entry[0] += len(hits)
                entry[1] = entry[1] or f"{self.files[int(result.file[hits[0]])]}:{int(result.line[hits[0]])}"

    def _no_usable_document(self, tallies: Tallies) -> DataError:
        """Why every document was dropped: each reason with its count and first file:line."""
        opts = self.opts
        reasons = [f"{n} {kind.replace('_', ' ')} (first: {tallies.first.get(kind, '?')})"
                   for kind, n in tallies.bad.items() if n]
        limits = {"too_short": f"under --min-chars {opts.min_chars}", "too_long": f"over --max-chars {opts.max_chars}"}
        reasons += [f"{n} {kind.replace('_', ' ')} ({limits[kind]}; first: {first})"
                    for kind, (n, first) in tallies.filtered.items() if n]
        hints = {"too_short": "lower --min-chars (a CJK character counts 3)", "too_long": "raise --max-chars",
                 "missing_field": "name the text field with --text-field", "malformed_json": "fix the JSON lines",
                 "invalid_utf8": "convert the files to UTF-8 (or --invalid-utf8 replace)",
                 "empty_file": "check the --input paths", "binary_file": "check the --input paths",
                 "unreadable": "check the --input paths"}
        found = [kind for kind, n in tallies.bad.items() if n] + [k for k, (n, _) in tallies.filtered.items() if n]
        hint = "; ".join(dict.fromkeys(hints[kind] for kind in found)) or "check the inputs"
        return DataError(f"no usable document among {len(self.files)} input files of {self._corpus()}: "
                         + ("; ".join(reasons) if reasons else "nothing was read"), hint=hint + "; nothing was written")

    def _corpus(self) -> str:
        """The user's input, for messages."""
        if not self.patterns:
            return f"the {self.source} corpus"
        shown = " ".join(self.patterns[:3]) + (f" ... ({len(self.patterns)} in all)" if len(self.patterns) > 3 else "")
        return f"--input {shown}"

    def _bad(self, tallies: Tallies, kind: str, where: str, detail: str) -> None:
        message = f"{where}: {detail}"
        if self.opts.strict:
            raise DataError(f"bad input: {message}", hint="fix or remove it, or run without --strict to skip such "
                                                          "input (it is counted in the manifest)")
        tallies.bad[kind] += 1
        tallies.first.setdefault(kind, message)

    def _consume(self, result, count: int, tallies: Tallies, splits: dict, seen: KeyIndex, near,
                 val_below: int) -> int:
        """Dedup, split and pack one chunk's documents; returns the number of shards this completed."""
        is_kept, kept = self._count_read(result, count, tallies)
        d = tallies.documents
        digests = result.digest[:kept]
        keep = np.ones(kept, bool)
        fresh = set()
        for i, digest in enumerate(digests.tolist()):
            if digest in seen or digest in fresh:
                keep[i] = False
            else:
                fresh.add(digest)
        d["duplicates"] += kept - len(fresh)
        seen.add_many(digests[keep])
        if near is not None:
            files, lines = result.file[:count][is_kept], result.line[:count][is_kept]
            ends = np.cumsum(result.shingle_counts)
            for i in np.flatnonzero(keep):
                shingles = result.shingles[ends[i] - result.shingle_counts[i]:ends[i]]
                if near.check(result.bands[i], shingles, int(files[i]), int(lines[i]), int(digests[i])):
                    keep[i] = False
                    d["near_duplicates"] += 1
        return self._take(result, count, tallies, splits, keep, val_below)

    def _count_read(self, result, count: int, tallies: Tallies) -> tuple:
        """Count a chunk's documents by status; returns (KEPT mask over its raw documents, their number)."""
        status = result.status[:count]
        d = tallies.documents
        d["read"] += count
        for code, name in ((INVALID_UTF8, "invalid_utf8"), (TOO_SHORT, "too_short"), (TOO_LONG, "too_long"),
                           (MALFORMED_JSON, "malformed_json"), (MISSING_FIELD, "missing_field")):
            d[name] += int((status == code).sum())
        d["invalid_utf8"] += int(result.replaced[:count].sum())
        is_kept = status == KEPT
        return is_kept, int(is_kept.sum())

    def _take(self, result, count: int, tallies: Tallies, splits: dict, keep: np.ndarray, val_below: int) -> int:
        """Split and pack the chunk's KEPT documents that `keep` selects; returns the shards this completed."""
        d = tallies.documents
        is_kept = result.status[:count] == KEPT
        kept = len(keep)
        digests, lengths = result.digest[:kept], result.lengths[:kept]
        tokens = result.tokens[:int(lengths.sum())]
        held_out = keep & (digests < np.uint64(val_below)) if val_below else np.zeros(kept, bool)
        d["kept"] += int(keep.sum())
        d["validation"] += int(held_out.sum())
        files = result.file[:count][is_kept]
        np.add.at(tallies.file_docs, files[keep], 1)
        np.add.at(tallies.file_tokens, files[keep], lengths[keep])
        np.add.at(tallies.lengths, np.minimum(np.log2(lengths[keep]).astype(np.int64), LENGTH_BINS - 1), 1)
        written = 0
        for name, mask in (("train", keep & ~held_out), ("val", held_out)):
            if name in splits and mask.any():
                whole = mask.all()  # the common case: no copy
                written += splits[name].add(tokens if whole else tokens[np.repeat(mask, lengths)],
                                            lengths if whole else lengths[mask])
        return written

    # ---- the end --------------------------------------------------------------------------------

    def _write_manifests(self, tok, trained_on, tallies: Tallies, splits: dict) -> dict:
        inputs = self._inputs(tallies)
        tokenizer = {"file": tok.file, "source": os.path.abspath(self.tokenizer_source) if self.tokenizer_source
                     else "trained", **tok.describe()}
        if trained_on:
            tokenizer["trained_on"] = trained_on
        common = {"source": self.source, "command": self.opts.command,
                  "arguments": self._identity(), "run_fingerprint": self.fingerprint, "inputs": inputs,
                  "options": self.opts.recorded(), "documents": tallies.documents_report(),
                  "bad_input": {"counts": tallies.bad, "first": tallies.first}, "tokenizer": tokenizer,
                  "seq_length": self.seq_length, "sample_length": self.seq_length + 1,
                  "doc_length_histogram": {"bin_start_tokens": [1 << k for k in range(LENGTH_BINS)],
                                           "documents": tallies.lengths.tolist()}, **self.provenance}
        if "val" in splits:
            val_dir = splits["val"].directory
            shutil.copyfile(tok.path, os.path.join(val_dir, tok.file))
            val_manifest = write_manifest(val_dir, {**common, "split": "validation", **_dataset(splits["val"])})
            if self._ours(self.val_output):
                shutil.rmtree(self.val_output)
            os.rename(val_dir, self.val_output)
            # Relative to this dataset, so the pair can be moved together.
            common["validation"] = {"dataset_dir": os.path.relpath(self.val_output, self.output_dir),
                                    "documents": tallies.documents["validation"],
                                    "samples": val_manifest["samples"], "tokens": val_manifest["tokens"]}
        if self.opts.near_dedup:  # the audit trail of what near-dedup dropped (data/dedup.py)
            common["near_duplicates"] = {"file": NEAR_DUPLICATES, "documents": tallies.documents["near_duplicates"],
                                         "jaccard_threshold": JACCARD_THRESHOLD, "shingle_chars": SHINGLE,
                                         "min_shingles": MIN_SHINGLES}
        manifest = write_manifest(self.work, {**common, "split": "train", **_dataset(splits["train"])})
        return self._publish(manifest)

    def _publish(self, manifest: dict) -> dict:
        shutil.rmtree(self.state, ignore_errors=True)
        for name in os.listdir(self.work):  # temporaries of writes a kill interrupted
            if name.endswith(".tmp"):
                os.remove(os.path.join(self.work, name))
        os.rename(self.work, self.output_dir)
        return manifest

    def _inputs(self, tallies: Tallies) -> dict:
        listed = [{"path": os.path.abspath(path), "format": "+".join(f for f in (fmt, "gzip" if gz else "") if f),
                   "bytes": size, "sha256": file_sha256(path), "documents": int(docs), "tokens": int(tokens)}
                  for path, size, (fmt, gz), docs, tokens in
                  zip(self.files, self.sizes, map(input_format, self.files), tallies.file_docs, tallies.file_tokens)]
        return {"files": len(self.files), "bytes": sum(self.sizes), "missing": [p for p, _ in self.missing],
                "list": listed}


class _Snapshots:
    """snapshot.json + snapshot-N.npz in the state directory; the JSON names its arrays file."""

    def __init__(self, state: str):
        self.state = state
        self.serial = 0

    def save(self, mark: tuple, splits: dict) -> None:
        chunk, tallies, seen_count, near_mark, split_marks = mark
        arrays = dict(tallies.arrays())
        split_meta = {}
        for name, split in splits.items():
            packer_meta, packer_arrays, rows, pending = split_marks[name]
            uncovered = split.writer.uncovered(pending, rows)
            arrays[f"{name}.pending"] = uncovered[0] if uncovered else np.zeros((0, 1), np.int32)
            arrays.update({f"{name}.packer.{k}": v for k, v in packer_arrays.items()})
            split_meta[name] = {"packer": packer_meta, "rows": rows, "shards": split.writer.shards}
        self.serial += 1
        name = f"snapshot-{self.serial:06d}.npz"
        with open(os.path.join(self.state, name), "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        write_json_atomic(os.path.join(self.state, "snapshot.json"),
                          {"chunk": chunk.index, "position": chunk.start.as_dict(), "seen": seen_count,
                           "near": near_mark, "splits": split_meta, "arrays": name, **tallies.meta()}, indent=2)
        for old in os.listdir(self.state):
            if old.startswith("snapshot-") and old != name:
                os.remove(os.path.join(self.state, old))


def _dataset(split: Split) -> dict:
    stats = split.packer.stats
    return {"packing": {"mode": split.mode, "tail": split.packer.tail, "split_documents": stats.split_documents},
            "samples": stats.samples, "tokens": stats.tokens, "padding_tokens": stats.padding_tokens,
            "padding_rate": round(stats.padding_rate, 8), "dropped_tokens": stats.dropped_tokens,
            "shards": split.writer.shards}


def _read_snapshot(state: str):
    path = os.path.join(state, "snapshot.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    with np.load(os.path.join(state, meta["arrays"])) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return meta, arrays


# Identity keys one kind of run does not record, with the value that kind means (the single pass is one task).
IDENTITY_DEFAULTS = {"tasks": 1}


def _differences(before: dict, now: dict) -> list:
    before, now = {**IDENTITY_DEFAULTS, **before}, {**IDENTITY_DEFAULTS, **now}
    return [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(before) | set(now))
            if before.get(k) != now.get(k)]


def _under(path, roots: tuple) -> bool:
    path = os.path.abspath(os.fsdecode(path)) if path else ""
    return any(path == os.path.abspath(r) or path.startswith(os.path.abspath(r) + os.sep) for r in roots if r)


def _free_bytes(path: str) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


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


def _mb(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MB"


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
