"""Packed samples on disk: MindRecord shards plus a manifest that describes them.

A dataset directory is complete exactly when `manifest.json` exists: everything is
written into a sibling `*.partial` directory, the manifest last, and the directory is
renamed into place. (MindRecord files record their own names, so files are never
renamed; renaming the directory that holds them is safe.) One writer per shard keeps
shards independent of each other.
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
SCHEMA = {"input_ids": {"type": "int32", "shape": [-1]}}


def partial_dir(output_dir: str) -> str:
    return output_dir.rstrip("/") + ".partial"


def write_shards(rows, directory: str, samples_per_shard: int) -> list:
    """Write int32 rows into MindRecord shards of at most `samples_per_shard`; returns shard entries."""
    shards = []
    batch: list = []

    def flush():
        name = f"train-{len(shards):05d}.mindrecord"
        path = os.path.join(directory, name)
        writer = FileWriter(path, shard_num=1, overwrite=True)
        writer.set_page_size(PAGE_SIZE)  # the 32 MB default leaves small shards mostly empty
        writer.add_schema(SCHEMA, "packed_tokens")
        writer.write_raw_data([{"input_ids": row} for row in batch])
        writer.commit()
        shards.append({"file": name, "samples": len(batch), "sha256": file_sha256(path)})
        batch.clear()

    for row in rows:
        batch.append(row)
        if len(batch) == samples_per_shard:
            flush()
    if batch:
        flush()
    return shards


def finalize(work_dir: str, output_dir: str, manifest: dict) -> None:
    """Write the manifest (the completion marker) and move the finished directory into place."""
    manifest = {"format_version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **manifest}
    tmp = os.path.join(work_dir, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(work_dir, MANIFEST))
    os.rename(work_dir, output_dir)


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


def read_samples(dataset_dir: str, manifest: dict):
    """Yield the stored samples in order, shard by shard (for inspection and tests)."""
    for shard in manifest["shards"]:
        reader = FileReader(os.path.join(dataset_dir, shard["file"]))
        try:
            for item in reader.get_next():
                yield np.asarray(item["input_ids"], dtype=np.int32)
        finally:
            reader.close()


def remove_partial(output_dir: str) -> None:
    """Delete leftovers of an interrupted preparation (never a completed dataset)."""
    shutil.rmtree(partial_dir(output_dir), ignore_errors=True)
