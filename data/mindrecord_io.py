"""Packed samples on disk: MindRecord shards plus a manifest that describes them.

A dataset directory is complete exactly when `manifest.json` exists: everything is
written into a sibling `*.partial` directory, the manifest last, and the directory is
renamed into place. Inside it, each shard is written by its own FileWriter into a
temporary directory and moved next to the others only once committed, so a shard file
that is present is complete. (MindRecord files record their own names, so a shard is
never renamed: it is written under its final name and only its directory changes.)

MindSpore is imported where a shard is opened or written, not with this module: the launcher reads
manifests and hashes only, and starts ~4 CPU-seconds sooner without it.
"""

import errno
import hashlib
import json
import os
import shutil
import time

import numpy as np

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.common.files import file_sha256, write_json_atomic

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PAGE_SIZE = 1 << 20
WRITE_BATCH = 1024  # samples per FileWriter call: bounded memory, few Python round trips
SCHEMA = {"input_ids": {"type": "int32", "shape": [-1]}}
MINDRECORD_MIN_FREE = 10 << 20  # FileWriter refuses to write with less free space than this ("No free disk")
VERIFY_CACHE = ".verified.json"
# `--report DIR` writes DIR/report/ (or --report-output) holding at least these two.
REPORT_DIR, REPORT_TEXT, PADDING_PLOT = "report", "report.txt", "padding.png"
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 64 << 10  # the sampled hash reads 16 blocks of 64 KB per file (1 MB)


def partial_dir(output_dir: str) -> str:
    return output_dir.rstrip("/") + ".partial"


def lock_path(output_dir: str) -> str:
    """The lock a run holds on its output (data/prepare.py output_lock)."""
    return os.path.abspath(output_dir).rstrip("/") + ".lock"


def logs_dir(output_dir: str) -> str:
    """Where the run in many tasks keeps datatrove's records (its completed tasks, the sbatch scripts)."""
    return os.path.abspath(output_dir.rstrip("/") + ".logs")


def write_shard(directory: str, name: str, rows: np.ndarray, pad_id: int) -> dict:
    """Write one complete shard atomically; returns its manifest entry.

    The FileWriter writes `name` (and its `.db` index) inside `.tmp-<name>/`; both files
    move into `directory` after commit, the index last, so a half-written shard never sits
    among the finished ones.
    """
    scratch = os.path.join(directory, f".tmp-{name}")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    path = os.path.join(scratch, name)
    from mindspore.mindrecord import FileWriter

    try:
        writer = FileWriter(path, shard_num=1, overwrite=True)
        writer.set_page_size(PAGE_SIZE)  # the 32 MB default leaves small shards mostly empty
        writer.add_schema(SCHEMA, "packed_tokens")
        for start in range(0, len(rows), WRITE_BATCH):
            writer.write_raw_data([{"input_ids": row} for row in rows[start:start + WRITE_BATCH]])
        writer.commit()
    except BaseException as err:
        shutil.rmtree(scratch, ignore_errors=True)
        # MindRecord reports a full disk as a RuntimeError; callers handle it as the OSError it is.
        if isinstance(err, RuntimeError) and ("No free disk" in str(err) or
                                              shutil.disk_usage(directory).free < MINDRECORD_MIN_FREE):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path) from None
        raise
    entry = {"file": name, "samples": len(rows), "sha256": file_sha256(path), "db_sha256": file_sha256(path + ".db"),
             "padding_tokens": int((rows == pad_id).sum())}
    os.replace(path, os.path.join(directory, name))
    os.replace(path + ".db", os.path.join(directory, name + ".db"))
    os.rmdir(scratch)
    return entry


def shard_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index:05d}.mindrecord"


class ShardWriter:
    """Collects samples and writes a shard every `samples_per_shard`; resumable at any shard boundary.

    `rows` counts every sample ever handed to `add` (including those regenerated after a
    restart); samples already inside completed shards are skipped, so replaying the input
    from an earlier point writes nothing twice.
    """

    def __init__(self, directory: str, prefix: str, samples_per_shard: int, pad_id: int):
        self.directory, self.prefix = directory, prefix
        self.samples_per_shard, self.pad_id = samples_per_shard, pad_id
        self.shards: list = []
        self.rows = 0
        self.pending: list = []   # arrays of samples not yet in a shard, in order
        self.pending_count = 0

    @property
    def completed_rows(self) -> int:
        return sum(s["samples"] for s in self.shards)

    def add(self, rows: np.ndarray) -> int:
        """Take samples in stream order; returns how many shards this completed."""
        skip = max(0, min(len(rows), self.completed_rows - self.rows))
        self.rows += len(rows)
        if skip < len(rows):
            self.pending.append(rows[skip:])
            self.pending_count += len(rows) - skip
        written = 0
        while self.pending_count >= self.samples_per_shard:
            self._write(self.samples_per_shard)
            written += 1
        return written

    def finish(self) -> None:
        if self.pending_count:
            self._write(self.pending_count)

    def _write(self, count: int) -> None:
        taken, need = [], count  # only the shard's samples are copied, not everything pending
        while need:
            head = self.pending[0]
            taken.append(head[:need])
            if len(head) <= need:
                self.pending.pop(0)
            else:
                self.pending[0] = head[need:]
            need -= len(taken[-1])
        block = np.concatenate(taken) if len(taken) > 1 else taken[0]
        self.shards.append(write_shard(self.directory, shard_name(self.prefix, len(self.shards)), block,
                                       self.pad_id))
        self.pending_count -= count

    def uncovered(self, pending: list, rows: int) -> list:
        """The samples of an earlier `pending` (ending at sample `rows`) that no completed shard holds."""
        keep = max(0, rows - self.completed_rows)
        return [np.concatenate(pending)[-keep:]] if keep else []

    def restore(self, shards: list, rows: int, pending: list) -> None:
        self.shards, self.rows, self.pending = list(shards), rows, list(pending)
        self.pending_count = sum(len(p) for p in pending)

    def remove_strays(self) -> None:
        """Delete shard files not listed as completed (written after the last saved state) and scratch dirs."""
        listed = {s["file"] for s in self.shards}
        for name in os.listdir(self.directory):
            base = name[:-3] if name.endswith(".db") else name
            if name.startswith(f".tmp-{self.prefix}-"):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
            elif base.startswith(f"{self.prefix}-") and base.endswith(".mindrecord") and base not in listed:
                os.remove(os.path.join(self.directory, name))


def write_manifest(directory: str, manifest: dict) -> dict:
    manifest = {"format_version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **manifest}
    write_json_atomic(os.path.join(directory, MANIFEST), manifest, indent=2)
    return manifest


def read_manifest(dataset_dir: str) -> dict:
    """The manifest of a complete dataset, or a DataError saying what is wrong with the directory."""
    path = os.path.join(dataset_dir, MANIFEST)
    if not os.path.isdir(dataset_dir):
        raise DataError(f"dataset {dataset_dir}: directory does not exist")
    if not os.path.isfile(path):
        raise DataError(f"dataset {dataset_dir}: no {MANIFEST}, so it is not a complete dataset written "
                        "by scripts/prepare_data.py")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"dataset {dataset_dir}: {MANIFEST} is unreadable ({err})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"dataset {dataset_dir}: format_version {manifest.get('format_version')!r}, "
                        f"this code reads {FORMAT_VERSION}")
    return manifest


def check_files_present(dataset_dir: str, manifest: dict) -> None:
    """Cheap check that every shard and its index file exist (a copy without the .db files is common)."""
    for shard in manifest["shards"]:
        for name in (shard["file"], shard["file"] + ".db"):
            if not os.path.isfile(os.path.join(dataset_dir, name)):
                raise DataError(f"dataset {dataset_dir}: {name} listed in {MANIFEST} is missing "
                                "(MindRecord needs each shard and its .db index file)")


def verify_files(dataset_dir: str, manifest: dict) -> None:
    """Check every shard listed in the manifest exists with its recorded sha256."""
    for shard in manifest["shards"]:
        path = os.path.join(dataset_dir, shard["file"])
        if not os.path.isfile(path):
            raise DataError(f"dataset {dataset_dir}: shard {shard['file']} listed in {MANIFEST} is missing")
        if file_sha256(path) != shard["sha256"]:
            raise DataError(f"dataset {dataset_dir}: shard {shard['file']} does not match its sha256 "
                            f"in {MANIFEST} (modified or corrupt)")


def hashed_files(manifest: dict) -> list:
    """[(file name, sha256)] for every file the manifest hashes: shards, their .db index files (manifests
    written since the index files were hashed), the tokenizer."""
    files = [(s["file"], s["sha256"]) for s in manifest["shards"]]
    files += [(s["file"] + ".db", s["db_sha256"]) for s in manifest["shards"] if "db_sha256" in s]
    tokenizer = manifest.get("tokenizer", {})
    if "sha256" in tokenizer:
        files.append((tokenizer.get("file", "tokenizer.model"), tokenizer["sha256"]))
    return files


def indexes_hashed(manifest: dict) -> bool:
    """False for manifests written before the .db index files were hashed (their index files are not covered)."""
    return all("db_sha256" in s for s in manifest["shards"])


def verify_cached(dataset_dir: str, manifest: dict) -> str:
    """Launch-time check of the files the manifest hashes; returns what was verified, raises DataError.

    A file is checked in full (sha256) the first time and whenever its size or mtime changed;
    a file already verified with the same size and mtime is checked by size and a sampled hash
    (SAMPLE_BLOCKS blocks spread over the file, ~1 MB read). Results are cached per file in
    DATASET/.verified.json (or the user's cache directory when the dataset is read-only).
    """
    cache_path = _cache_path(dataset_dir)
    cache = _read_cache(cache_path)
    full, sampled = 0, 0
    for name, sha256 in hashed_files(manifest):
        path = os.path.join(dataset_dir, name)
        try:
            st = os.stat(path)
        except OSError:
            raise DataError(f"dataset {dataset_dir}: {name} listed in {MANIFEST} is missing",
                            hint=f"run python scripts/prepare_data.py --validate {dataset_dir} to see every problem "
                                 "and the command that rebuilds the dataset") from None
        known = cache.get(name, {})
        if known.get("size") == st.st_size and known.get("mtime_ns") == st.st_mtime_ns and \
                known.get("sha256") == sha256:
            ok = _sampled_digest(path, st.st_size) == known.get("sampled")
            sampled += 1
        else:
            ok = file_sha256(path) == sha256
            full += 1
            cache[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256,
                           "sampled": _sampled_digest(path, st.st_size)}
        if not ok:
            cache.pop(name, None)
            _write_cache(cache_path, cache)
            raise DataError(f"dataset {dataset_dir}: {name} does not match its sha256 in {MANIFEST} (modified or "
                            "corrupt); training on it is refused",
                            hint=f"run python scripts/prepare_data.py --validate {dataset_dir} to see every problem "
                                 "and the command that rebuilds the dataset")
    if full:
        _write_cache(cache_path, cache)
    text = f"{full + sampled} file(s) verified: {full} by full sha256, {sampled} by size, mtime and sampled hash"
    if not indexes_hashed(manifest):  # at least make sure MindRecord can open them
        for shard in manifest["shards"]:
            problem = open_problem(os.path.join(dataset_dir, shard["file"]))
            if problem:
                raise DataError(f"dataset {dataset_dir}: {shard['file']}: {problem}",
                                hint=f"run python scripts/prepare_data.py --validate {dataset_dir} to see every "
                                     "problem and the command that rebuilds the dataset")
        text += (f"; the .db index files are not covered by hashes ({MANIFEST} predates them: rebuild to cover "
                 "them), only opened")
    return text


def _sampled_digest(path: str, size: int) -> str:
    """sha256 of the size and SAMPLE_BLOCKS blocks at evenly spaced offsets (the first and last included)."""
    h = hashlib.sha256(str(size).encode())
    step = max(0, size - SAMPLE_BYTES) / max(1, SAMPLE_BLOCKS - 1)
    with open(path, "rb") as f:
        for k in range(SAMPLE_BLOCKS):
            h.update(os.pread(f.fileno(), SAMPLE_BYTES, int(k * step)))
    return h.hexdigest()


def _cache_path(dataset_dir: str) -> str:
    """DATASET/.verified.json when the dataset directory is writable, else one in the user's cache directory."""
    if os.access(dataset_dir, os.W_OK):
        return os.path.join(dataset_dir, VERIFY_CACHE)
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = hashlib.sha256(os.path.realpath(dataset_dir).encode()).hexdigest()[:16]
    return os.path.join(root, "ascend-llm-recipes", "verified", f"{key}.json")


def _read_cache(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            cache = json.load(f)
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache, or a damaged one: everything is checked in full


def _write_cache(path: str, cache: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json_atomic(path, cache, indent=2)
    except OSError:
        pass  # an unwritable cache only means full checks next time


def open_problem(path: str):
    """Why MindRecord cannot open a shard and its .db index (e.g. a corrupt index), or None when it can."""
    from mindspore.mindrecord import FileReader

    try:
        reader = FileReader(path)
        reader.close()
    except RuntimeError as err:
        lines = [line.strip() for line in str(err).splitlines()]
        reason = next((line for line in lines if line.startswith("[ERROR]")), lines[0] if lines else "")
        return f"MindRecord cannot open it with its index {os.path.basename(path)}.db ({reason[:200]})"
    return None


def shard_files(dataset_dir: str, manifest: dict) -> list:
    """The dataset's MindRecord files, in manifest order (what MindDataset is given)."""
    return [os.path.join(dataset_dir, shard["file"]) for shard in manifest["shards"]]


def read_samples(dataset_dir: str, manifest: dict):
    """Yield the stored samples in order, shard by shard (for inspection and tests)."""
    from mindspore.mindrecord import FileReader

    for shard in manifest["shards"]:
        reader = FileReader(os.path.join(dataset_dir, shard["file"]))
        try:
            for item in reader.get_next():
                yield np.asarray(item["input_ids"], dtype=np.int32)
        finally:
            reader.close()
