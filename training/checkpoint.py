"""Checkpoints that can be trusted: complete state, atomic files, a manifest written last, verify on load.

Layout (one directory per step, one subdirectory per rank):

    RUN_DIR/checkpoints/step_00000120/rank_0/<prefix>_rank_0-<epoch>_120.ckpt
                                     /rank_0/manifest.json   per-file sha256, per-tensor shape/dtype/sha256
                                     /state.json             data position, RNG, recipe and dataset hashes

The .ckpt holds weights, AdamW moments, the optimizer's global step (hence the LR-schedule
position), the loss scale and the epoch/step/global-batch values MindFormers reads on resume.
Every file is written under a temporary name, flushed and renamed; a rank's manifest.json is
written last, so a step is complete exactly when every rank's manifest exists. A crash at any
moment leaves the previous complete step usable.
"""

import hashlib
import json
import os
import shutil
import time

from data.tokenizer import file_sha256
from training.errors import PretrainError

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
STATE = "state.json"
FORMAT_VERSION = 1


class CheckpointError(PretrainError):
    """A checkpoint is incomplete, corrupt, or does not belong to this recipe."""


def resumed_steps(state: dict, global_batch_size: int) -> int:
    """Steps of `global_batch_size` a checkpoint's data position (its state.json) equals; refused if not whole."""
    position = state["data_position"]
    if position % global_batch_size:
        raise CheckpointError(f"resume from step {state['step']}: the checkpoint consumed {position} samples (global "
                              f"batch {state['global_batch_size']}), not a whole number of this recipe's global batch "
                              f"{global_batch_size}",
                              hint="keep runner_config.batch_size x data_parallel x accumulation dividing it")
    return position // global_batch_size


def step_dir(run_dir: str, step: int, kind: str = "step") -> str:
    return os.path.join(run_dir, CHECKPOINTS, f"{kind}_{step:08d}")


def ckpt_name(prefix: str, rank: int, epoch: int, step: int) -> str:
    # MindFormers resumes a checkpoint by this name pattern (rank_N is replaced per rank).
    return f"{prefix}_rank_{rank}-{epoch}_{step}.ckpt"


def write_atomic(path: str, text: str) -> None:
    """`path` holds the old or the whole new text, even after a crash; ranks may write the same path at once."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def snapshot(cell) -> list:
    """Host copies of every parameter: the state at this instant, safe to write while training goes on."""
    import mindspore as ms

    return [{"name": p.name, "data": ms.Tensor(p.asnumpy())} for p in cell.get_parameters()]


def write_rank(directory: str, name: str, params: list, append: dict, meta: dict) -> str:
    """Write one rank's checkpoint file and then its manifest (the completion marker); returns the file."""
    import mindspore as ms

    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, ".partial-" + name)  # must end in .ckpt, or MindSpore appends it
    ms.save_checkpoint(params, tmp, append_dict=append)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    tensors = {}
    for p in params:
        array = p["data"].asnumpy()
        tensors[p["name"]] = {"shape": list(array.shape), "dtype": str(array.dtype),
                              "sha256": hashlib.sha256(array.tobytes()).hexdigest()}
    manifest = {"format_version": FORMAT_VERSION, **meta, "file": name, "bytes": os.path.getsize(final),
                "sha256": file_sha256(final), "tensors": tensors, "written": time.time()}
    write_atomic(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1))
    return final


def complete_steps(run_dir: str, world_size: int, kind: str = "step") -> list:
    """Steps whose every rank wrote its manifest, oldest first."""
    root = os.path.join(run_dir, CHECKPOINTS)
    steps = []
    for entry in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if entry.startswith(kind + "_") and all(
                os.path.isfile(os.path.join(root, entry, f"rank_{r}", MANIFEST)) for r in range(world_size)):
            steps.append(int(entry.split("_")[1]))
    return steps


def verify_step(directory: str, world_size: int, expected_shapes: dict = None, need_optimizer: bool = True) -> list:
    """Every problem with one step directory: missing/corrupt files, wrong shapes, missing optimizer state."""
    problems = []
    for rank in range(world_size):
        rank_dir = os.path.join(directory, f"rank_{rank}")
        try:
            with open(os.path.join(rank_dir, MANIFEST), encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            problems.append(f"{rank_dir}: no readable {MANIFEST} ({err.__class__.__name__}): incomplete save")
            continue
        path = os.path.join(rank_dir, manifest["file"])
        if not os.path.isfile(path):
            problems.append(f"{path}: listed in {MANIFEST} but missing")
            continue
        if os.path.getsize(path) != manifest["bytes"]:
            problems.append(f"{path}: {os.path.getsize(path)} bytes, {MANIFEST} says {manifest['bytes']} (truncated?)")
            continue
        if file_sha256(path) != manifest["sha256"]:
            problems.append(f"{path}: sha256 differs from {MANIFEST} (corrupt)")
            continue
        tensors = manifest["tensors"]
        for name, shape in (expected_shapes or {}).items():
            if name not in tensors:
                problems.append(f"{path}: tensor {name} missing (checkpoint of another model?)")
            elif tuple(tensors[name]["shape"]) != tuple(shape):
                problems.append(f"{path}: tensor {name} has shape {tuple(tensors[name]['shape'])}, the recipe's "
                                f"model needs {tuple(shape)}")
        if need_optimizer and expected_shapes:
            missing = [n for n in expected_shapes if f"adam_m.{n}" not in tensors or f"adam_v.{n}" not in tensors]
            if missing:
                problems.append(f"{path}: no AdamW state for {len(missing)} tensors (e.g. {missing[0]}); resuming "
                                "needs it. To start from these weights only, set load_checkpoint without "
                                "resume_training")
    return problems


def newest_valid_step(run_dir: str, world_size: int, expected_shapes: dict = None, log=print):
    """(step, directory) of the newest complete, verified step, warning about each newer one skipped."""
    root = os.path.join(run_dir, CHECKPOINTS)
    candidates = sorted((e for e in (os.listdir(root) if os.path.isdir(root) else []) if e.startswith("step_")),
                        reverse=True)
    for entry in candidates:
        directory = os.path.join(root, entry)
        problems = verify_step(directory, world_size, expected_shapes)
        if not problems:
            return int(entry.split("_")[1]), directory
        log(f"[checkpoint] skipping {directory}: " + "; ".join(problems))
    return None, None


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def prune(run_dir: str, rank: int, keep_last: int, keep_every: int) -> None:
    """Keep this rank's newest `keep_last` steps (and every `keep_every`-th); never an incomplete newest."""
    root = os.path.join(run_dir, CHECKPOINTS)
    steps = sorted(int(e.split("_")[1]) for e in os.listdir(root) if e.startswith("step_")
                   and os.path.isfile(os.path.join(root, e, f"rank_{rank}", MANIFEST)))
    for step in steps[:-keep_last] if keep_last > 0 else []:
        if keep_every and step % keep_every == 0:
            continue
        shutil.rmtree(os.path.join(step_dir(run_dir, step), f"rank_{rank}"), ignore_errors=True)
        if rank == 0:
            try:
                os.remove(os.path.join(step_dir(run_dir, step), STATE))
            except OSError:
                pass
        try:
            os.rmdir(step_dir(run_dir, step))
        except OSError:
            pass  # other ranks' files still there
