"""Preflight: check the machine before a launch, so a run does not die (or hang) minutes in.

`run_checks(recipe, ...)` returns Findings: "ok", "warn" (the launch goes ahead) or "error" (the
launcher refuses to start). Checks: software versions against training/launcher/supported_versions.yaml,
the device the recipe asks for, model parts not built for that device yet, the HCCL settings every rank will get,
locked-memory and mmap limits, the master port, leftover training workers, a writable output_dir, free disk
for the checkpoints, runner_config.stop_step against the data, and load_checkpoint's format.

Nothing here imports MindSpore or MindFormers: importing MindSpore sets HCCL_CONNECT_TIMEOUT=600
when it is unset and importing MindFormers creates ./output, so versions are read from the
installed files (training/launcher/versions.py reads them and the supported-versions table).
"""

import argparse
import json
import os
import platform
import re
import resource
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

from ascend_llm_recipes.common.errors import PretrainError
from ascend_llm_recipes.common.units import byte_size
from ascend_llm_recipes.training.launcher.versions import (ASCEND_ROOT, COMPONENTS, SUPPORTED_VERSIONS,
                                                           installed_versions, launch_environment, load_table,
                                                           npu_smi_info, read_text, row_text, version_matches,
                                                           version_tuple)
from ascend_llm_recipes.training.run_files import PREFLIGHT_JSON, PREFLIGHT_TXT

# What a training worker's command line contains (training/launcher/cluster.py WORKER_SCRIPT).
WORKER_MARK = "scripts/train.py"

# Exported by the launcher to every rank: the recipe's hccl section, whose defaults and HCCL's ranges
# are documented in training/recipe/device.py HcclConfig.
HCCL_VARIABLES = {"connect_timeout": "HCCL_CONNECT_TIMEOUT", "exec_timeout": "HCCL_EXEC_TIMEOUT",
                  "buffsize": "HCCL_BUFFSIZE"}
HCCL_RANGES = {"connect_timeout": (120, 7200), "exec_timeout": (0, 2**31 - 1), "buffsize": (1, None)}

# Every mmap'd region (MindSpore's memory pool, mapped dataset and checkpoint files, thread stacks)
# counts against vm.max_map_count; the kernel default 65530 is reached only after the regions pile up,
# so allocations fail minutes into training. 262144 is the value commonly recommended for
# large-memory services (not taken from an Ascend document).
MIN_MAX_MAP_COUNT = 262144


@dataclass
class Finding:
    level: Literal["ok", "warn", "error"]
    check: str    # short name: versions, device, hccl, memlock, ..., disk, loader, run_length, load_checkpoint
    message: str  # what was found, and what to do next
    data: dict = field(default_factory=dict)  # machine-readable details, recorded in preflight.json


# ---------------------------------------------------------------------------------------------
# versions

def check_versions(installed: dict, table: dict, device_target: str = "CPU") -> list:
    """Compare installed versions with the table: known-bad -> error, unknown -> warn, a supported row -> ok."""
    present = {c: installed.get(c) for c in COMPONENTS}
    shown = [c for c in COMPONENTS if present[c] or (device_target == "Ascend" and c in ("cann", "driver"))]
    summary = ", ".join(f"{c} {present[c] or 'not found'}" for c in shown)
    data = {"device_target": device_target, **installed}
    findings = []

    for name in ("mindspore", "mindformers"):
        if present[name] is None:
            findings.append(Finding("error", "versions", f"{name} is not installed: pip install -e . "
                                    "(installs the pinned mindspore and mindformers)", data))
    if device_target == "Ascend":
        sources = installed.get("sources", {})
        if present["cann"] is None:
            findings.append(Finding("error", "versions", f"device_target Ascend but {sources.get('cann', 'no CANN')}: "
                                    "install the CANN toolkit and `source /usr/local/Ascend/ascend-toolkit/"
                                    "set_env.sh` (or set ASCEND_HOME_PATH) before launching", data))
        if present["driver"] is None:
            findings.append(Finding("error", "versions", f"device_target Ascend but no NPU driver found "
                                    f"({sources.get('driver', '')}): install the Ascend HDK driver", data))

    for rule in table["known_bad"]:
        when = rule["when"]
        if not all(present.get(c) and version_matches(spec, present[c]) for c, spec in when.items()):
            continue
        for component, specs in rule["requires"].items():
            specs = [specs] if isinstance(specs, str) else list(specs)
            found = present.get(component)
            if found is not None and not any(version_matches(s, found) for s in specs):
                condition = " + ".join(f"{c} {present[c]}" for c in when)
                findings.append(Finding(
                    "error", "versions",
                    f"known-bad combination: {condition} with {component} {found}: {' '.join(rule['reason'].split())}. "
                    f"Install {component} {' or '.join(specs)} (or a matching {', '.join(when)}); "
                    f"supported rows are in {os.path.relpath(SUPPORTED_VERSIONS)}", data))

    firmware, fw_range = present["firmware"], installed.get("firmware_range")
    if firmware and fw_range and "," in fw_range:
        low, high = (s.strip() for s in fw_range.split(",", 1))
        if not version_tuple(low) <= version_tuple(firmware) <= version_tuple(high):
            findings.append(Finding(
                "error", "versions",
                f"firmware {firmware} is outside the range driver {present['driver']} declares "
                f"({low} to {high}, compatible_version_fw in {ASCEND_ROOT}/driver/version.info): install the "
                "firmware and driver of one Ascend HDK release", data))
    if any(f.level == "error" for f in findings):
        return findings

    rows = [r for r in table["supported"] if r.get("device", "CPU") == device_target]
    best, best_diffs = None, None
    for row in rows:
        diffs = [f"{c} {present.get(c) or 'not found'} (row: {spec})" for c, spec in row.items()
                 if c not in ("name", "device") and not (present.get(c) and version_matches(spec, present[c]))]
        if best is None or len(diffs) < len(best_diffs):
            best, best_diffs = row, diffs
    if best is not None and not best_diffs:
        return [Finding("ok", "versions", f"{summary}: supported ({best['name']})", data)]
    if best is None:
        return [Finding("warn", "versions", f"{summary}: no supported stack is listed for device_target "
                        f"{device_target} in {os.path.relpath(SUPPORTED_VERSIONS)}; untested", data)]
    return [Finding("warn", "versions",
                    f"{summary}: untested combination (not known-bad): differs from '{best['name']}' in "
                    f"{'; '.join(best_diffs)}. It may work; the tested stack is {row_text(best)}", data)]


# ---------------------------------------------------------------------------------------------
# device, HCCL, limits

def visible_npus() -> list:
    return sorted((p for p in os.listdir("/dev") if re.fullmatch(r"davinci\d+", p)), key=lambda p: int(p[7:])) \
        if os.path.isdir("/dev") else []


def check_device(recipe, env: dict = None) -> list:
    """The device target the recipe asks for must exist here, with enough devices for DP x TP x PP."""
    env = launch_environment() if env is None else env
    target = recipe.context.device_target
    # on several nodes each node needs only its own share of DP x TP x PP
    needed = getattr(getattr(recipe, "hardware", None), "devices_per_node", 0) or recipe.world_size
    if target == "CPU":
        cores = os.cpu_count() or 1
        if needed > cores:
            return [Finding("warn", "device", f"device_target CPU: {needed} workers on {cores} cores; each worker "
                            "gets one thread and they compete. Lower parallel_config.data_parallel", {})]
        return [Finding("ok", "device", f"device_target CPU: {needed} worker(s) on {cores} core(s)", {})]
    if target == "GPU":
        gpus = [p for p in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", p)]
        if len(gpus) < needed:
            return [Finding("error", "device", f"device_target GPU needs {needed} device(s), {len(gpus)} visible "
                            "(/dev/nvidia*): run on a GPU host or --set context.device_target=CPU", {})]
        return [Finding("ok", "device", f"device_target GPU: {len(gpus)} device(s) visible", {})]

    npus, smi = visible_npus(), npu_smi_info()
    if not npus and smi is None:
        return [Finding("error", "device",
                        "device_target Ascend but no NPU is visible (no /dev/davinciN device, no npu-smi on PATH). "
                        "Run on an Ascend host (in a container, pass /dev/davinciN, /dev/davinci_manager, "
                        "/dev/devmm_svm and /dev/hisi_hdc); --plan works on any machine, and recipes/tiny_cpu.yaml "
                        "trains on CPU", {})]
    if smi is not None and smi[0] != 0:
        return [Finding("error", "device", f"`npu-smi info` failed (exit {smi[0]}): {smi[1].strip()[-300:]}. "
                        "The NPU driver is not loaded or not usable; check `dmesg` and reinstall the driver", {})]
    visible = env.get("ASCEND_RT_VISIBLE_DEVICES")
    count = len([d for d in visible.split(",") if d.strip()]) if visible else len(npus)
    where = f"ASCEND_RT_VISIBLE_DEVICES={visible}" if visible else f"/dev/davinci*: {', '.join(npus) or 'none'}"
    if count < needed:
        return [Finding("error", "device", f"this node needs {needed} NPUs (data_parallel x model_parallel x "
                        f"pipeline_stage, per node) but {count} are visible ({where}); HCCL init would wait forever "
                        "for the missing ranks. Lower the parallel degrees or use more devices", {"npus": npus})]
    return [Finding("ok", "device", f"device_target Ascend: {count} NPU(s) visible ({where}), {needed} needed",
                    {"npus": npus})]


def check_model(recipe) -> list:
    """What MindFormers' MoELayer (the MoE layers of a recipe on Ascend, models/expert_parallel.py) would compute
    otherwise than the recipe says, found here, before a cluster is booked, not when the worker builds the model."""
    cfg = recipe.model.model_config
    if recipe.context.device_target == "CPU" or not cfg.moe:
        return []
    from ascend_llm_recipes.training.recipe.mindformers_mcore_export import moe_layer_problems

    return [Finding("error", "model", f"{problem} (on Ascend the MoE layers are MindFormers 1.9's MoELayer)", {})
            for problem in moe_layer_problems(recipe)]


def hccl_env(recipe) -> dict:
    """HCCL_CONNECT_TIMEOUT, HCCL_EXEC_TIMEOUT, HCCL_BUFFSIZE for every rank: the recipe's `hccl` section."""
    return {variable: str(getattr(recipe.hccl, key)) for key, variable in HCCL_VARIABLES.items()}


def check_hccl(recipe, env: dict = None) -> list:
    """The HCCL values the launcher exports: within HCCL's ranges, and not silently replacing the user's own."""
    env = launch_environment() if env is None else env
    wanted = hccl_env(recipe)
    from ascend_llm_recipes.training.recipe.device import HcclConfig

    from_recipe = [k for k in HCCL_VARIABLES if getattr(recipe.hccl, k) != getattr(HcclConfig(), k)]
    origin = f"recipe hccl.{', hccl.'.join(from_recipe)}" if from_recipe else "the hccl section's defaults"
    findings = []
    for key, variable in HCCL_VARIABLES.items():
        low, high = HCCL_RANGES[key]
        try:
            value = int(wanted[variable])
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            accepted = f"[{low}, {high}]" if high is not None else f">= {low}"
            findings.append(Finding("error", "hccl", f"hccl.{key}: {wanted[variable]!r} is outside what HCCL "
                                    f"accepts for {variable} ({accepted}, CANN 9.0.0); fix it in the recipe", wanted))
        current = env.get(variable)
        if current is not None and current != wanted[variable]:
            findings.append(Finding(
                "warn", "hccl",
                f"{variable}={current} in your environment, but the launcher exports {variable}={wanted[variable]} "
                f"(from {origin}) to every rank: HCCL reads it once at init and all ranks must agree, so the "
                f"launcher's value wins. To keep {current}, set hccl.{key}: {current} in the recipe; otherwise "
                f"`unset {variable}`", wanted))
    if not findings:
        note = "; unused on CPU (workers communicate through mccl)" if recipe.context.device_target == "CPU" else ""
        findings.append(Finding("ok", "hccl", " ".join(f"{k}={v}" for k, v in wanted.items()) +
                                f" exported to every rank (from {origin}){note}", wanted))
    return findings


def _limit_text(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else f"{value // 1024} KiB"


def check_memlock(device_target: str = "Ascend") -> list:
    """`ulimit -l`: HCCL and host-device copies lock (pin) host memory; on Ascend it should be unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    data = {"soft": soft, "hard": hard}
    if soft == resource.RLIM_INFINITY:
        return [Finding("ok", "memlock", "ulimit -l: unlimited", data)]
    if device_target == "CPU":
        return [Finding("ok", "memlock", f"ulimit -l: {_limit_text(soft)}; enough on CPU (nothing is pinned), "
                        "raise it to unlimited before running on Ascend", data)]
    how = ("`ulimit -l unlimited` in the shell that launches" if hard == resource.RLIM_INFINITY else
           f"the hard limit is {_limit_text(hard)}, so as root: add `* soft memlock unlimited` and "
           "`* hard memlock unlimited` to /etc/security/limits.conf and log in again (Docker: "
           "`--ulimit memlock=-1:-1`)")
    return [Finding("warn", "memlock", f"ulimit -l (locked memory) is {_limit_text(soft)}: HCCL and host-device "
                    "copies pin host memory and fail to allocate once it is used up, minutes into training. "
                    f"Raise it: {how}", data)]


def check_max_map_count(path: str = "/proc/sys/vm/max_map_count") -> list:
    text = read_text(path)
    if text is None or not text.strip().isdigit():
        return [Finding("warn", "max_map_count", f"could not read {path}; make sure vm.max_map_count >= "
                        f"{MIN_MAX_MAP_COUNT}", {})]
    value = int(text)
    if value >= MIN_MAX_MAP_COUNT:
        return [Finding("ok", "max_map_count", f"vm.max_map_count: {value}", {"value": value})]
    return [Finding("warn", "max_map_count",
                    f"vm.max_map_count is {value} (< {MIN_MAX_MAP_COUNT}): every memory mapping (MindSpore's "
                    "memory pool, mapped dataset and checkpoint files, thread stacks) counts against it, so "
                    "allocations start failing after minutes of training. Raise it: "
                    f"`sudo sysctl -w vm.max_map_count={MIN_MAX_MAP_COUNT}` (to keep it after reboot: "
                    f"`echo vm.max_map_count={MIN_MAX_MAP_COUNT} | sudo tee /etc/sysctl.d/99-max-map-count.conf`)",
                    {"value": value})]


# ---------------------------------------------------------------------------------------------
# port, leftover processes, disk

def port_in_use(port: int) -> Optional[str]:
    """Why `port` cannot be listened on (None when it can): tried on loopback and on all interfaces."""
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server does: TIME_WAIT is not "busy"
            try:
                s.bind((host, port))
            except OSError as err:
                return f"{host}:{port}: {err.strerror or err}"
    return None


def check_master_port(port: Optional[int]) -> list:
    if port is None:
        return [Finding("ok", "master_port", "no fixed master port: the launcher picks a free one for msrun (a "
                        "one-process CPU run, started without msrun, needs none)", {})]
    busy = port_in_use(port)
    if busy:
        return [Finding("error", "master_port",
                        f"master port {port} is in use ({busy}); msrun's scheduler could not listen on it. "
                        f"See who holds it with `ss -ltnp 'sport = :{port}'` and stop it, or choose another "
                        "port (a free one: `python -c \"import socket; s=socket.socket(); s.bind(('', 0)); "
                        "print(s.getsockname()[1])\"`)", {"port": port})]
    return [Finding("ok", "master_port", f"master port {port} is free", {"port": port})]


def _parent_pid(pid: int) -> Optional[int]:
    stat = read_text(f"/proc/{pid}/stat")
    try:
        return int(stat.rsplit(")", 1)[1].split()[1])  # the command name in (...) may contain spaces
    except (AttributeError, IndexError, ValueError):
        return None


def training_processes(mark: str = WORKER_MARK) -> list:
    """(pid, command line) of every process whose arguments contain `mark`, except this process and its ancestors."""
    own, pid = set(), os.getpid()
    while pid and pid not in own:
        own.add(pid)
        pid = _parent_pid(pid)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in own:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if any(mark in arg for arg in args):
            found.append((int(entry), " ".join(args)))
    return sorted(found)


def check_leftover_processes(run_dir: Optional[str] = None) -> list:
    found = training_processes()
    if not found:
        return [Finding("ok", "processes", f"no other {WORKER_MARK} process running", {})]
    own = os.path.abspath(run_dir) + os.sep if run_dir else None
    return [Finding("warn", "processes",
                    f"process {pid} is still running `{cmd[:300]}`: "
                    + ("a process of this run directory's previous launch, still stopping (the launcher waits for "
                       "it before starting; do not kill it while it saves)" if own and own in cmd + os.sep else
                       f"a training worker from another run holds devices, memory and ports. If it is stale: "
                       f"`kill {pid}` (`kill -9 {pid}` if it does not exit); otherwise wait for it to finish"),
                    {"pid": pid, "cmdline": cmd})
            for pid, cmd in found]


def _existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_writable_dir(path: str, what: str) -> None:
    """Refuse, naming `what` (a key or option), a directory that cannot be created or written here."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise PretrainError(f"{what}: {path} is a file, not a directory",
                            hint=f"choose another {what}, or move that file away")
    existing = _existing_parent(path)
    if not os.path.isdir(existing):
        raise PretrainError(f"{what}: {path} cannot be created: {existing} is a file, not a directory",
                            hint=f"choose another {what}")
    try:  # what counts is whether a write succeeds: root ignores permission bits, not a read-only mount
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise PretrainError(f"{what}: {path} is not writable: {err.strerror} in {existing}",
                            hint=f"choose a writable location for {what}") from None


def check_output_dir(recipe, run_dir: Optional[str] = None) -> list:
    """The run directory must be writable before anything starts (a late failure leaves a half-made run)."""
    path = os.path.abspath(run_dir or recipe.output_dir)
    try:
        check_writable_dir(path, "output_dir")
    except PretrainError as err:
        return [Finding("error", "output_dir", f"{err.message}; {err.hint}", {"path": path})]
    return [Finding("ok", "output_dir", f"{path} is writable", {"path": path})]


def checkpoint_bytes(recipe) -> int:
    """One save of every rank: what the planner counts (training/tools/planner.py checkpoint_bytes: weights in their
    dtype, float32 masters of 16-bit weights, AdamW moments, the step; each rank its own slices; no accu_grads)."""
    from ascend_llm_recipes.training.tools.planner import checkpoint_bytes as planned

    return planned(recipe)[1]


def check_disk(recipe, run_dir: Optional[str] = None) -> list:
    """Free space where the checkpoints go: one checkpoint x keep_checkpoint_max x data-parallel copies."""
    monitors = [c for c in recipe.callbacks if getattr(c, "type", None) == "CheckpointMonitor"]
    if not monitors:
        return [Finding("ok", "disk", "no CheckpointMonitor in callbacks: no checkpoints are written", {})]
    keep = sum(m.keep_checkpoint_max for m in monitors)
    one = checkpoint_bytes(recipe)  # every rank writes its own checkpoints/step_N/rank_R
    needed = one * keep
    where = _existing_parent(run_dir or recipe.output_dir)
    free = shutil.disk_usage(where).free
    data = {"checkpoint_bytes": one, "keep_checkpoint_max": keep, "ranks": recipe.world_size, "needed_bytes": needed,
            "free_bytes": free, "path": where}
    arithmetic = (f"{byte_size(one)} per checkpoint ({recipe.world_size} rank(s): weights, AdamW moments, float32 "
                  f"masters of 16-bit weights; bash scripts/run_distributed.sh RECIPE --plan itemises it) x "
                  f"keep_checkpoint_max {keep} = {byte_size(needed)}; {byte_size(free)} free at {where}")
    if needed > free:
        return [Finding("error", "disk", f"checkpoints will not fit: {arithmetic}. Free space, point output_dir "
                        "at a larger disk (--set output_dir=...), or lower keep_checkpoint_max", data)]
    if free < 2 * needed:
        return [Finding("warn", "disk", f"checkpoints leave little room: {arithmetic} (less than 2x); logs and "
                        "a concurrent save can fill the disk. Free space or lower keep_checkpoint_max", data)]
    return [Finding("ok", "disk", arithmetic, data)]


def check_loader_workers(recipe, cpus: Optional[int] = None) -> list:
    """train_dataset.num_parallel_workers within this machine's CPUs: MindSpore's dataset raises past them
    ("num_parallel_workers exceeds the boundary between 1 and N", mindspore/dataset/core/validator_helpers.py:657)."""
    cpus = cpus or os.cpu_count() or 1
    workers = recipe.train_dataset.num_parallel_workers
    if workers > cpus:
        return [Finding("error", "loader", f"train_dataset.num_parallel_workers: {workers} exceeds this machine's "
                        f"{cpus} CPUs; MindSpore's dataset would refuse it when the workers start. Set it to at most "
                        f"{cpus} (--set train_dataset.num_parallel_workers={cpus})", {})]
    return [Finding("ok", "loader", f"train_dataset.num_parallel_workers {workers} of {cpus} CPUs", {})]


def check_run_length(recipe) -> list:
    """runner_config.stop_step against the steps the training data holds (training/launcher/datasets.py), from the
    dataset manifests: a run never ends early without a word."""
    from ascend_llm_recipes.common.errors import DataError
    from ascend_llm_recipes.training.launcher.datasets import data_steps, run_length_problem

    stop = recipe.runner_config.stop_step
    try:
        problem, steps = run_length_problem(recipe), data_steps(recipe)
    except DataError as err:
        prep = recipe.data_preparation
        if prep is not None and prep.output_dir == recipe.dataset_dir and not os.path.exists(recipe.dataset_dir):
            return [Finding("ok", "run_length", f"{recipe.dataset_dir} is prepared at launch (data_preparation); "
                            "runner_config.stop_step is checked against it then", {})]
        return [Finding("warn", "run_length", f"not checked against the data: {err.message}", {})]
    data = {"stop_step": stop, "data_steps": steps}
    if problem is not None:
        return [Finding("error", "run_length", f"{problem.message}. To fix: {problem.hint}", data)]
    return [Finding("ok", "run_length", f"{stop or steps} steps of the {steps} the training data holds", data)]


def check_checkpoint_source(recipe) -> list:
    """load_checkpoint exists and is not another framework's checkpoint (training/launcher/datasets.py)."""
    from ascend_llm_recipes.training.launcher.datasets import load_checkpoint_problem

    if not recipe.load_checkpoint:
        return [Finding("ok", "load_checkpoint", "none: the model starts from its initialisation (or a resume)", {})]
    problem = load_checkpoint_problem(recipe)
    if problem is not None:
        return [Finding("error", "load_checkpoint", f"{problem.message}. To fix: {problem.hint}", {})]
    return [Finding("ok", "load_checkpoint", f"{recipe.load_checkpoint} exists (its tensors are checked at launch)",
                    {})]


# ---------------------------------------------------------------------------------------------
# all checks, output

def run_checks(recipe, run_dir: Optional[str] = None, master_port: Optional[int] = None,
               env: Optional[dict] = None) -> list:
    """Every preflight check for `recipe`; env defaults to the environment this process started with."""
    env = launch_environment() if env is None else env
    target = recipe.context.device_target
    findings = check_versions(installed_versions(env), load_table(), target)
    findings += check_device(recipe, env)
    findings += check_model(recipe)
    findings += check_hccl(recipe, env)
    findings += check_memlock(target)
    findings += check_max_map_count()
    findings += check_master_port(master_port)
    findings += check_leftover_processes(run_dir or recipe.output_dir)
    findings += check_output_dir(recipe, run_dir)
    findings += check_disk(recipe, run_dir)
    findings += check_loader_workers(recipe)
    findings += check_run_length(recipe)
    findings += check_checkpoint_source(recipe)
    return findings


def has_errors(findings: list) -> bool:
    return any(f.level == "error" for f in findings)


def format_findings(findings: list) -> str:
    counts = {level: sum(f.level == level for f in findings) for level in ("ok", "warn", "error")}
    lines = [f"[preflight] {counts['ok']} ok, {counts['warn']} warning(s), {counts['error']} error(s)"]
    width = max((len(f.check) for f in findings), default=0)
    for f in findings:
        lines.append(f"  {f.level.upper() if f.level != 'ok' else 'ok':<5} {f.check:<{width}}  {f.message}")
    if counts["error"]:
        lines.append("[preflight] refusing to start: fix the errors above")
    return "\n".join(lines)


def write_findings(findings: list, run_dir: str) -> tuple:
    """Write RUN_DIR/preflight.json (machine-readable, with the versions found) and RUN_DIR/preflight.txt."""
    os.makedirs(run_dir, exist_ok=True)
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
              "errors": sum(f.level == "error" for f in findings),
              "warnings": sum(f.level == "warn" for f in findings),
              "findings": [asdict(f) for f in findings]}
    json_path, txt_path = os.path.join(run_dir, PREFLIGHT_JSON), os.path.join(run_dir, PREFLIGHT_TXT)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, default=str)
    with open(txt_path, "w", encoding="utf-8") as f:
        f.write(format_findings(findings) + "\n")
    return json_path, txt_path


def main(argv=None) -> int:
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    parser = argparse.ArgumentParser(prog="python -m ascend_llm_recipes.training.launcher.preflight",
                                     description="Check this machine for a recipe without launching.")
    parser.add_argument("recipe")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    parser.add_argument("--run-dir", help="also write preflight.json/.txt there")
    parser.add_argument("--master-port", type=int)
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, tuple(args.overrides))
        findings = run_checks(recipe, args.run_dir, args.master_port)
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_findings(findings))
    if args.run_dir:
        write_findings(findings, args.run_dir)
    return 1 if has_errors(findings) else 0


if __name__ == "__main__":
    sys.exit(main())
