"""Preflight: check the machine before a launch, so a run does not die (or hang) minutes in.

`run_checks(recipe, ...)` returns Findings: "ok", "warn" (the launch goes ahead) or "error" (the
launcher refuses to start). Checks: software versions against training/launcher/supported_versions.yaml,
the device the recipe asks for, the HCCL settings every rank will get, locked-memory and mmap
limits, the master port, leftover training workers, a writable output_dir, and free disk for the checkpoints.

Nothing here imports MindSpore or MindFormers: importing MindSpore sets HCCL_CONNECT_TIMEOUT=600
when it is unset and importing MindFormers creates ./output, so versions are read from the
installed files.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

import yaml

from ascend_llm_recipes.common.errors import LaunchError, PretrainError
from ascend_llm_recipes.training.run_files import PREFLIGHT_JSON, PREFLIGHT_TXT

SUPPORTED_VERSIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supported_versions.yaml")

COMPONENTS = ("python", "mindspore", "mindformers", "cann", "driver", "firmware")
ASCEND_ROOT = "/usr/local/Ascend"
WORKER_MARK = "scripts/train.py"  # what a training worker's command line contains (training/launcher/cli.py)

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
    check: str    # short name: versions, device, hccl, memlock, max_map_count, master_port, processes, output_dir, disk
    message: str  # what was found, and what to do next
    data: dict = field(default_factory=dict)  # machine-readable details, recorded in preflight.json


# ---------------------------------------------------------------------------------------------
# versions

def launch_environment() -> dict:
    """The environment this process started with, i.e. what the user exported.

    os.environ can differ: importing MindSpore adds HCCL_CONNECT_TIMEOUT=600 when it is unset.
    """
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return dict(os.environ)
    env = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            key, value = item.split(b"=", 1)
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _info_value(text: str, key: str) -> Optional[str]:
    """`key=value` from an Ascend .info/.cfg file (key case-insensitive)."""
    match = re.search(rf"^\s*{key}\s*=\s*(\S+)\s*$", text or "", re.MULTILINE | re.IGNORECASE)
    return match.group(1) if match else None


def _package_version(name: str) -> tuple:
    """(`name.__version__`, where it was read) without importing the package; (None, reason) if absent."""
    module = sys.modules.get(name)
    if getattr(module, "__version__", None):
        return module.__version__, f"{name}.__version__"
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for filename in ("version.py", "__init__.py"):
            path = os.path.join(folder, filename)
            match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", _read(path) or "", re.MULTILINE)
            if match:
                return match.group(1), path
    try:
        return importlib.metadata.version(name), f"pip metadata of {name}"
    except importlib.metadata.PackageNotFoundError:
        return None, "not installed"


def _npu_smi_info() -> Optional[tuple]:
    """(exit code, output) of `npu-smi info`, or None when npu-smi is not on PATH."""
    if shutil.which("npu-smi") is None:
        return None
    try:
        done = subprocess.run(["npu-smi", "info"], capture_output=True, text=True, timeout=30, check=False)
        return done.returncode, done.stdout + done.stderr
    except (OSError, subprocess.TimeoutExpired) as err:
        return -1, str(err)


def _cann_version(env: dict) -> tuple:
    """(CANN toolkit version, file it came from), looking where set_env.sh and the installers put it."""
    arch = platform.machine()
    homes = [env.get("ASCEND_HOME_PATH"), env.get("ASCEND_TOOLKIT_HOME"),
             f"{ASCEND_ROOT}/ascend-toolkit/latest", f"{ASCEND_ROOT}/cann"]
    looked = []
    for home in dict.fromkeys(h for h in homes if h):
        path = os.path.join(home, f"{arch}-linux", "ascend_toolkit_install.info")  # version=9.0.0
        version = _info_value(_read(path), "version")
        if version:
            return version, path
        path = os.path.join(home, "version.cfg")  # toolkit_running_version=[7.6.0.1.220:8.0.0]
        running = _info_value(_read(path), "toolkit_running_version")
        if running and ":" in running:
            return running.strip("[]").split(":", 1)[1], path
        path = os.path.join(home, "compiler", "version.info")  # Version=9.0.0 (what MindSpore reads)
        version = _info_value(_read(path), "version")
        if version:
            return version, path
        looked.append(home)
    return None, "no CANN toolkit in " + ", ".join(looked)


def installed_versions(env: dict = None) -> dict:
    """Versions of every stack component on this machine (None = not found), plus where each came from."""
    env = launch_environment() if env is None else env
    versions = {"python": platform.python_version()}
    sources = {"python": sys.executable}
    for name in ("mindspore", "mindformers"):
        versions[name], sources[name] = _package_version(name)
    versions["cann"], sources["cann"] = _cann_version(env)

    driver_info = _read(f"{ASCEND_ROOT}/driver/version.info")
    versions["driver"] = _info_value(driver_info, "Version") or _info_value(driver_info, "package_version")
    sources["driver"] = f"{ASCEND_ROOT}/driver/version.info"
    # The driver names the firmware range it works with, e.g. compatible_version_fw=[7.0.0,7.5.99].
    fw_range = _info_value(driver_info, "compatible_version_fw")
    versions["firmware_range"] = fw_range.strip("[]") if fw_range else None
    smi = _npu_smi_info()
    header = re.search(r"npu-smi\s+\S+\s+Version:\s*(\S+)", smi[1]) if smi else None
    if header:
        sources["npu-smi"] = header.group(0)
        if versions["driver"] is None:
            versions["driver"], sources["driver"] = header.group(1), "npu-smi info"
    if versions["driver"] is None:
        sources["driver"] = f"no {ASCEND_ROOT}/driver/version.info" + ("" if smi else ", no npu-smi")

    versions["firmware"] = _info_value(_read(f"{ASCEND_ROOT}/firmware/version.info"), "Version")
    sources["firmware"] = f"{ASCEND_ROOT}/firmware/version.info"
    versions["sources"] = sources
    return versions


def version_matches(spec: str, version: str) -> bool:
    """True when `spec` equals `version` or is a dotted prefix of it ("3.11" matches 3.11.7), ignoring case."""
    spec, version = str(spec).lower(), str(version).lower()
    return version == spec or version.startswith(spec + ".")


def _version_tuple(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in re.split(r"[.\-]", version))


def _version_map_path() -> Optional[str]:
    spec = importlib.util.find_spec("mindformers")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "VERSION_MAP.json")
        if os.path.isfile(path):
            return path
    return None


def load_table(path: str = SUPPORTED_VERSIONS, version_map: Optional[str] = "installed") -> dict:
    """supported_versions.yaml, plus the installed MindFormers' VERSION_MAP.json pairings it does not list.

    version_map: path of a VERSION_MAP.json, "installed" (the installed MindFormers' own), or None.
    """
    with open(path, encoding="utf-8") as f:
        table = yaml.safe_load(f) or {}
    problems = []
    for section in ("supported", "known_bad"):
        if not isinstance(table.get(section), list):
            problems.append(f"{section}: expected a list of rows")
    for i, row in enumerate(table.get("supported") or []):
        problems += [f"supported.{i}.{k}: {v!r} must be a quoted string (YAML reads 3.10 as 3.1)"
                     for k, v in row.items() if not isinstance(v, str)]
    for i, rule in enumerate(table.get("known_bad") or []):
        specs = list(rule.get("when", {}).items())
        specs += [(k, s) for k, v in rule.get("requires", {}).items() for s in ([v] if isinstance(v, str) else v)]
        problems += [f"known_bad.{i}.{k}: {s!r} must be a quoted string" for k, s in specs if not isinstance(s, str)]
        if not rule.get("when") or not rule.get("requires") or not rule.get("reason"):
            problems.append(f"known_bad.{i}: needs when, requires and reason")
    if problems:
        raise LaunchError(f"{path}: " + "; ".join(problems), hint="fix the supported-versions table")

    version_map = _version_map_path() if version_map == "installed" else version_map
    if version_map:
        with open(version_map, encoding="utf-8") as f:
            releases = json.load(f).get("mf", {})
        listed = {rule["when"].get("mindformers") for rule in table["known_bad"]}
        for mf, entry in releases.items():
            if mf not in listed:
                table["known_bad"].append({
                    "when": {"mindformers": mf}, "requires": {"mindspore": list(entry["support"])},
                    "reason": f"MindFormers {mf} supports MindSpore {', '.join(entry['support'])} ({version_map})"})
    return table


def _row_text(row: dict) -> str:
    return " + ".join(f"{k} {v}" for k, v in row.items() if k not in ("name", "device"))


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
        if not _version_tuple(low) <= _version_tuple(firmware) <= _version_tuple(high):
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
                    f"{'; '.join(best_diffs)}. It may work; the tested stack is {_row_text(best)}", data)]


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

    npus, smi = visible_npus(), _npu_smi_info()
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
    text = _read(path)
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
        return [Finding("ok", "master_port", "no fixed master port: the launcher picks a free one", {})]
    busy = port_in_use(port)
    if busy:
        return [Finding("error", "master_port",
                        f"master port {port} is in use ({busy}); msrun's scheduler could not listen on it. "
                        f"See who holds it with `ss -ltnp 'sport = :{port}'` and stop it, or choose another "
                        "port (a free one: `python -c \"import socket; s=socket.socket(); s.bind(('', 0)); "
                        "print(s.getsockname()[1])\"`)", {"port": port})]
    return [Finding("ok", "master_port", f"master port {port} is free", {"port": port})]


def _parent_pid(pid: int) -> Optional[int]:
    stat = _read(f"/proc/{pid}/stat")
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


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000


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
    arithmetic = (f"{_human(one)} per checkpoint ({recipe.world_size} rank(s): weights, AdamW moments, float32 "
                  f"masters of 16-bit weights; bash scripts/run_distributed.sh RECIPE --plan itemises it) x "
                  f"keep_checkpoint_max {keep} = {_human(needed)}; {_human(free)} free at {where}")
    if needed > free:
        return [Finding("error", "disk", f"checkpoints will not fit: {arithmetic}. Free space, point output_dir "
                        "at a larger disk (--set output_dir=...), or lower keep_checkpoint_max", data)]
    if free < 2 * needed:
        return [Finding("warn", "disk", f"checkpoints leave little room: {arithmetic} (less than 2x); logs and "
                        "a concurrent save can fill the disk. Free space or lower keep_checkpoint_max", data)]
    return [Finding("ok", "disk", arithmetic, data)]


# ---------------------------------------------------------------------------------------------
# all checks, output

def run_checks(recipe, run_dir: Optional[str] = None, master_port: Optional[int] = None,
               env: Optional[dict] = None) -> list:
    """Every preflight check for `recipe`; env defaults to the environment this process started with."""
    env = launch_environment() if env is None else env
    target = recipe.context.device_target
    findings = check_versions(installed_versions(env), load_table(), target)
    findings += check_device(recipe, env)
    findings += check_hccl(recipe, env)
    findings += check_memlock(target)
    findings += check_max_map_count()
    findings += check_master_port(master_port)
    findings += check_leftover_processes(run_dir or recipe.output_dir)
    findings += check_output_dir(recipe, run_dir)
    findings += check_disk(recipe, run_dir)
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
