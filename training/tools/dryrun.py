"""`--check --dry-run`: compile the recipe's training graph under MindSpore's DryRun, one rank of each role.

With MS_SIMULATION_LEVEL=1 MindSpore builds the whole semi-auto-parallel step (strategies, communication groups,
pipeline stages, the memory its compiler plans) without a device: against real CANN on an Ascend host, or against
any CANN-shaped tree (training/tools/simulated_cann.py builds one of no-op libraries). It needs no dataset (the
worker trains on zeros of the data's shape: data/loader.py simulated_train_dataset) and no earlier run: each
compile has a run directory of its own under OUTPUT_DIR/dryrun/.

One rank per pipeline stage is compiled: under semi-auto parallel every rank compiles the same network and keeps
its stage, and the ranks of one stage differ only in their slice (data, tensor and expert-parallel position), not
in the graph. Per rank it prints whether it compiled, in how many seconds, and MindSpore's simulated peak memory
beside the planner's figure for that stage. Simulated memory leaves out what only kernels know (aclnn workspaces
are 0 under the stubs; FlashAttention's and the collectives' buffers likewise): a lower bound, never a figure of
the hardware.
"""

import dataclasses
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Optional

from ascend_llm_recipes.common.errors import LaunchError, RecipeError
from ascend_llm_recipes.common.processes import die_with_parent
from ascend_llm_recipes.common.units import byte_size
from ascend_llm_recipes.training.run_files import RESOLVED_RECIPE, STRATEGY_DIR

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO_ROOT, "scripts", "train.py")
DRYRUN_DIR = "dryrun"
# What MindSpore prints at the end of a simulated run (ms_context / memory manager): the peak of its memory pool.
_PEAK = re.compile(r"Actual peak memory usage \(with fragments\): (\d+)M")
PARALLEL_COMPILES = 4  # ranks compiled at once (each a single-threaded MindSpore compile of the whole network)
LOCK_NAME = "dryrun.lock"  # OUTPUT_DIR/dryrun/dryrun.lock: one dry run of an output_dir at a time
_RUNNING = set()  # the compiles' processes, stopped on Ctrl-C


@dataclass
class Compiled:
    """What one rank's DryRun compile produced."""

    stage: int
    rank: int
    seconds: float
    returncode: int
    run_dir: str
    log: str
    simulated_peak_bytes: Optional[int]  # MindSpore's pool peak, None when it printed none
    planned_bytes: int                   # the planner's figure for this stage, same recipe

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def roles(recipe) -> list:
    """(stage, rank) of the first rank of each pipeline stage."""
    per_stage = recipe.world_size // recipe.parallel_config.pipeline_stage
    return [(stage, stage * per_stage) for stage in range(recipe.parallel_config.pipeline_stage)]


def compile_recipe(recipe):
    """The recipe as compiled: one step on zeros, nothing saved, evaluated or profiled; the LR schedule as sized
    for the real run (its warm-up must still fit)."""
    import copy

    r = copy.deepcopy(recipe)
    s = r.lr_schedule
    if s.total_steps == -1:
        s.total_steps = max(r.runner_config.stop_step, (s.warmup_steps or 0) + 1, 1)
    r.runner_config.stop_step = 1
    r.callbacks = [c for c in r.callbacks if c.type != "CheckpointMonitor"]
    r.do_eval, r.profile = False, None
    r.monitoring.tensorboard = False
    r.resume_training, r.load_checkpoint, r.load_optimizer_state, r.auto_trans_ckpt = False, "", "", False
    return r


# On a small host (this project's CI: 2 cores) MindSpore's parallel compile of a deep recipe takes too long: Llama 2
# 7B's 32 layers at DP 4 x TP 2 ran over 25 minutes there without finishing. A recipe of more than
# SMALL_HOST_FULL_DEPTH layers per pipeline stage is then compiled at SMALL_HOST_LAYERS_PER_STAGE: every operator,
# strategy, group and stage boundary of a layer is the same at any depth.
SMALL_HOST_CORES, SMALL_HOST_FULL_DEPTH, SMALL_HOST_LAYERS_PER_STAGE = 16, 4, 2


def default_layers(recipe) -> int:
    """The recipe's depth, or SMALL_HOST_LAYERS_PER_STAGE per pipeline stage for a deep recipe on a host of few
    cores."""
    full, stages = recipe.model.model_config.num_layers, recipe.parallel_config.pipeline_stage
    if (os.cpu_count() or 1) >= SMALL_HOST_CORES or full <= SMALL_HOST_FULL_DEPTH * stages:
        return full
    return SMALL_HOST_LAYERS_PER_STAGE * stages


def shallower(recipe, layers: int, recipe_path: str):
    """The recipe at `layers` layers, its layout otherwise as it is: pipeline stages split evenly, MoE recipes'
    dense layers those of the first `layers` (at least one MoE layer kept)."""
    from ascend_llm_recipes.training.recipe.loading import recipe_from_dict

    stages = recipe.parallel_config.pipeline_stage
    if layers < 1 or layers % stages:
        raise LaunchError(f"--layers {layers}: must be a positive multiple of parallel_config.pipeline_stage "
                          f"({stages})")
    data = recipe.to_dict()
    cfg = data["model"]["model_config"]
    cfg["num_layers"] = layers
    cfg["dense_layers"] = [i for i in cfg.get("dense_layers", []) if i < layers - 1]
    if data["parallel_config"].get("stage_layers"):
        data["parallel_config"]["stage_layers"] = [layers // stages] * stages
    try:
        return recipe_from_dict(data, f"{recipe_path} at {layers} layers", planning=True)
    except RecipeError as err:
        raise LaunchError(f"--layers {layers}: the recipe does not hold at that depth:\n{err}",
                          hint="choose another --layers (the pipeline stages must still divide it)") from None


def layout(recipe) -> str:
    p = recipe.parallel_config
    text = f"DP {p.data_parallel} x TP {p.model_parallel} x PP {p.pipeline_stage}"
    return text + (f", EP {p.expert_parallel}" if p.expert_parallel > 1 else "")


def compile_rank(recipe, recipe_path: str, stage: int, rank: int, planned_bytes: int, base_dir: str,
                 timeout: float = None, env: dict = None) -> Compiled:
    """Compile `rank` of `recipe` (already made by compile_recipe) in a new run directory under base_dir.

    env: extra variables for the worker (a simulated CANN's: training/tools/simulated_cann.py merged_environment).
    The worker runs in the run directory, where MindSpore also writes the collectives' execute order
    (rank_N/execute_order: training/tools/compiled.py collectives).
    """
    from ascend_llm_recipes.common.files import write_atomic

    os.makedirs(base_dir, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix=f"stage{stage}-rank{rank}-", dir=base_dir)
    write_atomic(os.path.join(run_dir, RESOLVED_RECIPE),
                 f"# resolved from {os.path.abspath(recipe_path)} for a DryRun compile\n" +
                 dataclasses.replace(recipe, output_dir=run_dir).to_yaml())
    env = {**os.environ, **(env or {}), "MS_SIMULATION_LEVEL": "1", "RANK_SIZE": str(recipe.world_size),
           "RANK_ID": str(rank), "LOCAL_DEFAULT_PATH": run_dir}
    log = os.path.join(run_dir, "worker.log")
    started, parent = time.time(), os.getpid()
    with open(log, "wb") as out:
        # killed with the launcher (kill -9 included): a compile left behind would hold a core for many minutes
        process = subprocess.Popen(worker_command(run_dir), env=env, stdout=out, cwd=run_dir,
                                   stderr=subprocess.STDOUT, preexec_fn=lambda: die_with_parent(parent))
        _RUNNING.add(process)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = -1
        finally:
            _RUNNING.discard(process)
    with open(log, encoding="utf-8", errors="replace") as f:
        peaks = [int(m) for m in _PEAK.findall(f.read())]
    return Compiled(stage=stage, rank=rank, seconds=time.time() - started, returncode=code, run_dir=run_dir, log=log,
                    simulated_peak_bytes=max(peaks) * 2**20 if peaks else None, planned_bytes=planned_bytes)


def worker_command(run_dir: str) -> list:
    return [sys.executable, WORKER, "--run-dir", run_dir]


def _stop_compiles() -> None:
    for process in list(_RUNNING):
        process.kill()


def _take_base(base: str):
    """Hold OUTPUT_DIR/dryrun for this dry run and remove the run directories earlier dry runs left there."""
    from ascend_llm_recipes.training.launcher.job import RunDirLock

    lock = RunDirLock(base, name=LOCK_NAME)
    lock.acquire()  # a second dry run of the same output_dir is refused, naming the first one's PID
    earlier = sorted(glob.glob(os.path.join(base, "stage*-rank*-*")))
    for path in earlier:
        shutil.rmtree(path, ignore_errors=True)
    return lock, len(earlier)


def failure_line(log: str) -> str:
    """The last line of the worker's log that says what went wrong."""
    with open(log, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    for line in reversed(lines):
        if re.search(r"(Error|error:|Exception|CRITICAL)", line) and "No module named 'te'" not in line \
                and "relies on whl package" not in line:
            return line[:300]
    # a log cut short (the worker killed, its disk full) names no error
    return (lines[-1][:300] if lines else "(empty log)") + " (no error line in the log: was it cut short?)"


def cann_missing() -> str:
    """Why no DryRun can start here ('' when a CANN-shaped tree is on the path)."""
    from ascend_llm_recipes.training.launcher.versions import cann_version

    version, where = cann_version(dict(os.environ))
    if version is not None:
        return ""
    return (f"MindSpore's DryRun loads its Ascend plugin, which needs CANN, and none is installed here ({where}); "
            "on a machine without CANN build a simulated one: python -m ascend_llm_recipes.training.tools.simulated_cann "
            "DIR, then eval \"$(python -m ascend_llm_recipes.training.tools.simulated_cann DIR --print-env)\"")


def _gib(n: Optional[int]) -> str:
    return "none printed" if n is None else byte_size(n)


def dry_run_compile(recipe, recipe_path: str, layers: int = None, timeout: float = None,
                    print_only: bool = False) -> int:
    """Compile one rank per pipeline stage and print a line for each; 0 when all compiled, 1 if one did not,
    2 when no CANN (real or simulated) is installed, 130 when interrupted (Ctrl-C: the compiles are stopped).

    print_only (DRY_RUN=1): print the compiles' commands, compile nothing.

    layers: compile the recipe's layout at this depth (a multiple of the pipeline stages); default_layers when None.
    """
    from ascend_llm_recipes.training.tools.planner import stage_memory

    if recipe.context.device_target != "Ascend":
        raise LaunchError(f"context.device_target {recipe.context.device_target}: --dry-run compiles an Ascend "
                          "recipe's graph under MindSpore's DryRun, which simulates Ascend devices only",
                          hint="use an Ascend recipe (recipes/tiny_ascend.yaml, ...); a CPU recipe trains as it is")
    compiled_recipe = compile_recipe(recipe)
    full = compiled_recipe.model.model_config.num_layers
    layers = default_layers(recipe) if layers is None else layers
    depth = f" at {layers} of its {full} layers (--layers {full} compiles all)" if layers != full else ""
    if layers != full:
        compiled_recipe = shallower(compiled_recipe, layers, recipe_path)
    planned = [s.total(compiled_recipe.recompute_config.mode) for s in stage_memory(compiled_recipe)]
    base = os.path.join(recipe.output_dir, DRYRUN_DIR)
    header = (f"dry-run: {os.path.basename(recipe_path)}{depth}: {layout(recipe)} on {recipe.world_size} ranks, one "
              f"rank per pipeline stage compiled under MS_SIMULATION_LEVEL=1")
    if print_only:
        print(f"{header}; DRY_RUN set: nothing compiled. Each compile runs, in a new directory under {base}:",
              flush=True)
        for stage, rank in roles(recipe):
            print(f"  stage {stage}, rank {rank}: MS_SIMULATION_LEVEL=1 RANK_SIZE={recipe.world_size} RANK_ID={rank} "
                  f"{shlex.join(worker_command(os.path.join(base, f'stage{stage}-rank{rank}-XXXX')))}", flush=True)
        return 0
    missing = cann_missing()
    if missing:
        print(f"dry-run: not run: {missing}", flush=True)
        return 2
    lock, removed = _take_base(base)
    print(f"{header}; run directories in {base}"
          + (f" ({removed} of an earlier dry run removed)" if removed else ""), flush=True)
    try:
        return _compile_roles(recipe, compiled_recipe, recipe_path, planned, base, timeout)
    except KeyboardInterrupt:
        _stop_compiles()
        print(f"dry-run: interrupted; the compiles were stopped (their logs are in {base})", flush=True)
        return 130
    finally:
        lock.release()


def _compile_roles(recipe, compiled_recipe, recipe_path: str, planned: list, base: str, timeout: float) -> int:
    with ThreadPoolExecutor(max_workers=min(len(roles(recipe)), PARALLEL_COMPILES, os.cpu_count() or 1)) as pool:
        jobs = [pool.submit(compile_rank, compiled_recipe, recipe_path, stage, rank, planned[stage], base, timeout)
                for stage, rank in roles(recipe)]
        try:
            compiled = [_report(recipe, job.result()) for job in as_completed(jobs)]
        except KeyboardInterrupt:
            _stop_compiles()  # before the pool's exit, which waits for them
            raise
    return 0 if all(compiled) else 1


def _report(recipe, result: Compiled) -> bool:
    """Print a compile's line; whether it compiled."""
    where = f"dry-run: stage {result.stage}, rank {result.rank} of {recipe.world_size} ({layout(recipe)})"
    if result.ok:
        print(f"{where}: compiled in {result.seconds:.1f} s; simulated peak "
              f"{_gib(result.simulated_peak_bytes)} (MindSpore's memory pool; no kernel workspaces under "
              f"simulation) vs planned {_gib(result.planned_bytes)}", flush=True)
    else:
        print(f"{where}: FAILED (exit {result.returncode}) after {result.seconds:.1f} s: "
              f"{failure_line(result.log)}{after_compile(result)}\n         log: {result.log}", flush=True)
    return result.ok


# MindSpore's warning before a host allocation of more than it thinks sane (core/include/ir/tensor_data.h).
_LARGE_HOST_ALLOC = re.compile(r"Try to alloca a large memory, size is:(\d+)")


def after_compile(result: Compiled) -> str:
    """What a failed rank got through: its parallel strategy file is written once the parallel pass is done, so
    a failure after it is the simulated step's (host memory, most often: the stubs hold every tensor on the host)."""
    if not glob.glob(os.path.join(result.run_dir, STRATEGY_DIR, "*.ckpt")):
        return ""
    with open(result.log, encoding="utf-8", errors="replace") as f:
        large = [int(m) for m in _LARGE_HOST_ALLOC.findall(f.read())]
    killed = (f"; killed (signal {-result.returncode}) after asking the host for {byte_size(max(large))} at once: "
              f"out of host memory, the simulated runtime keeps device tensors on the host"
              if result.returncode < 0 and large else "")
    return (f"\n         the graph got through MindSpore's parallel pass (strategy written: "
            f"{os.path.join(result.run_dir, STRATEGY_DIR)}); the simulated step failed{killed}")
