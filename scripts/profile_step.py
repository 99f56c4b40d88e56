"""Where one training step's time goes, per operator class: ours (MindSpore graph mode) next to PyTorch eager.

    python scripts/profile_step.py [--shape reference] [--steps 3] [--warmup 2] [--out DIR]
    python scripts/profile_step.py --compare OLD.json [NEW.json]

Builds the trainers of scripts/benchmark_training.py at one of its shapes (ours: LlamaForCausalLM
through the wrapper MindFormers' Trainer builds, graph mode; the peer: transformers'
LlamaForCausalLM, float32, eager, torch.optim.AdamW, same hyper-parameters and batches), runs
--warmup steps, then profiles --steps steps of each, alternating them under both profilers at
once (mindspore.Profiler records MindSpore's kernels, torch.profiler aten operators). It prints,
per step, the time of each operator class split into forward / backward / update, with its share
of the step; the measured step wall time, the sum of operator time and the host time between
operators (wall minus operator time); and each side's 15 most expensive operators. The table is
of each side's fastest step: other work on a shared machine only ever stretches a step (PyTorch's
OpenMP loops most: 1.4 to 7.8 s at the reference shape in one run), as in benchmark_training's "best".
The same, with the means over the steps, goes to DIR/profile_<shape>.json; `--compare OLD.json`
prints an earlier run next to this one (or next to NEW.json, without profiling).

Classes come from the profilers' own names only (MindSpore: op type and cell scope, e.g.
`Gradients/Default/network-LlamaForCausalLM/lm_head-Linear/Grad_MatMul/MatMul-op22`; PyTorch:
the aten op and the module that ran it), through the two rule tables below. An operator no rule
matches is counted as "other" and listed by name. Operators that MindSpore's graph passes generate
(`Expand/...`) carry no cell scope and are classified by the kernel launched before them; their time
is printed, as it is the part of the split that is approximate.
"""

import argparse
import csv
import glob
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import benchmark_training as bench  # scripts/ is on sys.path when a script in it runs
import torch_peer

GEMM = "GEMM"
LOSS = "loss"
ATTENTION = "attention softmax/mask"
NORM = "norms"
ROTARY = "rotary"
ACTIVATION = "activation/SwiGLU"
LAYOUT = "casts/reshapes/transposes/copies"
OPTIMIZER = "optimizer"
CLIP = "clip/overflow/loss scale"
EMBEDDING = "embedding"
OTHER = "other"
CLASSES = (GEMM, LOSS, ATTENTION, NORM, ROTARY, ACTIVATION, LAYOUT, OPTIMIZER, CLIP, EMBEDDING, OTHER)
PHASES = ("forward", "backward", "update")  # update: optimizer, clipping, loss scale (outside the network)
TOP = 15
STEP_LABEL = "profiled step #"  # PyTorch: the label around each profiled step
UNCLASSIFIED_SHOWN = 20

LAYOUT_OPS = {"Cast", "Reshape", "Transpose", "TensorMove", "ExpandDims", "Squeeze", "Flatten", "Identity",
              "Contiguous", "Copy", "BroadcastTo"}
# MindSpore: (class, op types or None, pattern searched in the full op name or None); the first row matching wins.
# Scopes are the cells' attribute names as the profiler prints them (`<attribute>-<CellClass>`).
MINDSPORE_RULES = (
    (GEMM, {"MatMul", "BatchMatMul", "MatMulExt", "BatchMatMulExt", "Dense"}, None),
    (ROTARY, None, r"/rotary-"),
    (LAYOUT, LAYOUT_OPS, None),
    (LOSS, {"SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits", "CrossEntropy"}, None),
    (LOSS, None, r"/loss-|/fused_loss-"),
    (ATTENTION, {"FlashAttentionScore", "FlashAttentionScoreGrad", "Softmax", "SoftmaxGrad"}, None),
    (ATTENTION, None, r"/core-|Mask-|/self_attn-"),
    (CLIP, None, r"/clip_grad_norm-|IsFinite"),
    (NORM, None, r"RMSNorm|LayerNorm|/norm-"),
    (ACTIVATION, None, r"/mlp-"),
    (EMBEDDING, None, r"/embed_tokens-"),
    (OPTIMIZER, None, r"/optimizer-|AdamWeightDecay|/learning_rate-"),
    # Ops directly in the wrapper's scope: the input slice, then the loss-scale division, the square sums
    # and the overflow flag of MFTrainOneStepCell (training/worker/train_step.py).
    (LAYOUT, {"StridedSlice", "Slice"}, r"^Default/(network-[^/]+/)?[A-Za-z]+-op\d+$"),
    (CLIP, None, r"^Default/[A-Za-z]+-op\d+$"),
)
# Ops that graph passes generate (`Expand/_SumExt/ReduceSum-op3`: SumExt expanded into ReduceSum) lose their
# cell scope. The SiLU expansions name themselves (class, phase, pattern); any other takes the class and phase
# of the kernel launched just before it (MindSpore runs the graph's kernels one after another on CPU, but
# interleaves independent branches: an approximation, so its total is reported as "inherited").
MINDSPORE_EXPANDED = r"^Expand/"
MINDSPORE_EXPANDED_RULES = ((ACTIVATION, "forward", r"^Expand/_SiLU/"), (ACTIVATION, "backward", r"^Expand/_SiLUGrad/"),
                            (ATTENTION, "backward", r"^Expand/_SoftmaxBackward/"))

# PyTorch: (class, pattern on the op name or None, pattern on the scope or None). The scope is the phase and
# the module that ran the op ("forward/model.layers.0.mlp"); a backward op gets the scope of the forward op
# that recorded its autograd node, so "backward/model.layers.0.self_attn" is the attention's gradient. The
# step's own sections (loss, clip_grad_norm, optimizer) are labelled by torch_peer.TorchTrainer.
TORCH_RULES = (
    (GEMM, r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|addmv)$|(^|: )(Mm|Addmm|Bmm|Baddbmm)Backward", None),
    (ATTENTION, r"scaled_dot_product|flash_attention|softmax", r"self_attn"),
    (LAYOUT, r"^aten::(view|reshape|_reshape_alias|transpose|t|permute|contiguous|clone|copy_|_to_copy|to|"
             r"expand|_unsafe_view|as_strided|unsqueeze|squeeze|flatten|empty|empty_like|empty_strided|"
             r"detach|detach_|alias|unflatten)$|^detach$|AccumulateGrad|"
             r"(^|: )(View|UnsafeView|T|Transpose|Permute|Alias|Expand|Reshape|Clone|ToCopy|Unsqueeze|Squeeze)"
             r"(Alias)?Backward", None),
    (ROTARY, None, r"rotary_emb|self_attn$"),  # apply_rotary_pos_emb is the only other math in the attention
    (LOSS, None, r"/loss$"),
    (NORM, None, r"layernorm$|\.norm$"),
    (ACTIVATION, None, r"\.mlp(\.act_fn)?$"),  # not the gradient sums of gate/up_proj (MindSpore: AddN, other)
    (EMBEDDING, None, r"embed_tokens$"),
    (OPTIMIZER, None, r"/optimizer$"),
    (CLIP, None, r"/clip_grad_norm$"),
)


def classify(rules, name: str, kind: str) -> str:
    """The class of the first rule whose kind set (MindSpore op types) and name pattern both match."""
    for cls, kinds, pattern in rules:
        if kinds is not None and kind not in kinds:
            continue
        if pattern is not None and not re.search(pattern, name):
            continue
        return cls
    return OTHER


def torch_classify(op: str, scope: str) -> str:
    for cls, op_pattern, scope_pattern in TORCH_RULES:
        if op_pattern is not None and not re.search(op_pattern, op):
            continue
        if scope_pattern is not None and not re.search(scope_pattern, scope):
            continue
        return cls
    return OTHER


def mindspore_phase(name: str) -> str:
    if name.startswith("Gradients/"):
        return "backward"
    return "forward" if "/network-" in name else "update"


class OpTable:
    """Operator time by class and phase for each profiled step, plus per-operator totals (top list, "other")."""

    def __init__(self, steps: int):
        self.steps = steps
        self.by_step = [{cls: dict.fromkeys(PHASES, 0.0) for cls in CLASSES} for _ in range(steps)]
        self.by_op = defaultdict(float)  # (name, class, phase) -> seconds over all steps
        self.inherited = 0.0  # seconds per step classified by the preceding kernel (MINDSPORE_EXPANDED)

    def add(self, name: str, cls: str, phase: str, seconds: float, step: int) -> None:
        self.by_step[step][cls][phase] += seconds
        self.by_op[(name, cls, phase)] += seconds

    def classes(self, step: int = None) -> dict:
        """Seconds by class and phase in one step, or per step averaged over all (step None)."""
        if step is not None:
            return self.by_step[step]
        return {cls: {p: sum(s[cls][p] for s in self.by_step) / self.steps for p in PHASES} for cls in CLASSES}

    def top(self, count: int = TOP) -> list:
        ranked = sorted(self.by_op.items(), key=lambda item: -item[1])[:count]
        return [{"name": n, "class": c, "phase": p, "s_per_step": s / self.steps} for (n, c, p), s in ranked]

    def families(self) -> list:
        """Time per step of each operator kind (layers merged), with its class and phase, largest first."""
        merged = defaultdict(float)
        for (name, cls, phase), seconds in self.by_op.items():
            merged[(op_family(name), cls, phase)] += seconds / self.steps
        return [{"name": n, "class": c, "phase": p, "s_per_step": s}
                for (n, c, p), s in sorted(merged.items(), key=lambda item: -item[1])]

    def unclassified(self) -> list:
        ops = [(n, p, s) for (n, c, p), s in self.by_op.items() if c == OTHER]
        return [{"name": n, "phase": p, "s_per_step": s / self.steps} for n, p, s in sorted(ops, key=lambda o: -o[2])]


def profiler_files(out_dir: str) -> tuple:
    """The newest MindSpore profile under out_dir: (op detail CSV, per-launch timestamp file)."""
    found = sorted(glob.glob(os.path.join(out_dir, "*_ascend_ms", "FRAMEWORK", "cpu_op_detail_info_*.csv")),
                   key=os.path.getmtime)
    if not found:
        sys.exit(f"no MindSpore profile under {out_dir} (expected *_ascend_ms/FRAMEWORK/cpu_op_detail_info_*.csv)")
    detail = found[-1]
    return detail, detail.replace("cpu_op_detail_info_", "cpu_op_execute_timestamp_").replace(".csv", ".txt")


def read_launches(timestamp_file: str) -> list:
    """Every kernel launch as (start ns, seconds, full op name), in execution order."""
    launches = []
    with open(timestamp_file, encoding="utf-8") as f:
        for line in f:
            name, _, runs = line.rstrip("\n").split(";")
            for run in runs.split():
                start_ns, duration_ms, _ = run.split(",")
                launches.append((int(start_ns), float(duration_ms) / 1e3, name))
    return sorted(launches)


def read_op_types(detail_csv: str) -> tuple:
    """full op name -> op type, and the profiler's own total operator time in seconds."""
    with open(detail_csv, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    return {r["full_op_name"]: r["op_type"] for r in rows}, sum(float(r["op_total_time(ms)"]) for r in rows) / 1e3


def mindspore_table(out_dir: str, steps: int) -> OpTable:
    """Classify every kernel launch of a MindSpore profile (see MINDSPORE_RULES)."""
    detail, timestamps = profiler_files(out_dir)
    op_types, _ = read_op_types(detail)
    table = OpTable(steps)
    previous = (OTHER, "update")
    launches = read_launches(timestamps)
    # Every step launches the same kernels in the same order, so launch i belongs to step i // per_step.
    per_step, uneven = divmod(len(launches), steps)
    if uneven:
        sys.exit(f"{timestamps}: {len(launches)} kernel launches do not split into {steps} equal steps")
    for index, (_, seconds, name) in enumerate(launches):
        kind = op_types.get(name, name.rsplit("/", 1)[-1].rsplit("-op", 1)[0])
        if re.search(MINDSPORE_EXPANDED, name):
            named = [(cls, phase) for cls, phase, pattern in MINDSPORE_EXPANDED_RULES if re.search(pattern, name)]
            cls, phase = named[0] if named else previous
            if not named:
                table.inherited += seconds / steps
        else:
            cls, phase = classify(MINDSPORE_RULES, name, kind), mindspore_phase(name)
            previous = (cls, phase)
        table.add(name, cls, phase, seconds, index // per_step)
    return table


class MindSporeSide:
    """Our step under mindspore.Profiler (it records MindSpore's kernels only)."""

    name = "mindspore"

    def __init__(self, recipe, out_dir: str):
        # Per process: a second run into the same --out must not read this one's profile (or the reverse).
        self.trainer = bench.MindSporeTrainer(recipe, os.path.join(out_dir, f"run-{os.getpid()}"))
        self.prof_dir = os.path.join(out_dir, f"mindspore_profile-{os.getpid()}")
        self.walls = []

    def start(self) -> None:
        from mindspore import Profiler

        self.prof = Profiler(output_path=self.prof_dir)

    def step(self, batch, index: int = None) -> float:
        return self.trainer.step(batch)

    def finish(self) -> dict:
        self.prof.stop()
        self.prof.analyse()
        _, profiler_total = read_op_types(profiler_files(self.prof_dir)[0])
        return summarize(mindspore_table(self.prof_dir, len(self.walls)), self.walls, profiler_total_s=profiler_total)


def torch_scope(event, forward_scopes: dict) -> str:
    """'phase/innermost label' of a PyTorch profiler event (labels: module hooks and the step's sections)."""
    node, backward_seq = event, None
    while node is not None:
        if node.name.startswith("autograd::engine::evaluate_function:"):
            backward_seq = node.sequence_nr
            break
        node = node.cpu_parent
    if backward_seq is not None:
        return "backward/" + forward_scopes.get(backward_seq, "")
    node = event
    while node is not None:
        if node.name.startswith("module:"):
            return "forward/" + node.name[len("module:"):]
        if node.name.startswith("step:"):
            section = node.name[len("step:"):]
            return ("update/" if section in ("clip_grad_norm", "optimizer") else "forward/") + section
        if node.name.startswith("Optimizer."):
            return "update/optimizer"
        node = node.cpu_parent
    return "forward/"


def is_label(event) -> bool:
    """A record_function label (module hooks, step sections, the optimizer's own), not an operator."""
    return event.is_user_annotation or event.name.startswith(("module:", "step:", "Optimizer.", STEP_LABEL))


def profiled_step(event) -> int:
    """Which profiled step an event ran in (TorchSide labels each)."""
    node = event
    while node is not None:
        if node.name.startswith(STEP_LABEL):
            return int(node.name[len(STEP_LABEL):])
        node = node.cpu_parent
    raise AssertionError(f"{event.name} ran outside the profiled steps")


def torch_table(events, steps: int) -> OpTable:
    """Classify the self time of every operator event (not the labels, whose self time is Python host work)."""
    # Autograd sequence number -> the module (or step section) of the forward op that recorded the node. Ops
    # that record no node carry the next number too, so the last op (in start order) holding it is its creator.
    forward_scopes = {}
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.sequence_nr >= 0 and not is_label(e) and not e.name.startswith("autograd::") \
                and not re.search(r"Backward\d*$", e.name):
            scope = torch_scope(e, {})
            if scope.startswith("forward/"):
                forward_scopes[e.sequence_nr] = scope[len("forward/"):]
    table = OpTable(steps)
    for e in events:
        if is_label(e):
            continue
        scope = torch_scope(e, forward_scopes)
        phase, where = scope.split("/", 1)
        table.add(f"{e.name} [{where}]" if where else e.name, torch_classify(e.name, scope), phase,
                  e.self_cpu_time_total / 1e6, profiled_step(e))
    return table


class TorchSide:
    """The PyTorch eager peer under torch.profiler (it records aten operators only), classified like ours."""

    name = "pytorch"

    def __init__(self, recipe):
        import torch

        self.torch = torch
        self.trainer = torch_peer.TorchTrainer(recipe)
        self.walls = []

    def start(self) -> None:
        self.handles = torch_peer.module_scopes(self.trainer.model, self.torch)
        self.prof = self.torch.profiler.profile(activities=[self.torch.profiler.ProfilerActivity.CPU])
        self.prof.__enter__()

    def step(self, batch, index: int = None) -> float:
        if index is None:
            return self.trainer.step(batch)
        with self.torch.profiler.record_function(f"{STEP_LABEL}{index}"):
            return self.trainer.step(batch)

    def finish(self) -> dict:
        self.prof.__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()
        return summarize(torch_table(self.prof.events(), len(self.walls)), self.walls)


def summarize(table: OpTable, walls: list, profiler_total_s: float = None) -> dict:
    """The fastest step (the least disturbed by other work on the machine), and the mean over the steps."""
    fastest = min(range(len(walls)), key=walls.__getitem__)
    classes, mean_classes = table.classes(fastest), table.classes()
    ops = sum(sum(p.values()) for p in classes.values())
    mean_ops = sum(sum(p.values()) for p in mean_classes.values())
    result = {"step_wall_s": walls, "fastest_step": fastest, "wall_per_step_s": walls[fastest], "op_per_step_s": ops,
              "host_per_step_s": walls[fastest] - ops, "classes": classes,
              "mean": {"wall_per_step_s": sum(walls) / len(walls), "op_per_step_s": mean_ops,
                       "classes": mean_classes},
              "top": table.top(), "unclassified": table.unclassified(), "families": table.families()}
    if profiler_total_s is not None:
        result["profiler_total_per_step_s"] = profiler_total_s / table.steps
        result["inherited_per_step_s"] = table.inherited
    return result


def machine() -> dict:
    model = platform.processor() or "unknown"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    return {"cpu": model, "cores": os.cpu_count()}


def profile_shape(shape_name: str, warmup: int, steps: int, out_dir: str, with_torch: bool = True) -> dict:
    """Profile both frameworks at one of benchmark_training's shapes; returns the JSON-ready result."""
    shape = bench.SHAPES[shape_name]
    recipe = bench.load_shape_recipe(shape, total_steps=warmup + steps + 1)
    data = bench.batches(shape, warmup + steps)
    result = {"shape": shape_name, "shape_detail": vars(shape), "warmup": warmup, "steps": steps,
              "machine": machine(), "load_before": os.getloadavg()[0],
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "frameworks": {}}
    import mindspore

    result["versions"] = {"mindspore": mindspore.__version__}
    sides = [MindSporeSide(recipe, out_dir)]
    if with_torch:
        sides.append(TorchSide(recipe))
        result["versions"]["torch"] = sides[1].torch.__version__
    unprofiled = {side.name: [] for side in sides}
    for i in range(warmup):
        for side in sides:
            start = time.perf_counter()
            side.step(data[i])
            unprofiled[side.name].append(time.perf_counter() - start)
    # Both profilers run at once and the steps alternate (order flipped every round), as in
    # benchmark_training.alternate: other work on a shared machine then slows both sides alike.
    for side in sides:
        side.start()
    for i in range(steps):
        for side in sides if i % 2 == 0 else reversed(sides):
            start = time.perf_counter()
            side.step(data[warmup + i], index=i)
            side.walls.append(time.perf_counter() - start)
    for side in sides:
        result["frameworks"][side.name] = side.finish()
        # The warm-up steps after the first (which compiles or allocates): what the profiler costs a step.
        result["frameworks"][side.name]["unprofiled_step_s"] = min(unprofiled[side.name][1:], default=None)
    result["load_after"] = os.getloadavg()[0]
    return result


def write_result(result: dict, out_dir: str) -> str:
    path = os.path.join(out_dir, f"profile_{result['shape']}.json")
    partial = f"{path}.{os.getpid()}.tmp"  # whole or absent: never half a JSON under the real name
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    os.replace(partial, path)
    return path


def read_result(path: str) -> dict:
    """A profile_<shape>.json this script wrote; ValueError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except OSError as err:
        raise ValueError(f"--compare {path}: cannot read it ({err.strerror})") from None
    except ValueError as err:
        raise ValueError(f"--compare {path}: not JSON ({err})") from None
    if not isinstance(result, dict) or "frameworks" not in result or "shape" not in result:
        raise ValueError(f"--compare {path}: not a profile written by scripts/profile_step.py "
                         "(no 'shape'/'frameworks')")
    return result


def writable_directory(path: str) -> str:
    """Create `path` if needed; ValueError when it cannot hold the profiles (checked before anything runs)."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ValueError(f"{path}: cannot write there ({err.strerror}); give --out a writable directory") from None
    return path


def class_rows(runs: list) -> list:
    """Table rows: class, then for each (label, framework result) its forward / backward / update / total ms
    and share of the step's wall time."""
    rows = []
    for cls in CLASSES:
        row = [cls]
        for _, fw in runs:
            phases = fw["classes"][cls]
            total = sum(phases.values())
            row += [f"{phases[p] * 1e3:.0f}" for p in PHASES]
            row += [f"{total * 1e3:.0f}", f"{total / fw['wall_per_step_s']:.1%}"]
        rows.append(row)
    for label, key in (("sum of operators", "op_per_step_s"), ("host (wall - operators)", "host_per_step_s"),
                       ("step wall time", "wall_per_step_s")):
        row = [label]
        for _, fw in runs:
            row += ["", "", "", f"{fw[key] * 1e3:.0f}", f"{fw[key] / fw['wall_per_step_s']:.1%}"]
        rows.append(row)
    return rows


def print_table(runs: list) -> None:
    """runs: [(label, framework result)], printed side by side (ms per step)."""
    header = ["class (ms/step)"]
    for label, _ in runs:
        header += [f"{label} fwd", "bwd", "upd", "total", "share"]
    rows = [header] + class_rows(runs)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  " + r[0].ljust(widths[0]) + "".join(f" {c:>{w}}" for c, w in zip(r[1:], widths[1:])))


def markdown_table(runs: list) -> str:
    """The class table as Markdown (docs/benchmarks.md), runs as in print_table."""
    header = ["class"]
    for label, _ in runs:
        header += [f"{label} fwd", "bwd", "upd", "total", "share"]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in class_rows(runs)])


def print_result(result: dict) -> None:
    m = result["machine"]
    print(f"\n== per-operator profile, shape {result['shape']}, {result['steps']} profiled steps after "
          f"{result['warmup']} warm-up; {m['cpu']}, {m['cores']} cores, load {result['load_before']:.2f} before, "
          f"{result['load_after']:.2f} after ({result['date']})")
    runs = list(result["frameworks"].items())
    print("  each framework's fastest step; step wall times (s): " + "; ".join(
        f"{name} " + ", ".join(f"{w:.2f}" for w in fw["step_wall_s"]) for name, fw in runs))
    print("  fastest unprofiled warm-up step after the first (s): " + "; ".join(
        f"{name} {fw['unprofiled_step_s']:.2f}" for name, fw in runs if fw.get("unprofiled_step_s")))
    print_table(runs)
    ms = result["frameworks"]["mindspore"]
    if "profiler_total_per_step_s" in ms:
        print(f"  MindSpore: the profiler's own operator total is {ms['profiler_total_per_step_s'] * 1e3:.0f} ms/step; "
              f"{ms['inherited_per_step_s'] * 1e3:.0f} ms/step of pass-generated Expand/ ops are classified by the "
              f"kernel launched before them")
    for name, fw in runs:
        print(f"\n  top {TOP} operators, {name} (ms/step, mean over the profiled steps):")
        for op in fw["top"]:
            print(f"  {op['s_per_step'] * 1e3:8.1f}  {op['class']:<34s} {op['phase']:<8s} {op['name']}")
        if fw["unclassified"]:
            other = sum(op["s_per_step"] for op in fw["unclassified"])
            families = defaultdict(float)
            for op in fw["unclassified"]:
                families[(op_family(op["name"]), op["phase"])] += op["s_per_step"]
            print(f"  unclassified ({OTHER}), {name}: {len(fw['unclassified'])} operators, {other * 1e3:.1f} ms/step "
                  f"(layers merged; every operator is in the JSON):")
            ranked = sorted(families.items(), key=lambda item: -item[1])
            for (family, phase), seconds in ranked[:UNCLASSIFIED_SHOWN]:
                print(f"  {seconds * 1e3:8.2f}  {phase:<8s} {family}")
            if len(ranked) > UNCLASSIFIED_SHOWN:
                rest = sum(seconds for _, seconds in ranked[UNCLASSIFIED_SHOWN:])
                print(f"  {rest * 1e3:8.2f}  {len(ranked) - UNCLASSIFIED_SHOWN} more kinds")


def op_family(name: str) -> str:
    """An operator's name with its layer index and MindSpore's instance number taken out."""
    return re.sub(r"-op\d+$", "", re.sub(r"CellList/\d+-", "CellList/*-", re.sub(r"layers\.\d+", "layers.*", name)))


def print_comparison(old: dict, new: dict) -> None:
    """Two results side by side, per framework (before | after)."""
    print(f"\n== before: {old['date']} (shape {old['shape']}, load {old['load_before']:.2f}) | after: {new['date']} "
          f"(shape {new['shape']}, load {new['load_before']:.2f})")
    if old["shape"] != new["shape"] or old["machine"] != new["machine"]:
        print(f"  not comparable as they stand: shape {old['shape']} / {new['shape']}, "
              f"CPU {old['machine']} / {new['machine']}")
    for name in new["frameworks"]:
        if name not in old["frameworks"]:
            print(f"\n  {name}: not in the earlier run")
            continue
        print(f"\n  {name}:")
        print_table([("before", old["frameworks"][name]), ("after", new["frameworks"][name])])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="reference", choices=sorted(bench.SHAPES))
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per framework")
    parser.add_argument("--warmup", type=int, default=2, help="unprofiled steps first (graph compile, allocations)")
    parser.add_argument("--out", help="directory for the profiles and profile_<shape>.json (default: a temporary "
                                      "one, the JSON is then written to the current directory)")
    parser.add_argument("--no-torch", action="store_true", help="profile ours only")
    parser.add_argument("--markdown", action="store_true", help="also print the class table as Markdown")
    parser.add_argument("--compare", nargs="+", metavar="JSON",
                        help="OLD.json: print it next to this run; OLD.json NEW.json: print both, profile nothing")
    args = parser.parse_args(argv)
    if args.compare and len(args.compare) > 2:
        parser.error("--compare takes OLD.json, or OLD.json NEW.json")
    if args.steps < 1 or args.warmup < 1:
        parser.error(f"--steps and --warmup must be at least 1 (the first step compiles the graph); got "
                     f"{args.steps} and {args.warmup}")
    try:
        earlier = [read_result(path) for path in args.compare or ()]
        if len(earlier) < 2:
            writable_directory(args.out or os.getcwd())
    except ValueError as err:
        parser.error(str(err))
    if len(earlier) == 2:
        print_comparison(*earlier)
        return 0
    if earlier and args.markdown:
        parser.error("--markdown prints a new run's table: give it without --compare")
    with tempfile.TemporaryDirectory(prefix="profile-step-") as tmp:
        work = args.out or tmp
        result = profile_shape(args.shape, args.warmup, args.steps, work, with_torch=not args.no_torch)
        path = write_result(result, args.out or os.getcwd())
    print_result(result)
    if args.markdown:
        print("\n" + markdown_table(list(result["frameworks"].items())))
    print(f"\n  written: {path}")
    if earlier:
        print_comparison(earlier[0], result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
