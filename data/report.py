"""What a preparation run reports: its counts (`Tallies`), the bad input it met (`Report`, in input order; with
--strict the first one stops the run) and the manifest(s) written at the end (`write_manifests`).

The single-machine run (data/text/pipeline.py) keeps one Tallies; each task of data/cluster/scale.py keeps its
own and the merge adds them up, so both write the same manifest from the same fields.
"""

import os
import shutil

import numpy as np

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.common.files import file_sha256
from ascend_llm_recipes.data.text.clean import INVALID_UTF8, KEPT, TOO_LONG, TOO_SHORT
from ascend_llm_recipes.data.text.corpus import input_format
from ascend_llm_recipes.data.text.dedup import JACCARD_THRESHOLD, MIN_SHINGLES, NEAR_DUPLICATES, SHINGLE
from ascend_llm_recipes.data.mindrecord_io import write_manifest
from ascend_llm_recipes.data.text.workers import BAD_STATUSES, MALFORMED_JSON, MISSING_FIELD, STATUS_NAMES

LENGTH_BINS = 32  # document lengths (tokens) bucketed by powers of two: bin k holds [2^k, 2^(k+1))
DOCUMENT_COUNTS = ("read", "kept", "invalid_utf8", "too_short", "too_long", "malformed_json", "missing_field",
                   "duplicates", "near_duplicates", "validation")
BAD_KINDS = ("unreadable", "empty_file", "binary_file", "malformed_json", "missing_field", "invalid_utf8")
_HINTS = {"too_short": "lower --min-chars (a CJK character counts 3)", "too_long": "raise --max-chars",
          "missing_field": "name the text field with --text-field", "malformed_json": "fix the JSON lines",
          "invalid_utf8": "convert the files to UTF-8 (or --invalid-utf8 replace)",
          "empty_file": "check the --input paths", "binary_file": "check the --input paths",
          "unreadable": "check the --input paths"}


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

    def add(self, meta: dict, arrays: dict) -> None:
        """Add another task's counts; the first offending file:line of each kind stays the earlier task's."""
        for key, value in meta["documents"].items():
            self.documents[key] += value
        for key, value in meta["bad"].items():
            self.bad[key] += value
        for kind, message in meta["first"].items():
            self.first.setdefault(kind, message)
        for kind, (count, first) in meta["filtered"].items():
            entry = self.filtered.setdefault(kind, [0, ""])
            entry[0] += count
            entry[1] = entry[1] or first
        for key, value in arrays.items():
            getattr(self, key)[:] += np.asarray(value, np.int64)

    def documents_report(self) -> dict:
        d = self.documents
        removed = d["duplicates"] + d["near_duplicates"]
        return {**d, "train": d["kept"] - d["validation"],
                "duplicate_ratio": round(removed / d["read"], 6) if d["read"] else 0.0}


class Report:
    """Counts a job's documents by what cleaning made of them, and its bad input with the first file:line."""

    def __init__(self, job, tallies: Tallies):
        self.job, self.tallies = job, tallies

    def record_missing(self) -> None:
        """Count the inputs that name nothing readable (--strict refused them before the run started). They are
        counted at the end, not saved with the run's state: removing a dangling link from an interrupted run's
        inputs changes nothing it read, so the rerun continues it."""
        self.tallies.bad["unreadable"] += len(self.job.missing)
        if self.job.missing:  # checked before anything was read: the first
            self.tallies.first["unreadable"] = "{}: {}".format(*self.job.missing[0])

    def record_bad(self, chunk, result, count: int) -> None:
        """Count this chunk's bad input in input order; with --strict, stop at the first."""
        events = [(b.file, b.line, b.kind, b.detail) for b in chunk.bad]
        status = result.status[:count]
        for code in BAD_STATUSES:
            hits = np.flatnonzero(status == code)
            if len(hits):
                first = hits[0]
                events.append((int(result.file[first]), int(result.line[first]), STATUS_NAMES[code],
                               result.detail.get(code, STATUS_NAMES[code])))
                self.tallies.bad[STATUS_NAMES[code]] += len(hits) - 1  # the first is counted by _bad below
        for file, line, kind, detail in sorted(events):
            self._bad(kind, self.job.files[file] + (f":{line}" if line else ""), detail)

    def record_filtered(self, result, count: int) -> None:
        """Count documents the length filters drop, with the first one's file:line."""
        status = result.status[:count]
        for code in (TOO_SHORT, TOO_LONG):
            hits = np.flatnonzero(status == code)
            if len(hits):
                entry = self.tallies.filtered.setdefault(STATUS_NAMES[code], [0, ""])
                entry[0] += len(hits)
                entry[1] = entry[1] or f"{self.job.files[int(result.file[hits[0]])]}:{int(result.line[hits[0]])}"

    def count_read(self, result, count: int) -> int:
        """Count a chunk's documents by status; returns how many cleaning kept."""
        status = result.status[:count]
        d = self.tallies.documents
        d["read"] += count
        for code, name in ((INVALID_UTF8, "invalid_utf8"), (TOO_SHORT, "too_short"), (TOO_LONG, "too_long"),
                           (MALFORMED_JSON, "malformed_json"), (MISSING_FIELD, "missing_field")):
            d[name] += int((status == code).sum())
        d["invalid_utf8"] += int(result.replaced[:count].sum())
        return int((status == KEPT).sum())

    def no_usable_document(self) -> DataError:
        """Why every document was dropped: each reason with its count and first file:line."""
        opts, tallies = self.job.opts, self.tallies
        reasons = [f"{n} {kind.replace('_', ' ')} (first: {tallies.first.get(kind, '?')})"
                   for kind, n in tallies.bad.items() if n]
        limits = {"too_short": f"under --min-chars {opts.min_chars}", "too_long": f"over --max-chars {opts.max_chars}"}
        reasons += [f"{n} {kind.replace('_', ' ')} ({limits[kind]}; first: {first})"
                    for kind, (n, first) in tallies.filtered.items() if n]
        found = [kind for kind, n in tallies.bad.items() if n] + [k for k, (n, _) in tallies.filtered.items() if n]
        hint = "; ".join(dict.fromkeys(_HINTS[kind] for kind in found)) or "check the inputs"
        return DataError(f"no usable document among {len(self.job.files)} input files of {self.job.corpus()}: "
                         + ("; ".join(reasons) if reasons else "nothing was read"), hint=hint + "; nothing was written")

    def _bad(self, kind: str, where: str, detail: str) -> None:
        message = f"{where}: {detail}"
        if self.job.opts.strict:
            raise DataError(f"bad input: {message}", hint="fix or remove it, or run without --strict to skip such "
                                                          "input (it is counted in the manifest)")
        self.tallies.bad[kind] += 1
        self.tallies.first.setdefault(kind, message)


def write_manifests(state, tok, trained_on, tallies: Tallies, splits: dict, provenance: dict = None) -> dict:
    """Write the manifest of each split (the validation dataset moved out beside the dataset), then publish the
    dataset (state: data/run_state.py's RunState); returns the train manifest."""
    job = state.job
    tokenizer = {"file": tok.file, "source": os.path.abspath(job.tokenizer_source) if job.tokenizer_source
                 else "trained", **tok.describe()}
    if trained_on:
        tokenizer["trained_on"] = trained_on
    common = {"source": job.source, "command": job.opts.command,
              "arguments": job.identity(), "run_fingerprint": job.fingerprint, "inputs": _inputs(job, tallies),
              "options": job.opts.recorded(), "documents": tallies.documents_report(),
              "bad_input": {"counts": tallies.bad, "first": tallies.first}, "tokenizer": tokenizer,
              "seq_length": job.seq_length, "sample_length": job.seq_length + 1,
              "doc_length_histogram": {"bin_start_tokens": [1 << k for k in range(LENGTH_BINS)],
                                       "documents": tallies.lengths.tolist()}, **(provenance or {})}
    if "val" in splits:
        val_dir = splits["val"].directory
        shutil.copyfile(tok.path, os.path.join(val_dir, tok.file))
        val_manifest = write_manifest(val_dir, {**common, "split": "validation", **dataset_entry(splits["val"])})
        if state.ours(job.val_output):
            shutil.rmtree(job.val_output)
        os.rename(val_dir, job.val_output)
        # Relative to this dataset, so the pair can be moved together.
        common["validation"] = {"dataset_dir": os.path.relpath(job.val_output, job.output_dir),
                                "documents": tallies.documents["validation"],
                                "samples": val_manifest["samples"], "tokens": val_manifest["tokens"]}
    if job.opts.near_dedup:  # the audit trail of what near-dedup dropped (data/text/dedup.py)
        common["near_duplicates"] = {"file": NEAR_DUPLICATES, "documents": tallies.documents["near_duplicates"],
                                     "jaccard_threshold": JACCARD_THRESHOLD, "shingle_chars": SHINGLE,
                                     "min_shingles": MIN_SHINGLES}
    manifest = write_manifest(state.work, {**common, "split": "train", **dataset_entry(splits["train"])})
    return state.publish(manifest)


def dataset_entry(split) -> dict:
    """A split's packing and shards, as its manifest records them."""
    stats = split.packer.stats
    return {"packing": {"mode": split.mode, "tail": split.packer.tail, "split_documents": stats.split_documents},
            "samples": stats.samples, "tokens": stats.tokens, "padding_tokens": stats.padding_tokens,
            "padding_rate": round(stats.padding_rate, 8), "dropped_tokens": stats.dropped_tokens,
            "shards": split.writer.shards}


def _inputs(job, tallies: Tallies) -> dict:
    listed = [{"path": os.path.abspath(path), "format": "+".join(f for f in (fmt, "gzip" if gz else "") if f),
               "bytes": size, "sha256": file_sha256(path), "documents": int(docs), "tokens": int(tokens)}
              for path, size, (fmt, gz), docs, tokens in
              zip(job.files, job.sizes, map(input_format, job.files), tallies.file_docs, tallies.file_tokens)]
    skipped = [{"path": os.path.abspath(p) + os.sep * p.endswith(os.sep), "reason": reason}  # a folder keeps its /
               for p, reason in job.skipped]
    return {"files": len(job.files), "bytes": sum(job.sizes), "missing": [p for p, _ in job.missing],
            "list": listed, "skipped": skipped}
