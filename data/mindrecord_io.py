"""Packed samples on disk: MindRecord shards plus a manifest that describes them.

A dataset directory is complete exactly when `manifest.json` exists: everything is
written into a sibling `*.partial` directory, the manifest last, and the directory is
renamed into place. Inside it, each shard is written by its own FileWriter into a
temporary directory and moved next to the others only once committed, so a shard file
that is present is complete. (MindRecord files record their own names, so a shard is
never renamed: it is written under its final name and only its directory changes.)
"""

import json
import os
import shutil
import time

import numpy as np
from mindspore.mindrecord import FileReader, FileWriter

from data.tokenizer import file_sha256
from training.errors import DataError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PAGE_SIZE = 1 << 20
WRITE_BATCH = 1024  # samples per FileWriter call: bounded memory, few Python round trips
SCHEMA = {"input_ids": {"type": "int32", "shape": [-1]}}


def partial_dir(output_dir: str) -> str:
    return output_dir.rstrip("/") + ".partial"


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
    writer = FileWriter(path, shard_num=1, overwrite=True)
    writer.set_page_size(PAGE_SIZE)  # the 32 MB default leaves small shards mostly empty
    writer.add_schema(SCHEMA, "packed_tokens")
    for start in range(0, len(rows), WRITE_BATCH):
        writer.write_raw_data([{"input_ids": row} for row in rows[start:start + WRITE_BATCH]])
    writer.commit()
    entry = {"file": name, "samples": len(rows), "sha256": file_sha256(path),
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
        block = np.concatenate(self.pending)
        self.shards.append(write_shard(self.directory, shard_name(self.prefix, len(self.shards)), block[:count],
                                       self.pad_id))
        rest = block[count:]
        self.pending = [rest] if len(rest) else []
        self.pending_count = len(rest)

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


def write_json_atomic(path: str, data: dict) -> None:
    """Write JSON so that `path` holds either the old or the complete new content, even after a crash."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def write_manifest(directory: str, manifest: dict) -> dict:
    manifest = {"format_version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **manifest}
    write_json_atomic(os.path.join(directory, MANIFEST), manifest)
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


def shard_files(dataset_dir: str, manifest: dict) -> list:
    """The dataset's MindRecord files, in manifest order (what MindDataset is given)."""
    return [os.path.join(dataset_dir, shard["file"]) for shard in manifest["shards"]]


def read_samples(dataset_dir: str, manifest: dict):
    """Yield the stored samples in order, shard by shard (for inspection and tests)."""
    for shard in manifest["shards"]:
        reader = FileReader(os.path.join(dataset_dir, shard["file"]))
        try:
            for item in reader.get_next():
                yield np.asarray(item["input_ids"], dtype=np.int32)
        finally:
            reader.close()
