"""What is installed, and what is supported: the software stack read without importing it.

`installed_versions()` reads Python, MindSpore, MindFormers, CANN, the NPU driver and firmware from
the installed files (importing MindSpore sets HCCL_CONNECT_TIMEOUT=600 when it is unset, importing
MindFormers creates ./output); `load_table()` reads training/launcher/supported_versions.yaml plus the
installed MindFormers' VERSION_MAP.json. training/launcher/preflight.py check_versions compares the two.
"""

import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from typing import Optional

import yaml

from ascend_llm_recipes.common.errors import LaunchError

SUPPORTED_VERSIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supported_versions.yaml")

COMPONENTS = ("python", "mindspore", "mindformers", "cann", "driver", "firmware")
ASCEND_ROOT = "/usr/local/Ascend"


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


def read_text(path: str) -> Optional[str]:
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
            match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", read_text(path) or "", re.MULTILINE)
            if match:
                return match.group(1), path
    try:
        return importlib.metadata.version(name), f"pip metadata of {name}"
    except importlib.metadata.PackageNotFoundError:
        return None, "not installed"


def npu_smi_info() -> Optional[tuple]:
    """(exit code, output) of `npu-smi info`, or None when npu-smi is not on PATH."""
    if shutil.which("npu-smi") is None:
        return None
    try:
        done = subprocess.run(["npu-smi", "info"], capture_output=True, text=True, timeout=30, check=False)
        return done.returncode, done.stdout + done.stderr
    except (OSError, subprocess.TimeoutExpired) as err:
        return -1, str(err)


def cann_version(env: dict) -> tuple:
    """(CANN toolkit version, file it came from), looking where set_env.sh and the installers put it."""
    arch = platform.machine()
    homes = [env.get("ASCEND_HOME_PATH"), env.get("ASCEND_TOOLKIT_HOME"),
             f"{ASCEND_ROOT}/ascend-toolkit/latest", f"{ASCEND_ROOT}/cann"]
    looked = []
    for home in dict.fromkeys(h for h in homes if h):
        path = os.path.join(home, f"{arch}-linux", "ascend_toolkit_install.info")  # version=9.0.0
        version = _info_value(read_text(path), "version")
        if version:
            return version, path
        path = os.path.join(home, "version.cfg")  # toolkit_running_version=[7.6.0.1.220:8.0.0]
        running = _info_value(read_text(path), "toolkit_running_version")
        if running and ":" in running:
            return running.strip("[]").split(":", 1)[1], path
        path = os.path.join(home, "compiler", "version.info")  # Version=9.0.0 (what MindSpore reads)
        version = _info_value(read_text(path), "version")
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
    versions["cann"], sources["cann"] = cann_version(env)

    driver_info = read_text(f"{ASCEND_ROOT}/driver/version.info")
    versions["driver"] = _info_value(driver_info, "Version") or _info_value(driver_info, "package_version")
    sources["driver"] = f"{ASCEND_ROOT}/driver/version.info"
    # The driver names the firmware range it works with, e.g. compatible_version_fw=[7.0.0,7.5.99].
    fw_range = _info_value(driver_info, "compatible_version_fw")
    versions["firmware_range"] = fw_range.strip("[]") if fw_range else None
    smi = npu_smi_info()
    header = re.search(r"npu-smi\s+\S+\s+Version:\s*(\S+)", smi[1]) if smi else None
    if header:
        sources["npu-smi"] = header.group(0)
        if versions["driver"] is None:
            versions["driver"], sources["driver"] = header.group(1), "npu-smi info"
    if versions["driver"] is None:
        sources["driver"] = f"no {ASCEND_ROOT}/driver/version.info" + ("" if smi else ", no npu-smi")

    versions["firmware"] = _info_value(read_text(f"{ASCEND_ROOT}/firmware/version.info"), "Version")
    sources["firmware"] = f"{ASCEND_ROOT}/firmware/version.info"
    versions["sources"] = sources
    return versions


def version_matches(spec: str, version: str) -> bool:
    """True when `spec` equals `version` or is a dotted prefix of it ("3.11" matches 3.11.7), ignoring case."""
    spec, version = str(spec).lower(), str(version).lower()
    return version == spec or version.startswith(spec + ".")


def version_tuple(version: str) -> tuple:
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


def row_text(row: dict) -> str:
    return " + ".join(f"{k} {v}" for k, v in row.items() if k not in ("name", "device"))
