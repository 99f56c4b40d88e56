"""The Ascend acceptance kit: run every Ascend claim on an 8-device node and write one verdict.

`bash scripts/ascend_acceptance.sh [OUT]` runs the commands of plan_commands (through
scripts/run_distributed.sh and scripts/convert_checkpoint.py), then writes OUT/acceptance.json and
OUT/acceptance.md with PASS or FAIL per check and its figures. `DRY_RUN=1` prints every command instead.
Nothing here has executed on Ascend: this repository's machines have no NPU and no CANN.

Losses are compared as rank 0 logged them (metrics.jsonl): StepRecorder normalises them by the
micro-batches MindFormers' wrappers sum (training/worker/train_step.py summed_micro_batches) and, under
pipeline parallelism, takes them from the last stage. A loss of 0 or a non-finite one fails a comparison.
"""

import argparse
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time

from ascend_llm_recipes.common.errors import PretrainError
from ascend_llm_recipes.training.run_files import CHECKPOINTS, METRICS, METRICS_PATTERN, SUMMARY

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(REPO_ROOT, "scripts", "run_distributed.sh")
TINY = os.path.join(REPO_ROOT, "recipes", "tiny_ascend.yaml")
NODE_RECIPES = ("llama2_7b_8dev", "llama2_13b_8dev")        # start on one 8-device node
# compiled under DryRun (--check --dry-run): the multi-node recipes, dense, MoE and MLA
MULTI_NODE_RECIPES = ("llama2_70b_32dev", "dense_100b_64dev", "qwen3_30b_a3b_16dev", "mixtral_8x7b_64dev",
                      "deepseek_v3_256dev")
LAYOUTS = {  # all at the tiny recipe's global batch of 8 sequences
    "dp8": [],
    "dp2_tp2_pp2": ["parallel_config.data_parallel=2", "parallel_config.model_parallel=2",
                    "parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=4"],
    "dp2_tp4": ["parallel_config.data_parallel=2", "parallel_config.model_parallel=4",
                "runner_config.gradient_accumulation_steps=4"],
    "dp2_pp4": ["parallel_config.data_parallel=2", "parallel_config.pipeline_stage=4",
                "parallel_config.micro_batch_num=4"],
}
THROUGHPUT_RECIPE, THROUGHPUT_STEPS = "llama2_7b_8dev", 30
# Published Llama 2 7B figures, seq 4096, 8 x 910B: MindFormers (pretrain_llama2_7b.yaml: DP 8 x TP 1, fp16,
# FlashAttention, no recompute) and MindSpeed-LLM (4,672 tokens/s/device, "69% MFU" by its own FLOP count and
# peak; by models/shapes.py's 46.1 GFLOP/token and the planner's 376 TFLOP/s it is 57%).
MINDFORMERS_TOKENS_PER_S_PER_DEVICE = 4160
MINDSPEED_TOKENS_PER_S_PER_DEVICE, MINDSPEED_MFU = 4672, 0.69
# Verdict: PASS at >= 60% of MindFormers' figure (2,496 tokens/s/device). llama2_7b_8dev is DP 4 x TP 2 (its plan
# leaves no 10% headroom at MindFormers' DP 8 x TP 1), and `--plan` estimates it at 2,821 tokens/s/device (68% of
# MindFormers') at an assumed 40% MFU: a run that works as planned passes; one starved by a bad layout, host-bound
# data or unoverlapped collectives (below 60%) fails. The ratios to both published figures are reported either way.
THROUGHPUT_PASS_RATIO = 0.60
LAYOUT_RTOL = 1e-3          # float32 compute: layouts differ only in reduction order
BF16_STEPS, BF16_RTOL = 50, 0.03  # bf16 vs fp32: per-step loss within 3% over 50 steps
KILL_AT, RESUME_STEPS = 12, 20
# OUT/resume_points.json: per killed run, the newest complete checkpoint step when it was killed (the launcher
# resumes from it), against which the rerun's summary.json resumed_from_step is held.
RESUME_POINTS = "resume_points.json"
# Every compared run is deterministic: MindSpore is not by default (mindspore/device_manager.py:126), so two runs of
# one layout may sum in another order, and a resume is held to bit-equality (training/recipe/mindformers.py
# worker_config: how the key reaches ms.set_deterministic and HCCL_DETERMINISTIC).
DETERMINISTIC = "train_precision_sync=True"
# MindFormers' own 7B layout (pretrain_llama2_7b.yaml: DP 8, TP 1, PP 1, optimizer parallel) on the tiny model,
# at level3 with accumulation 8: a DP-only optimizer-parallel run, whose ranks save slices; threshold 0 so every
# tensor is sliced as a 7B's are (the tiny ones are below 64 KB). Our llama2_7b_8dev is DP 4 x TP 2 by its plan.
DP_OPT_LAYOUT = ["parallel.parallel_optimizer_config.optimizer_level=level3",
                 "parallel.parallel_optimizer_config.parallel_optimizer_threshold=0",
                 "runner_config.gradient_accumulation_steps=8"]
# FlashAttention and the fused RmsNorm against the math path: the tiny model in BF16 at seq 2048, head_dim 64
# (one head of 64). Per-step losses within 2%: BF16 keeps 8 mantissa bits (0.4% per value) and the kernels
# sum in another order than the math path, so the two runs drift apart slowly; a wrong mask, scale or eps
# is off by far more from the first step.
FUSED_SEQ, FUSED_STEPS, FUSED_RTOL = 2048, 20, 0.02
FUSED_DATA = f"datasets/pystdlib-sp512-s{FUSED_SEQ}-n60"
FUSED_MODEL = [f"model.model_config.seq_length={FUSED_SEQ}", "model.model_config.compute_dtype=bfloat16",
               "model.model_config.param_dtype=bfloat16",
               "model.model_config.num_heads=1", "model.model_config.num_kv_heads=1",
               f"data_preparation.output_dir={FUSED_DATA}", f"train_dataset.data_loader.dataset_dir={FUSED_DATA}",
               f"runner_config.stop_step={FUSED_STEPS}"]
FUSED_PATHS = {"fused": ["model.model_config.use_flash_attention=True", "model.model_config.fused_rms_norm=True"],
               "math": ["model.model_config.use_flash_attention=False", "model.model_config.fused_rms_norm=False"]}
# A checkpoint file holds its tensors plus protobuf framing (names, dims): at most 1% and 1 MiB more.
CHECKPOINT_SLACK, CHECKPOINT_SLACK_BYTES = 0.01, 1 << 20
COUNTER_ELEMENTS = 16  # tensors this small are counters and scalars (global_step, loss scale), always needed
PIPELINE_LAYOUT, PIPELINE_RTOL = "dp2_tp2_pp2", 1e-6
# Resume at another layout: DP2 x TP2 x PP2 for RELAYOUT_AT of 20 steps (the LR schedule sized for all 20),
# then the same run directory at each target through MindFormers' auto_trans_ckpt (training/tools/relayout.py).
RELAYOUT_FROM, RELAYOUT_TARGETS, RELAYOUT_AT = "dp2_tp2_pp2", ("dp8", "dp2_tp4"), 10
HF_EXPORT = "hf_dp2_tp2_pp2"  # --to-hf of the DP2 x TP2 x PP2 layout run (merged with its strategy files)
# Mixture of Experts: recipes/tiny_moe_ascend.yaml, whose MoE layers are MindFormers' MoELayer on Ascend
# (models/expert_parallel.py), at expert-parallel degrees 2 and 8, and TP 2 x EP 4 (micro-batch 2 x DP 4: EP 1's
# global batch of 8 in one pass, so the load-balancing loss sees the same tokens), against EP 1 (the same math,
# another dispatch: LAYOUT_RTOL), and at EP 1 against models/moe.py's CPU math on the node's CPUs, 8 data-parallel
# processes of the same global batch (MOE_CPU_RTOL: other kernels, and a token whose top-2 scores tie within
# rounding may pick another expert).
TINY_MOE = os.path.join(REPO_ROOT, "recipes", "tiny_moe_ascend.yaml")
MOE_LAYOUTS = {"moe_ep1": [], "moe_ep2": ["parallel_config.expert_parallel=2"],
               "moe_ep8": ["parallel_config.expert_parallel=8"],
               # tensor parallel: MindFormers' MoE layer sequence parallel inside our TP decoder
               "moe_tp2_ep4": ["parallel_config.data_parallel=4", "parallel_config.model_parallel=2",
                               "parallel_config.expert_parallel=4", "runner_config.batch_size=2"],
               # pipeline stages: the router loss of stage 0's MoE layers crosses to the last stage (models/llama.py)
               "moe_pp2_ep2": ["parallel_config.data_parallel=4", "parallel_config.pipeline_stage=2",
                               "parallel_config.micro_batch_num=2", "parallel_config.expert_parallel=2"]}
# The pipeline MoE layout in bf16 (16-bit weights with float32 masters under pipeline stages) against its float32 run
MOE_BF16 = ["model.model_config.compute_dtype=bfloat16", "model.model_config.param_dtype=bfloat16"]
# the node's CPUs: no Ascend compiler settings, data-parallel mode without optimizer parallel (Ascend-only there)
MOE_CPU = ["context.device_target=CPU", "context.ascend_config=null", "parallel.parallel_mode=0",
           "parallel.full_batch=False", "parallel.gradients_mean=True", "parallel.enable_parallel_optimizer=False"]
MOE_CPU_RTOL = 5e-3
# Multi-head latent attention: recipes/tiny_deepseek_ascend.yaml (models/mla.py under models/parallel.py's strategies,
# MindFormers' DeepSeek-V3 MoE layer at EP 8) against models/mla.py and models/moe.py on the node's CPUs (8
# data-parallel processes, EP 1), float32 math path (MOE_CPU_RTOL); and MLA on FlashAttention and the fused RmsNorm
# against its math path, bf16 at seq 2048 with 4 heads of 64 (FUSED_RTOL), as fused_kernels_vs_math for GQA.
TINY_DEEPSEEK = os.path.join(REPO_ROOT, "recipes", "tiny_deepseek_ascend.yaml")
MLA_CPU = [*MOE_CPU, "parallel_config.expert_parallel=1"]
MLA_FUSED_MODEL = [item for item in FUSED_MODEL if not item.startswith(("model.model_config.num_heads=",
                                                                        "model.model_config.num_kv_heads="))]


def launch_argv(recipe: str, out: str, *overrides) -> list:
    argv = ["bash", LAUNCHER, recipe, "--set", f"output_dir={out}"]
    for item in overrides:
        argv += ["--set", item]
    return argv


def compared_argv(recipe: str, out: str, *overrides) -> list:
    """The command of a run whose losses a check compares (comparisons): deterministic."""
    return launch_argv(recipe, out, DETERMINISTIC, *overrides)


def comparisons() -> list:
    """[(check, run, reference run, rtol)]: every loss comparison of the kit, two run directories under OUT each."""
    pairs = [(f"layout_{name}_vs_dp8", name, "dp8", LAYOUT_RTOL) for name in LAYOUTS if name != "dp8"]
    pairs += [("bf16_vs_fp32", f"bfloat16_{BF16_STEPS}", f"float32_{BF16_STEPS}", BF16_RTOL),
              ("kill_resume_tp_pp", "killed", PIPELINE_LAYOUT, 0.0),
              ("kill_resume_dp_opt", "killed_dp_opt", "dp8_opt", 0.0),
              ("fused_kernels_vs_math", f"fused_s{FUSED_SEQ}", f"math_s{FUSED_SEQ}", FUSED_RTOL)]
    pairs += [(f"resume_{target}_from_{RELAYOUT_FROM}", f"relayout_{target}", RELAYOUT_FROM, LAYOUT_RTOL)
              for target in RELAYOUT_TARGETS]
    pairs += [(f"{name}_vs_moe_ep1", name, "moe_ep1", LAYOUT_RTOL) for name in MOE_LAYOUTS if name != "moe_ep1"]
    pairs += [("moe_pp2_ep2_bf16_vs_fp32", "moe_pp2_ep2_bf16", "moe_pp2_ep2", BF16_RTOL)]
    return pairs + [("moe_ep1_vs_cpu_math", "moe_ep1", "moe_cpu", MOE_CPU_RTOL),
                    ("mla_ep8_vs_cpu_math", "mla_ep8", "mla_cpu", MOE_CPU_RTOL),
                    ("mla_fused_kernels_vs_math", f"mla_fused_s{FUSED_SEQ}", f"mla_math_s{FUSED_SEQ}", FUSED_RTOL)]


def plan_commands(out: str) -> list:
    """[(check, step, argv)] in the order they run."""
    steps = []
    for name in NODE_RECIPES:
        steps.append((f"startup_{name}", "train 3 steps",
                      launch_argv(os.path.join(REPO_ROOT, "recipes", f"{name}.yaml"), f"{out}/startup_{name}",
                                  "runner_config.stop_step=3")))
    for name in MULTI_NODE_RECIPES:
        steps.append((f"startup_{name}", "DryRun compile, one rank per stage",
                      ["bash", LAUNCHER, os.path.join(REPO_ROOT, "recipes", f"{name}.yaml"), "--check", "--dry-run"]))
    for layout, overrides in LAYOUTS.items():
        steps.append((f"layout_{layout}", "train 20 steps", compared_argv(TINY, f"{out}/{layout}", *overrides)))
    for dtype in ("float32", "bfloat16"):
        steps.append(("bf16_vs_fp32", f"train {BF16_STEPS} steps {dtype}",
                      compared_argv(TINY, f"{out}/{dtype}_{BF16_STEPS}", f"runner_config.stop_step={BF16_STEPS}",
                                  f"model.model_config.compute_dtype={dtype}",
                                  f"model.model_config.param_dtype={dtype}")))
    resume = [*LAYOUTS["dp2_tp2_pp2"], f"runner_config.stop_step={RESUME_STEPS}", "callbacks.1.save_checkpoint_steps=5"]
    steps.append(("kill_resume_tp_pp", f"train, kill -9 after step {KILL_AT}",
                  compared_argv(TINY, f"{out}/killed", *resume)))
    steps.append(("kill_resume_tp_pp", "rerun the same command (resumes)",
                  compared_argv(TINY, f"{out}/killed", *resume)))
    dp_opt = [*DP_OPT_LAYOUT, f"runner_config.stop_step={RESUME_STEPS}", "callbacks.1.save_checkpoint_steps=5"]
    steps.append(("kill_resume_dp_opt",
                  f"train the DP-only optimizer-parallel layout uninterrupted {RESUME_STEPS} steps",
                  compared_argv(TINY, f"{out}/dp8_opt", *dp_opt)))
    steps.append(("kill_resume_dp_opt", f"train the DP-only optimizer-parallel layout, kill -9 after step {KILL_AT}",
                  compared_argv(TINY, f"{out}/killed_dp_opt", *dp_opt)))
    steps.append(("kill_resume_dp_opt", "rerun the same command (resumes from the sliced checkpoint)",
                  compared_argv(TINY, f"{out}/killed_dp_opt", *dp_opt)))
    for path, overrides in FUSED_PATHS.items():
        steps.append(("fused_kernels_vs_math", f"train {FUSED_STEPS} steps bf16 seq {FUSED_SEQ} {path}",
                      compared_argv(TINY, f"{out}/{path}_s{FUSED_SEQ}", *FUSED_MODEL, *overrides)))
    schedule = [f"lr_schedule.total_steps={RESUME_STEPS}", f"callbacks.1.save_checkpoint_steps={RELAYOUT_AT}"]
    for target in RELAYOUT_TARGETS:
        check, run = f"resume_{target}_from_{RELAYOUT_FROM}", f"{out}/relayout_{target}"
        steps.append((check, f"train {RELAYOUT_FROM} {RELAYOUT_AT} of {RESUME_STEPS} steps",
                      compared_argv(TINY, run, *LAYOUTS[RELAYOUT_FROM], *schedule,
                                  f"runner_config.stop_step={RELAYOUT_AT}")))
        steps.append((check, f"resume at {target} (auto_trans_ckpt, --amend)",
                      compared_argv(TINY, run, *LAYOUTS[target], *schedule, f"runner_config.stop_step={RESUME_STEPS}",
                                    "auto_trans_ckpt=True") + ["--amend"]))
    for layout, overrides in MOE_LAYOUTS.items():
        steps.append((layout, "train 20 steps, MindFormers' MoELayer", compared_argv(TINY_MOE, f"{out}/{layout}",
                                                                                    *overrides)))
    steps.append(("moe_pp2_ep2_bf16_vs_fp32", "train 20 steps bf16, MindFormers' MoELayer under pipeline stages",
                  compared_argv(TINY_MOE, f"{out}/moe_pp2_ep2_bf16", *MOE_LAYOUTS["moe_pp2_ep2"], *MOE_BF16)))
    steps.append(("moe_cpu_math", "train 20 steps on the node's CPUs, models/moe.py",
                  compared_argv(TINY_MOE, f"{out}/moe_cpu", *MOE_CPU)))
    steps.append(("mla_ep8", "train 20 steps, models/mla.py with MindFormers' DeepSeek-V3 MoELayer",
                  compared_argv(TINY_DEEPSEEK, f"{out}/mla_ep8")))
    steps.append(("mla_cpu_math", "train 20 steps on the node's CPUs, models/mla.py and models/moe.py",
                  compared_argv(TINY_DEEPSEEK, f"{out}/mla_cpu", *MLA_CPU)))
    for path, overrides in FUSED_PATHS.items():
        steps.append(("mla_fused_kernels_vs_math", f"train {FUSED_STEPS} steps bf16 seq {FUSED_SEQ} MLA {path}",
                      compared_argv(TINY_DEEPSEEK, f"{out}/mla_{path}_s{FUSED_SEQ}", *MLA_FUSED_MODEL,
                                    *overrides)))
    steps.append(("to_hf_tp_pp", "--to-hf of the dp2_tp2_pp2 run",
                  [sys.executable, os.path.join(REPO_ROOT, "scripts", "convert_checkpoint.py"), "--to-hf",
                   f"{out}/{RELAYOUT_FROM}", "--output", f"{out}/{HF_EXPORT}", "--quiet"]))
    steps.append((f"throughput_{THROUGHPUT_RECIPE}", f"train {THROUGHPUT_STEPS} steps",
                  launch_argv(os.path.join(REPO_ROOT, "recipes", f"{THROUGHPUT_RECIPE}.yaml"),
                              f"{out}/throughput_{THROUGHPUT_RECIPE}", f"runner_config.stop_step={THROUGHPUT_STEPS}")))
    for name in NODE_RECIPES:
        steps.append((f"memory_{name}", "--plan",
                      ["bash", LAUNCHER, os.path.join(REPO_ROOT, "recipes", f"{name}.yaml"), "--plan"]))
    return steps


def read_records(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def one_line(text: str, limit: int = 300) -> str:
    """An error as one table cell of acceptance.md: no line breaks (a hint follows on its own line)."""
    return " ".join(text.split())[:limit]


def derived_checks() -> list:
    """[(check, what it reads)] for the checks that run nothing of their own: they read other checks' run dirs."""
    sized = ("dp8_opt", PIPELINE_LAYOUT, *(f"startup_{n}" for n in NODE_RECIPES))
    return ([(f"checkpoint_size_{n}", f"rank 0's newest checkpoint in {n}/ against the bytes resume needs")
             for n in sized]
            + [("pipeline_logged_loss", f"rank 0's logged loss in {PIPELINE_LAYOUT}/ against its last stage's ranks'")])


def logged_losses(run_dir: str) -> dict:
    """step -> the loss rank 0 logged (every rank logs the one the ranks agreed, StepRecorder), zeros included."""
    path = os.path.join(run_dir, METRICS)
    records = read_records(path) if os.path.isfile(path) else []
    return {r["step"]: r["loss"] for r in sorted(records, key=lambda r: r["step"]) if "val_loss" not in r}


def unusable_losses(losses: dict) -> list:
    """Steps whose logged loss is 0 or not finite: a run logging 0 took its loss from a rank that computes none."""
    return [step for step, loss in losses.items() if loss is None or not math.isfinite(loss) or loss == 0.0]


def compare(a: dict, b: dict, rtol: float) -> dict:
    """PASS when both have the same steps, every loss is finite and non-zero, and they agree within rtol (of b)."""
    worst = max((abs(a[s] - b[s]) / max(abs(b[s]), 1e-12) for s in b if s in a
                 if not unusable_losses({s: a[s]}) and not unusable_losses({s: b[s]})), default=None)
    bad = sorted(set(unusable_losses(a)) | set(unusable_losses(b)))
    passed = bool(a) and a.keys() == b.keys() and worst is not None and worst <= rtol and not bad
    result = {"status": "PASS" if passed else "FAIL", "steps": [len(a), len(b)], "max_relative_difference": worst,
              "tolerance": rtol}
    if bad:
        result["zero_or_non_finite_loss_steps"] = bad[:10]
    return result


def pipeline_loss_result(run_dir: str) -> dict:
    """Rank 0's logged loss of a (pipeline) run is non-zero, finite and the last stage's (their own rank_loss)."""
    from ascend_llm_recipes.training.worker.callbacks import last_stage_ranks
    from ascend_llm_recipes.training.launcher.resume import saved_recipe
    from ascend_llm_recipes.training.run_files import metrics_file

    logged = logged_losses(run_dir)
    try:
        ranks = list(last_stage_ranks(saved_recipe(run_dir)))
        own = [{r["step"]: r.get("rank_loss", r["loss"]) for r in read_records(os.path.join(run_dir, metrics_file(k)))
                if "val_loss" not in r} for k in ranks]
    except (OSError, ValueError, PretrainError) as err:
        return {"status": "FAIL", "error": one_line(f"{type(err).__name__}: {err}")}
    last = {step: sum(o[step] for o in own) / len(own) for step in logged if all(step in o for o in own)}
    worst = max((abs(logged[s] - last[s]) / max(abs(last[s]), 1e-12) for s in last), default=None)
    bad = unusable_losses(logged)
    passed = bool(logged) and last.keys() == logged.keys() and not bad and worst is not None and worst <= PIPELINE_RTOL
    return {"status": "PASS" if passed else "FAIL", "steps": len(logged), "last_stage_ranks": ranks,
            "zero_or_non_finite_loss_steps": bad[:10], "max_relative_difference_to_last_stage": worst,
            "tolerance": PIPELINE_RTOL}


def checkpoint_size_result(run_dir: str) -> dict:
    """Rank 0's newest checkpoint file against the bytes resume needs: the model's parameters, their float32 masters
    (16-bit weights, training/worker/optim.py) and AdamW moments at the shapes the rank holds (checkpoint.rank_shapes),
    in the dtypes saved, plus counters; anything else it holds (e.g. MindFormers' accu_grads) is listed by name prefix
    with its bytes."""
    from ascend_llm_recipes.training.checkpoint import (MANIFEST, itemsize, model_shapes, rank_shapes, read_json,
                                                        shape_problems, step_entries)
    from ascend_llm_recipes.training.worker.optim import MASTER_PREFIX
    from ascend_llm_recipes.training.launcher.resume import saved_recipe

    try:
        recipe = saved_recipe(run_dir)
        newest = step_entries(run_dir)[0]
        manifest = read_json(os.path.join(run_dir, CHECKPOINTS, newest, "rank_0", MANIFEST))
    except (OSError, ValueError, IndexError, PretrainError) as err:
        return {"status": "FAIL",
                "error": one_line(f"no checkpoint to measure in {run_dir} ({type(err).__name__}: {err})")}
    shapes = rank_shapes(recipe)
    tensors = manifest["tensors"]
    model = model_shapes(recipe)  # a MoE run on Ascend saves MindFormers' stacked experts
    needed, others = 0, {}
    for name, info in tensors.items():
        elements = math.prod(info["shape"])
        size = itemsize(info["dtype"]) * elements
        base = name.split(".", 1)[1] if name.startswith(("adam_m.", "adam_v.", f"{MASTER_PREFIX}.")) else name
        if base in model or elements <= COUNTER_ELEMENTS:
            needed += size  # parameters, their moments, counters (global_step, loss scale, epoch and step)
        else:
            prefix = name.split(".", 1)[0]
            others[prefix] = others.get(prefix, 0) + size
    problems = shape_problems(newest, tensors, shapes) if shapes is not None else []
    foreign = other_stage_tensors(recipe, tensors)
    limit = needed * (1 + CHECKPOINT_SLACK) + CHECKPOINT_SLACK_BYTES
    passed = manifest["bytes"] <= limit and not others and not problems and not foreign
    return {"status": "PASS" if passed else "FAIL", "step": newest, "file_bytes": manifest["bytes"],
            "needed_bytes": needed, "not_needed_bytes_by_prefix": others, "shape_problems": problems[:5],
            "rank_shapes_checked": shapes is not None, "other_stage_tensors": foreign[:5]}


def other_stage_tensors(recipe, names) -> list:
    """The tensors among rank 0's (pipeline stage 0: the embedding and the first layers, models/parallel.py
    stage_of_layer) that belong to a later stage: MindSpore never builds those in rank 0's graph, and a save that
    wrote them would hold them whole (training/checkpoint.py held_here)."""
    import re
    from ascend_llm_recipes.training.recipe.mindformers import model_layout

    layout = model_layout(recipe)
    if layout.pipeline_stages == 1:
        return []
    first = {i for i, stage in enumerate(layout.stage_of_layer) if stage == 0}
    foreign = []
    for name in names:
        layer = re.search(r"model\.layers\.(\d+)\.", name)
        last_stage = re.search(r"(^|\.)(lm_head|model\.norm)\.", name) is not None  # the final norm and lm_head
        if int(layer.group(1)) not in first if layer else last_stage:
            foreign.append(name)
    return sorted(foreign)


def resumed_runs(out: str) -> dict:
    """{check: (run, the step its rerun must resume from)}: the killed runs' newest checkpoint at the kill
    (RESUME_POINTS, recorded by main), the relayout runs' RELAYOUT_AT."""
    points = resume_points(out)
    runs = {"kill_resume_tp_pp": "killed", "kill_resume_dp_opt": "killed_dp_opt"}
    resumes = {check: (run, points.get(run)) for check, run in runs.items()}
    return {**resumes, **{f"resume_{t}_from_{RELAYOUT_FROM}": (f"relayout_{t}", RELAYOUT_AT) for t in RELAYOUT_TARGETS}}


def record_resume_point(out: str, run_dir: str) -> None:
    """After a kill: the newest complete checkpoint of `run_dir`, the step the launcher will resume it from."""
    from ascend_llm_recipes.training.checkpoint import complete_steps
    from ascend_llm_recipes.common.files import write_atomic

    points, steps = resume_points(out), complete_steps(run_dir)
    points[os.path.basename(run_dir)] = steps[-1] if steps else None
    write_atomic(os.path.join(out, RESUME_POINTS), json.dumps(points, indent=1))


def resume_points(out: str) -> dict:
    try:
        with open(os.path.join(out, RESUME_POINTS), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def resumed_result(run_dir: str, step) -> dict:
    """The rerun resumed from `step` (its summary.json resumed_from_step, training/worker/train.py): equal losses
    alone would pass a silent restart from step 0 that happens to reproduce them."""
    try:
        with open(os.path.join(run_dir, SUMMARY), encoding="utf-8") as f:
            resumed = json.load(f)["resumed_from_step"]
    except (OSError, ValueError, KeyError, TypeError):
        resumed = None
    result = {"resumed_from_step": resumed, "expected_resumed_from_step": step}
    if not step or resumed != step:
        result["status"] = "FAIL"
    return result


def relayout_result(result: dict, run_dir: str, code) -> dict:
    """A resume at another layout (`result`: its losses against the reference's): MindFormers re-sliced the
    checkpoint, and the strategy it was saved with was kept."""
    from ascend_llm_recipes.training.tools.relayout import LAYOUT_FILE

    kept = glob.glob(os.path.join(run_dir, CHECKPOINTS, "step_*", LAYOUT_FILE))
    transformed = glob.glob(os.path.join(run_dir, "transformed_checkpoint", "step_*", "rank_*", "*.ckpt"))
    result.update(exit_code=code, strategy_kept=len(kept), transformed_files=len(transformed))
    if code != 0 or not kept or not transformed:
        result["status"] = "FAIL"
    return result


def hf_export_result(hf_dir: str, code=0, tokens: int = 32) -> dict:
    """The --to-hf export loads in transformers, and its logits match our model loaded from the checkpoint the
    conversion read (conversion.json names it; for a TP/PP run, the shards merged with the strategy files)."""
    import mindspore as ms
    import numpy as np
    from ascend_llm_recipes.models.conversion.verify import KL_TOLERANCE, compare_logits, reference_logits
    from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
    from ascend_llm_recipes.training.tools.export import read_model_section
    from ascend_llm_recipes.training.run_files import MERGED_DIR

    try:
        with open(os.path.join(hf_dir, "conversion.json"), encoding="utf-8") as f:
            source = json.load(f)["source"]
    except (OSError, ValueError, KeyError) as err:
        return {"status": "FAIL", "exit_code": code, "error": f"{type(err).__name__}: {err}"}
    cfg, tensor_parallel = read_model_section(source["model_section"])
    if ms.get_context("device_target") != "CPU":  # compared with transformers on the host
        ms.set_device("CPU")
    # The run's tables are padded to a multiple of vocab_pad_multiple x TP (models/arithmetic.py padded_vocab_size).
    options = {k: v for k, v in vars(cfg).items() if k != "type"}
    options["vocab_pad_multiple"] = cfg.vocab_pad_multiple * tensor_parallel
    net = LlamaForCausalLM(LlamaConfig(**options))
    try:
        weights = ms.load_checkpoint(source["path"], choice_func=lambda name: name.startswith(("model.", "lm_head.")))
        not_loaded, _ = ms.load_param_into_net(net, weights)
    except (OSError, ValueError, RuntimeError) as err:  # a missing file, a shape that does not fit
        return {"status": "FAIL", "exit_code": code, "checkpoint": source["path"], "error": f"{err}"[:500]}
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, min(tokens, cfg.seq_length)))
    ours = net.logits(ms.Tensor(ids.astype(np.int32))).asnumpy().astype(np.float64)
    try:
        theirs = reference_logits(hf_dir, ids)
    except (OSError, ValueError) as err:  # the export does not load in transformers
        return {"status": "FAIL", "exit_code": code, "error": f"{type(err).__name__}: {err}"}
    figures = compare_logits(theirs, ours)
    merged = f"{os.sep}{MERGED_DIR}{os.sep}" in source["path"]
    passed = (code == 0 and not not_loaded and figures["max_abs_delta"] <= figures["max_abs_tolerance"]
              and figures["kl"] <= KL_TOLERANCE)
    return {"status": "PASS" if passed else "FAIL", "exit_code": code, "checkpoint": source["path"],
            "merged_from_shards": merged, "not_loaded": not_loaded, **figures, "kl_tolerance": KL_TOLERANCE}


def peak_device_memory(run_dir: str):
    values = [json.loads(line).get("device_memory") for path in glob.glob(os.path.join(run_dir, METRICS_PATTERN))
              for line in open(path, encoding="utf-8")]
    values = [v for v in values if v]
    return max(values) if values else None


def throughput(run_dir: str) -> dict:
    """Median tokens/s/device and MFU after the compiling step (rank 0's records), their ratio to the published
    figures (MindFormers, MindSpeed-LLM), and the compile time (the first step).

    PASS at THROUGHPUT_PASS_RATIO (60%) of MindFormers' figure or more."""
    records = [json.loads(line) for path in sorted(glob.glob(os.path.join(run_dir, METRICS_PATTERN)))[:1]
               for line in open(path, encoding="utf-8")]
    records = [r for r in records if "tokens_per_s_per_device" in r]
    steady = sorted(r["tokens_per_s_per_device"] for r in records if not r.get("compile"))
    mfus = sorted(r["mfu"] for r in records if not r.get("compile") and r.get("mfu") is not None)
    compiling = [r["step_time"] for r in records if r.get("compile")]
    median = steady[len(steady) // 2] if steady else None
    ratio = None if median is None else round(median / MINDFORMERS_TOKENS_PER_S_PER_DEVICE, 4)
    return {"status": "PASS" if ratio is not None and ratio >= THROUGHPUT_PASS_RATIO else "FAIL",
            "tokens_per_s_per_device": median,
            "mfu": mfus[len(mfus) // 2] if mfus else None,
            "ratio_to_mindformers": ratio,
            "ratio_to_mindspeed_llm": None if median is None else round(median / MINDSPEED_TOKENS_PER_S_PER_DEVICE, 4),
            "mindformers_tokens_per_s_per_device": MINDFORMERS_TOKENS_PER_S_PER_DEVICE,
            "mindspeed_llm_tokens_per_s_per_device": MINDSPEED_TOKENS_PER_S_PER_DEVICE,
            "mindspeed_llm_mfu": MINDSPEED_MFU, "pass_at_ratio_to_mindformers": THROUGHPUT_PASS_RATIO,
            "steps_measured": len(steady), "compile_s": compiling[0] if compiling else None}


def evaluate(out: str, returncodes: dict) -> dict:
    """Every check's verdict and figures from the run directories under `out`."""
    from ascend_llm_recipes.training.tools.planner import GB, plan
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    results = {}
    for name in NODE_RECIPES + MULTI_NODE_RECIPES:
        code = returncodes.get(f"startup_{name}")
        results[f"startup_{name}"] = {"status": "PASS" if code == 0 else "FAIL", "exit_code": code}
    for check, run, reference, rtol in comparisons():
        results[check] = compare(logged_losses(os.path.join(out, run)), logged_losses(os.path.join(out, reference)),
                                 rtol)
    for check, (run, step) in resumed_runs(out).items():
        results[check].update(resumed_result(os.path.join(out, run), step))
    results["kill_resume_dp_opt"]["exit_code"] = returncodes.get("kill_resume_dp_opt")
    if returncodes.get("kill_resume_dp_opt") not in (0, None):
        results["kill_resume_dp_opt"]["status"] = "FAIL"
    for target in RELAYOUT_TARGETS:
        check = f"resume_{target}_from_{RELAYOUT_FROM}"
        relayout_result(results[check], os.path.join(out, f"relayout_{target}"), returncodes.get(check))
    for check, _ in derived_checks()[:-1]:
        results[check] = checkpoint_size_result(os.path.join(out, check[len("checkpoint_size_"):]))
    results["pipeline_logged_loss"] = pipeline_loss_result(os.path.join(out, PIPELINE_LAYOUT))
    export = hf_export_result(os.path.join(out, HF_EXPORT), returncodes.get("to_hf_tp_pp"))
    if not export.get("merged_from_shards"):
        export["status"] = "FAIL"  # a TP/PP run must have been merged with its strategy files
    results["to_hf_tp_pp"] = export
    results[f"throughput_{THROUGHPUT_RECIPE}"] = throughput(os.path.join(out, f"throughput_{THROUGHPUT_RECIPE}"))
    for name in NODE_RECIPES:
        planned = plan(load_recipe(os.path.join(REPO_ROOT, "recipes", f"{name}.yaml"), planning=True)).total_bytes
        measured = peak_device_memory(os.path.join(out, f"startup_{name}"))
        # MindSpore reports one figure per device, the peak it allocated (ms.runtime.max_memory_allocated,
        # training/worker/metrics.py); the plan's terms are printed by --plan beside it.
        results[f"memory_{name}"] = {"status": "PASS" if measured is not None and measured <= planned else "FAIL",
                                     "planned_gb": round(planned / GB, 2),
                                     "measured_peak_gb": None if measured is None else round(measured / GB, 2),
                                     "measured_to_planned": None if measured is None else round(measured / planned, 3)}
    return results


def write_report(out: str, results: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "acceptance.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    lines = ["# Ascend acceptance", "", "| check | verdict | figures |", "| --- | --- | --- |"]
    for name, result in results.items():
        figures = ", ".join(f"{k}: {v}" for k, v in result.items() if k != "status")
        lines.append(f"| {name} | {result['status']} | {figures} |")
    with open(os.path.join(out, "acceptance.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def output_dir_of(argv: list) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith("output_dir="))


def run_until_step(argv: list, run_dir: str, step: int) -> int:
    """Start `argv`, and kill -9 its whole process group once rank 0 logged `step`."""
    proc = subprocess.Popen(argv, start_new_session=True)
    metrics = os.path.join(run_dir, METRICS)
    while proc.poll() is None:
        if os.path.exists(metrics) and len(open(metrics, encoding="utf-8").readlines()) >= step:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
        time.sleep(1)
    return proc.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/ascend_acceptance.sh",
        description="Run every Ascend claim on an 8-device node and write OUT/acceptance.json and acceptance.md "
                    "(PASS or FAIL per check). DRY_RUN=1 (or --dry-run) prints every command and runs nothing.")
    parser.add_argument("out", nargs="?", default=os.path.join(REPO_ROOT, "runs", "ascend_acceptance"),
                        help="output directory (default: runs/ascend_acceptance)")
    parser.add_argument("--dry-run", action="store_true", help="print every command, run nothing")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    out = os.path.abspath(args.out)
    steps = plan_commands(out)
    missing = "" if args.dry_run else ascend_missing()
    if missing:
        # every command would start real device work: refuse before the first, not after an hour of failures
        print(f"acceptance: {missing}; run it on an 8-device Ascend node, or DRY_RUN=1 to list the commands",
              file=sys.stderr)
        return 2
    if args.dry_run:
        for check, step, command in steps:
            print(f"[{check}] {step}: {' '.join(command)}")
        for check, what in derived_checks():
            print(f"[{check}] reads {what}")
        print(f"[report] {os.path.join(out, 'acceptance.json')} and acceptance.md")
        return 0
    returncodes = {}
    for check, step, command in steps:
        print(f"[acceptance] {check}: {step}", flush=True)
        if "kill -9 after step" in step:
            run_until_step(command, output_dir_of(command), KILL_AT)
            record_resume_point(out, output_dir_of(command))
            continue
        code = subprocess.run(command).returncode
        returncodes[check] = code if returncodes.get(check) in (None, 0) else returncodes[check]
    results = evaluate(out, returncodes)
    write_report(out, results)
    failed = [name for name, r in results.items() if r["status"] == "FAIL"]
    print(f"[acceptance] {len(results) - len(failed)} of {len(results)} checks not failed; report: "
          f"{os.path.join(out, 'acceptance.md')}", flush=True)
    return 1 if failed else 0


def ascend_missing() -> str:
    """Why this machine cannot run device work (no CANN toolkit, no npu-smi), or '' when it can."""
    import shutil
    from ascend_llm_recipes.training.launcher.versions import cann_version

    version, where = cann_version(dict(os.environ))
    if version is None:
        return f"needs an Ascend node: {where}"
    if shutil.which("npu-smi") is None:
        return "needs an Ascend node: npu-smi not found (no driver)"
    return ""


if __name__ == "__main__":
    sys.exit(main())
