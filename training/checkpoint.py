"""Checkpoints that can be trusted: complete state, atomic files, a manifest written last, verify on load.

Layout (one directory per step, one subdirectory per rank):

    RUN_DIR/checkpoints/step_00000120/rank_0/<prefix>_rank_0-<epoch>_120.ckpt
                                     /rank_0/manifest.json   per-file sha256, per-tensor shape/dtype/sha256
                                     /state.json             data position, RNG, recipe and dataset hashes

The .ckpt holds weights, AdamW moments (and the float32 masters of 16-bit weights), the optimizer's
global step (hence the LR-schedule position), the loss scale and the epoch/step/global-batch values
MindFormers reads on resume; not the gradient-accumulation buffers (NOT_SAVED).
Every file is written under a temporary name, flushed and renamed; a rank's manifest.json is
written last, so a step is complete exactly when every rank's manifest exists. A crash at any
moment leaves the previous complete step usable.
"""

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass

from ascend_llm_recipes.common.files import file_sha256, write_atomic
from ascend_llm_recipes.common.errors import PretrainError
from ascend_llm_recipes.models.shapes import STATISTICS, UNTRAINED_PARAMETERS
from ascend_llm_recipes.training.run_files import CHECKPOINTS, INVALID, REASON

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


# Parameters a resume does not need. MindFormers' accumulation buffers (accu_grads.*, a zero clone of every
# weight, mindformers/wrapper/wrapper.py:849) are zeroed after each step's update (wrapper.py:462-463, 473-474), so
# at a save they hold zeros: MindFormers' own CheckpointMonitor leaves them out (core/callback/callback.py:1704).
# For Llama 2 7B in float32 that is 27 GB of zeros per rank, 216 GB per save of 8 ranks.
NOT_SAVED = ("accu_grads.",)


def saved_parameter(name: str) -> bool:
    """Whether a parameter of the train network goes into the checkpoint (see NOT_SAVED)."""
    return not name.startswith(NOT_SAVED)


class Snapshot(list):
    """The tensors one rank writes ({"name", "data"} dicts), and the names it leaves to other ranks (`elsewhere`)."""

    def __init__(self, tensors, elsewhere=()):
        super().__init__(tensors)
        self.elsewhere = sorted(elsewhere)


def held_here(param, parallel: bool) -> bool:
    """Whether this rank's graph holds `param`, by the rule MindSpore's own save applies.

    MindSpore 2.9 leaves out a pipeline-shared parameter (held by the stage that owns it) and, in (semi-)auto
    parallel graph mode, every parameter that is `not param.sliced or param.has_init`
    (mindspore/train/serialization.py:924-927): a parameter of another pipeline stage is never initialised in
    this rank's graph (mindspore/nn/cell.py:1942-1943) and `asnumpy()` would build it at its full unsliced shape
    (mindspore/common/tensor.py:1011-1012): for Qwen3-30B-A3B at PP 4, ~320 GB of host memory per rank.
    `parallel` is MindSpore's own test for that mode: some parameter was initialised by the parallel compiler
    (param_info.is_param_init, serialization.py:857-862).
    """
    if param.param_info.is_pipeline_shared_param:
        return False
    return not parallel or (param.sliced and not param.has_init)


def snapshot(cell) -> Snapshot:
    """Host copies of the parameters a resume needs that this rank holds: the state at this instant, safe to write
    while training goes on."""
    import mindspore as ms

    params = [p for p in cell.get_parameters() if saved_parameter(p.name)]
    # The graph-mode condition of serialization.py:926: in PyNative every parameter is initialised at once.
    parallel = ms.get_context("mode") == ms.GRAPH_MODE and any(p.param_info.is_param_init for p in params)
    held = [p for p in params if held_here(p, parallel)]
    return Snapshot(({"name": p.name, "data": ms.Tensor(p.asnumpy())} for p in held),
                    {p.name for p in params} - {p.name for p in held})


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
                "sha256": file_sha256(final), "tensors": tensors,
                "elsewhere": getattr(params, "elsewhere", []), "written": time.time()}
    write_atomic(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1))
    return final


def complete_steps(run_dir: str, kind: str = "step") -> list:
    """Steps whose every rank (of the world size that saved them) wrote its manifest, oldest first."""
    root = os.path.join(run_dir, CHECKPOINTS)
    steps = []
    for entry in step_entries(run_dir, kind)[::-1]:
        directory = os.path.join(root, entry)
        ranks = range(step_world_size(directory))
        if all(os.path.isfile(os.path.join(directory, f"rank_{r}", MANIFEST)) for r in ranks):
            steps.append(int(entry.split("_")[1]))
    return steps


def verify_step(directory: str, world_size: int, expected_shapes: "RankShapes" = None, need_optimizer: bool = True,
                deep: bool = True) -> list:
    """Every problem with one step directory: missing/corrupt files, wrong shapes, missing optimizer or data state.

    `need_optimizer`: the step must be resumable (AdamW moments and a readable state.json).
    `deep=False` skips the file hashes (sizes are still compared): a cheap check for older steps.
    """
    if isinstance(expected_shapes, dict):
        expected_shapes = RankShapes(expected_shapes)
    problems, held, elsewhere, unread = [], set(), {}, False
    for rank in range(world_size):
        rank_dir = os.path.join(directory, f"rank_{rank}")
        try:
            manifest = read_json(os.path.join(rank_dir, MANIFEST))
            file_name, size, sha256 = manifest["file"], manifest["bytes"], manifest["sha256"]
            tensors = manifest["tensors"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            problems.append(f"{rank_dir}: no readable {MANIFEST} ({err.__class__.__name__}): incomplete save")
            unread = True
            continue
        held.update(tensors)
        for name in manifest.get("elsewhere", ()):
            elsewhere.setdefault(name, f"rank {rank}")
        path = os.path.join(rank_dir, file_name)
        if not os.path.isfile(path):
            problems.append(f"{path}: listed in {MANIFEST} but missing")
            continue
        if os.path.getsize(path) != size:
            problems.append(f"{path}: {os.path.getsize(path)} bytes, {MANIFEST} says {size} (truncated?)")
            continue
        if deep and file_sha256(path) != sha256:
            problems.append(f"{path}: sha256 differs from {MANIFEST} (corrupt)")
            continue
        problems.extend(shape_problems(path, tensors, expected_shapes))
        if need_optimizer and expected_shapes:
            missing = [n for n in expected_shapes if not n.endswith(UNTRAINED_PARAMETERS)
                       and (f"adam_m.{n}" not in tensors or f"adam_v.{n}" not in tensors)]
            if missing:
                problems.append(f"{path}: no AdamW state for {len(missing)} tensors (e.g. {missing[0]}); resuming "
                                "needs it. To start from these weights only, set load_checkpoint without "
                                "resume_training")
    if not unread:  # a rank without a manifest is reported as an incomplete save instead
        problems.extend(unheld_problems(directory, held, elsewhere))
    if need_optimizer:
        problems.extend(state_problems(directory))
    return problems


def unheld_problems(directory: str, held: set, elsewhere: dict) -> list:
    """Tensors a rank left to another (`elsewhere` in its manifest: another pipeline stage's) that no rank holds.

    A resume loads each rank's file into that rank's graph by name (MindFormers), so a weight or moment no rank
    saved would train on from its initialiser. Other parameters no graph uses (MindSpore's save leaves them out
    too, so MindFormers' own checkpoints lack them) are not judged.
    """
    lost = sorted(n for n in set(elsewhere) - held if is_weight(n))
    return [f"{directory}: {len(lost)} tensor(s) left by {elsewhere[lost[0]]} to another pipeline stage but held by "
            f"no rank (e.g. {lost[0]}): a resume would train them from their initialisers"] if lost else []


def is_weight(name: str) -> bool:
    """Whether a saved tensor is a model weight or its optimizer state (not a counter: models/shapes.py STATISTICS)."""
    return ("model." in name or "lm_head." in name) and not name.endswith(STATISTICS)


def shape_problems(path: str, tensors: dict, expected) -> list:
    """A rank's tensors (manifest entries) against RankShapes: each parameter and its AdamW moments at the
    shape this rank holds."""
    problems = []
    for name in expected or ():
        if name not in tensors:
            problems.append(f"{path}: tensor {name} missing (checkpoint of another model?)")
            continue
        need = expected.shape(name, itemsize(tensors[name]["dtype"]))
        for key in (name, f"adam_m.{name}", f"adam_v.{name}"):
            if key in tensors and tuple(tensors[key]["shape"]) != need:
                wanted = (f"the recipe's model needs {need}" if expected.optimizer_shard <= 1 else
                          f"this rank holds {need} of it under the recipe's layout{held_note(expected, name)}")
                problems.append(f"{path}: tensor {key} has shape {tuple(tensors[key]['shape'])}, {wanted}")
    return problems


def held_note(expected, name: str) -> str:
    if expected.optimizer_shard <= 1:
        return ""
    return (f" (optimizer parallel: the whole {tuple(expected.whole[name])} sliced over {expected.optimizer_shard} "
            f"data-parallel ranks when >= {expected.threshold_kb} KB and its first dimension divides)")


def state_problems(directory: str) -> list:
    """What is wrong with a step's state.json (the data position a resume continues from); [] when usable."""
    path = os.path.join(directory, STATE)
    try:
        state = read_json(path)
        missing = [k for k in ("step", "global_batch_size", "data_position") if not isinstance(state.get(k), int)]
    except FileNotFoundError:
        return [f"{path}: missing (the data position of this step is unknown)"]
    except (OSError, ValueError, AttributeError) as err:
        return [f"{path}: unreadable ({err.__class__.__name__}: truncated or corrupt)"]
    return [f"{path}: no integer {', '.join(missing)} (corrupt)"] if missing else []


def step_entries(run_dir: str, kind: str = "step") -> list:
    """Names of the run's `kind` step directories (step_N, nan_N, spike_N), newest first."""
    root = os.path.join(run_dir, CHECKPOINTS)
    entries = os.listdir(root) if os.path.isdir(root) else []
    return sorted((e for e in entries if re.fullmatch(kind + r"_\d+", e)), reverse=True)


@dataclass(frozen=True)
class RankShapes:
    """The model parameters a rank's checkpoint holds, each at the shape that rank keeps of it.

    `whole` are the model's shapes; with `optimizer_shard` > 1 (semi-auto parallel with optimizer
    parallel, no TP or PP) a parameter is kept sliced over that many data-parallel copies when it is
    large enough (models/parallel.py optimizer_shard_shape). The threshold is in the parameter's own
    dtype, so the held shape takes the itemsize of the tensor as the file stores it.
    """
    whole: dict
    optimizer_shard: int = 1
    threshold_kb: int = 0

    def __iter__(self):
        return iter(self.whole)

    def __contains__(self, name) -> bool:
        return name in self.whole

    def shape(self, name: str, itemsize: int = 4) -> tuple:
        from ascend_llm_recipes.models.parallel import optimizer_shard_shape

        return optimizer_shard_shape(self.whole[name], itemsize, self.optimizer_shard, self.threshold_kb)


# numpy's dtype names as the manifest records them (bfloat16 has no numpy name without ml_dtypes).
ITEMSIZES = {"bfloat16": 2}


def itemsize(dtype: str) -> int:
    import numpy as np

    return ITEMSIZES.get(dtype) or np.dtype(dtype).itemsize


def model_shapes(recipe) -> dict:
    """{parameter: whole shape} of the recipe's model as it runs: MoE layers stacked where they are MindFormers'
    MoELayer (training/recipe/mindformers.py runs_mindformers_moe), per expert where they are ours."""
    from ascend_llm_recipes.models.conversion.ours import stacked_shapes
    from ascend_llm_recipes.models.shapes import parameter_shapes
    from ascend_llm_recipes.training.recipe.mindformers import runs_mindformers_moe

    shapes = parameter_shapes(recipe.model.model_config, recipe.parallel_config.model_parallel)
    return stacked_shapes(shapes, recipe.model.model_config) if runs_mindformers_moe(recipe) else shapes


def rank_shapes(recipe):
    """What every rank's checkpoint must hold (RankShapes), or None where MindSpore alone knows a rank's part.

    Under data parallel each rank saves the whole model. In semi-auto parallel without TP and PP (e.g.
    MindFormers' 7B layout DP 8 x TP 1, the kit's dp8_opt) every rank holds the same parts: whole tensors, or
    with optimizer parallel the slices MindSpore keeps (RankShapes). Under TP or PP a rank holds its strategy's
    slices and its stage's layers only, which the strategy file decides; files, hashes and the manifest are still
    verified and MindSpore checks the slices against the strategy at load. Auto parallel (mode 2) searches strategies
    itself: None too.
    """
    from ascend_llm_recipes.training.recipe.mindformers import semi_auto

    p = recipe.parallel_config
    whole = model_shapes(recipe)
    if not semi_auto(recipe):
        return RankShapes(whole)
    if p.model_parallel > 1 or p.pipeline_stage > 1 or recipe.parallel.parallel_mode != 1:
        return None
    if not recipe.parallel.enable_parallel_optimizer:
        return RankShapes(whole)
    return RankShapes(whole, p.data_parallel, recipe.parallel.parallel_optimizer_config.parallel_optimizer_threshold)


def scan_steps(run_dir: str, expected_shapes: "RankShapes" = None) -> tuple:
    """((step, directory) of the newest valid step or (None, None), [(directory, problems)] of invalid ones).

    Each step is verified against the ranks that saved it (step_world_size), not against the
    launch's world size: under data parallel every rank's file holds the whole model, so a step
    saved at another data-parallel degree resumes (resume_rank) and is never set aside for it.
    Steps newer than the one found are fully verified (file hashes); older ones get the cheap
    check (manifests, sizes, state.json), so a launch hashes one checkpoint, not all of them.
    """
    found, invalid = (None, None), []
    for entry in step_entries(run_dir):
        directory = os.path.join(run_dir, CHECKPOINTS, entry)
        problems = verify_step(directory, step_world_size(directory), expected_shapes, deep=found[0] is None)
        if problems:
            invalid.append((directory, problems))
        elif found[0] is None:
            found = (int(entry.split("_")[1]), directory)
    return found, invalid


def newest_valid_step(run_dir: str, expected_shapes: "RankShapes" = None, log=print):
    """(step, directory) of the newest complete, verified step, warning about each invalid one."""
    found, invalid = scan_steps(run_dir, expected_shapes)
    for directory, problems in invalid:
        log(f"[checkpoint] skipping {directory}: " + "; ".join(problems))
    return found


def resume_rank(directory: str, rank: int) -> int:
    """The rank whose file `rank` resumes from in a step directory: its own, or rank 0's where the step has none.

    A step saved at a lower data-parallel degree has fewer rank directories than the resumed run
    has ranks. In data-parallel mode every rank's file holds the whole model and the same AdamW state
    (gradients are averaged before the update; tests/test_data_parallel.py checks identical weights),
    so rank 0's file is every new rank's state. Semi-auto checkpoints hold slices: the launcher
    refuses to resume them at another device count (training/tools/relayout.py check_relayout).
    """
    return rank if rank < step_world_size(directory) else 0


def set_aside(directory: str, problems: list) -> str:
    """Move an invalid step directory to checkpoints/invalid/ with a REASON.txt; returns where it went."""
    target = os.path.join(os.path.dirname(directory), INVALID, os.path.basename(directory))
    base, n = target, 1
    while os.path.exists(target):
        n += 1
        target = f"{base}.{n}"
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.replace(directory, target)
    write_atomic(os.path.join(target, REASON), f"set aside {time.strftime('%Y-%m-%dT%H:%M:%S%z')} from "
                 f"{directory}:\n" + "".join(f"- {p}\n" for p in problems))
    return target


STEP_DIR = re.compile(r"(step|nan|spike)_\d+")


def steps_to_verify(path: str) -> list:
    """The step directories a user's path stands for: a run directory's, one step's, or the step of a rank's file.

    Anything else (missing, empty, a text file, the checkpoints folder itself, a .ckpt
    without its manifest) is refused with what to pass instead.
    """
    hint = "pass a run directory (RUN_DIR, holding checkpoints/) or one step directory (RUN_DIR/checkpoints/step_N)"
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: does not exist", hint=hint)
    path = os.path.abspath(path)
    if not os.path.isfile(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path}: neither a file nor a directory", hint=hint)
    if os.path.isfile(path) or os.path.basename(path).startswith("rank_"):
        rank_dir = path if os.path.isdir(path) else os.path.dirname(path)
        try:
            listed = read_json(os.path.join(rank_dir, MANIFEST)).get("file")
        except (OSError, ValueError, AttributeError):
            listed = None
        if not path.endswith(".ckpt") and os.path.isfile(path):
            raise CheckpointError(f"{path}: a file, not a checkpoint", hint=hint)
        if listed is None or (os.path.isfile(path) and listed != os.path.basename(path)):
            raise CheckpointError(f"{path}: no {MANIFEST} beside it naming this file, so there is nothing to verify "
                                  "it against (a bare .ckpt, or an incomplete save)", hint=hint)
        return [os.path.dirname(rank_dir)]  # a rank's file is verified with its whole step
    root = os.path.join(path, CHECKPOINTS)
    if os.path.isdir(root):
        entries = [os.path.join(root, e) for e in sorted(os.listdir(root)) if STEP_DIR.fullmatch(e)]
        if not entries:
            raise CheckpointError(f"{root}: no checkpoint step directories (nothing saved yet?)", hint=hint)
        return entries
    names = os.listdir(path)
    if os.path.basename(path) == CHECKPOINTS or any(STEP_DIR.fullmatch(n) for n in names):
        raise CheckpointError(f"{path}: the checkpoints folder itself", hint=f"pass the run directory "
                              f"{os.path.dirname(path)}, or one step directory such as {os.path.join(path, 'step_N')}")
    if STEP_DIR.fullmatch(os.path.basename(path)) or any(n.startswith("rank_") for n in names) or STATE in names:
        return [path]
    raise CheckpointError(f"{path}: {'an empty folder' if not names else 'no checkpoint here'}", hint=hint)


def step_world_size(directory: str) -> int:
    """Ranks a step was saved by, from its manifests (at least 1, so a step without any is reported incomplete)."""
    ranks = sorted(e for e in os.listdir(directory) if e.startswith("rank_")) if os.path.isdir(directory) else []
    for rank in ranks:
        try:
            return int(read_json(os.path.join(directory, rank, MANIFEST))["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max(len(ranks), 1)


def describe_step(directory: str, world_size: int) -> str:
    """One line on what a verified step holds: step, ranks, tensors, data position."""
    manifest = read_json(os.path.join(directory, "rank_0", MANIFEST))
    text = f"step {manifest.get('step')}, {world_size} rank(s), {len(manifest['tensors'])} tensors per rank"
    try:
        state = read_json(os.path.join(directory, STATE))
        text += f", {state['data_position']} samples consumed (global batch {state['global_batch_size']})"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return text


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def prune(run_dir: str, rank: int, keep_last: int, keep_every: int) -> None:
    """Keep this rank's newest `keep_last` complete steps (and every `keep_every`-th).

    Only complete steps count, and the launcher has moved invalid ones to checkpoints/invalid/
    (scan_steps, set_aside) before training, so the newest valid step is never deleted.
    """
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
