"""A CANN-shaped tree of no-op libraries, so that MindSpore's DryRun compiles Ascend graphs on a machine without CANN.

With `MS_SIMULATION_LEVEL` set, MindSpore 2.9 replaces the ACL runtime, model, op-compiler, data-channel and
profiling calls by its own stubs (no aclInit, no driver, dummy communication groups, aclnn launches skipped:
mindspore/utils/dryrun.py). What it still needs from CANN is that the dynamic linker resolves the symbols of its
Ascend plugin. This module generates that: one C file defining every symbol the wheel's Ascend plugin libraries
import and no library of the wheel or of the system defines (found with `nm -D`), or look up by name (`dlsym`
strings such as aclnnInit), each returning 0, compiled with gcc into the library names the plugin links.

It holds no logic. The only values that are not 0, and why MindSpore needs them:
- aclrtGetSocName returns an Atlas A2 SoC name: MindSpore picks 910B kernels and passes from it;
- ge::OperatorFactory::CreateOperator returns a ge::Operator (24 bytes: a vtable pointer and a shared_ptr) through
  the hidden return pointer: MindSpore's single-op kernel path calls it even in simulation, and the object must be
  zeroed for its destructor;
- compiler/version.info and <arch>-linux/ascend_toolkit_install.info name the CANN release MindSpore 2.9 was built
  against (9.0.0), which MindSpore's and the launcher's version checks read;
- python/site-packages/hccl/sys_version.py: `mindspore.communication.init()` imports it;
- the tree's root ends in `latest`: MindSpore derives the CANN root from the folder libascendcl.so was loaded
  from and looks for that component.

Nothing the stubs return is a measurement: an aclnn workspace is 0 bytes, a collective moves nothing. What the
DryRun shows is MindSpore's own compile: strategies, communication groups, stage placement, and the memory of the
tensors its compiler plans (a lower bound, without kernel workspaces).

    python -m ascend_llm_recipes.training.tools.simulated_cann DIR     # builds it, prints the variables to export
    eval "$(python -m ascend_llm_recipes.training.tools.simulated_cann DIR --print-env)"    # exports them
"""

import argparse
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

from ascend_llm_recipes.common.errors import LaunchError, PretrainError
from ascend_llm_recipes.common.files import write_atomic

CANN_VERSION = "9.0.0"  # mindspore/lib/plugin/ascend/custom_ascendc_910b/version.info: custom_opp_compiler_version
SOC_NAME = "Ascend910B1"
# The libraries MindSpore's Ascend plugin links (DT_NEEDED) or opens by name; each gets the same no-op symbols.
LIBRARIES = ("ascendcl", "ge_runner", "graph", "msprofiler", "hccl", "atb", "ascend_hal", "opapi", "nnopbase",
             "runtime", "acl_op_compiler", "profapi", "platform", "c_sec", "register", "exe_graph", "mmpa",
             "ascendalog", "acl_dvpp", "acl_dvpp_op", "acl_dvpp_mpi", "acl_tdt_channel", "acl_tdt_queue",
             "unified_dlog", "tiling_api")
# Names the plugin looks up with dlsym at run time, so they are strings in it rather than undefined symbols.
_DLSYM_NAME = re.compile(r"(acl|hccl|Hccl|rt|hal|Msprof|aclnn|acltdt|aclprof|mstx|atb)[A-Za-z0-9_]{2,80}")
# Symbols of the interpreter, of the C++ runtime's thread-local helpers, and of MindSpore itself are never CANN's.
_NOT_CANN = re.compile(r"^(Py|_Py|_ITM|__gmon|_Jv_|_ZTH|__morestack|_ZN9mindspore|_ZNK9mindspore)")
_SYSTEM_LIBRARIES = ("libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libz.so.1", "libgomp.so.1",
                     "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1")
_CREATE_OPERATOR = ("_ZN2ge15OperatorFactory14CreateOperatorEPKcS2_",
                    "_ZN2ge15OperatorFactory14CreateOperatorERKSsS2_")


def missing_tools() -> str:
    """What this machine lacks to build the tree ('' when nothing): gcc and binutils' nm and strings."""
    absent = [tool for tool in ("gcc", "nm", "strings") if shutil.which(tool) is None]
    return f"needs {' and '.join(absent)} (e.g. apt-get install gcc binutils)" if absent else ""


def _mindspore_dir() -> str:
    import importlib.util
    return importlib.util.find_spec("mindspore").submodule_search_locations[0]


def _is_elf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def _symbols(paths: list, which: str) -> set:
    """Dynamic symbols of `paths` (`which`: --defined-only or --undefined-only), without version suffixes."""
    found = set()
    for start in range(0, len(paths), 64):
        out = subprocess.run(["nm", "-D", which, *paths[start:start + 64]], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if parts and not line.endswith(":"):
                found.add(parts[-1].split("@")[0])
    return found


def _system_library_paths() -> list:
    dirs = ("/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/lib")
    return [os.path.join(d, name) for name in _SYSTEM_LIBRARIES for d in dirs if os.path.exists(os.path.join(d, name))]


def stub_symbols(mindspore_dir: str = None) -> list:
    """Every symbol the wheel's Ascend plugin needs from CANN, sorted."""
    lib = os.path.join(mindspore_dir or _mindspore_dir(), "lib")
    libraries = [os.path.join(root, name) for root, _, names in os.walk(lib) for name in names
                 if ".so" in name and not os.path.islink(os.path.join(root, name))]
    libraries = [p for p in libraries if _is_elf(p)]
    plugin = [p for p in libraries if ("plugin" in p or "ge_backend" in p) and "gpu" not in p]
    needed = _symbols(plugin, "--undefined-only")
    for path in plugin:
        strings = subprocess.run(["strings", "-n", "5", path], capture_output=True, text=True, errors="replace")
        needed |= {line for line in strings.stdout.splitlines() if _DLSYM_NAME.fullmatch(line)}
    defined = _symbols(libraries + _system_library_paths(), "--defined-only")
    return sorted(s for s in needed - defined if not _NOT_CANN.match(s))


def stub_source(symbols: list, soc_name: str = SOC_NAME) -> str:
    """C source defining each symbol: `return 0`, except the two values named in the module's docstring."""
    lines = ["#include <string.h>"]
    for i, name in enumerate(symbols):
        if name == "aclrtGetSocName":
            lines.append(f'const char *f{i}(void) __asm__("{name}"); const char *f{i}(void) {{ return "{soc_name}"; }}')
        elif name in _CREATE_OPERATOR:
            lines.append(f'void *f{i}(void *r) __asm__("{name}"); void *f{i}(void *r) {{ memset(r, 0, 24); return r; }}')
        else:
            lines.append(f'long f{i}(void) __asm__("{name}"); long f{i}(void) {{ return 0; }}')
    return "\n".join(lines) + "\n"


def environment(root: str) -> dict:
    """The variables a process needs to load the tree at `root` (as CANN's set_env.sh sets them)."""
    home = os.path.join(root, "latest")
    return {"ASCEND_HOME_PATH": home, "ASCEND_OPP_PATH": os.path.join(home, "opp"),
            "LD_LIBRARY_PATH": os.path.join(home, "lib64"),
            "PYTHONPATH": os.path.join(home, "python", "site-packages")}


SEARCH_PATHS = ("LD_LIBRARY_PATH", "PYTHONPATH")  # prepended to, not replaced


def merged_environment(root: str, env: dict = None) -> dict:
    """`env` (default os.environ) with the tree's variables; SEARCH_PATHS keep what they held after the tree's."""
    merged = dict(os.environ if env is None else env)
    for key, value in environment(root).items():
        merged[key] = os.pathsep.join(filter(None, [value, merged.get(key)])) if key in SEARCH_PATHS else value
    return merged


def build(root: str, soc_name: str = SOC_NAME) -> str:
    """Write the tree to `root` (which must not exist; it appears whole or not at all) and return it."""
    missing = missing_tools()
    if missing:
        raise LaunchError(f"cannot build a simulated CANN: {missing}")
    if os.path.exists(root):
        raise LaunchError(f"{root}: exists already", hint="name a new folder, or use the tree that is there")
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".simulated-cann-", dir=parent)
    try:
        home = os.path.join(work, "latest")
        for sub in ("lib64", "opp", "compiler", f"{platform.machine()}-linux", "python/site-packages/hccl"):
            os.makedirs(os.path.join(home, sub))
        source = os.path.join(work, "stub.c")
        write_atomic(source, stub_source(stub_symbols(), soc_name), fsync=False)
        obj = os.path.join(work, "stub.o")
        subprocess.run(["gcc", "-c", "-fPIC", "-O0", "-o", obj, source], check=True)
        for name in LIBRARIES:
            subprocess.run(["gcc", "-shared", "-o", os.path.join(home, "lib64", f"lib{name}.so"), obj,
                            f"-Wl,-soname,lib{name}.so"], check=True)
        os.remove(obj)
        write_atomic(os.path.join(home, "compiler", "version.info"), f"Version={CANN_VERSION}\n")
        write_atomic(os.path.join(home, f"{platform.machine()}-linux", "ascend_toolkit_install.info"),
               f"version={CANN_VERSION}\n")
        write_atomic(os.path.join(home, "python", "site-packages", "hccl", "__init__.py"), "")
        write_atomic(os.path.join(home, "python", "site-packages", "hccl", "sys_version.py"),
               f'__sys_version__ = "{CANN_VERSION}"\n')
        try:
            os.rename(work, root)
        except OSError:
            if not os.path.isdir(os.path.join(root, "latest", "lib64")):
                raise
            shutil.rmtree(work, ignore_errors=True)  # another process built the same tree meanwhile: use it
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return root


def cached(cache_dir: str = None) -> str:
    """A tree for the installed MindSpore wheel, built once per wheel under `cache_dir` (~/.cache by default)."""
    import mindspore
    base = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "ascend_llm_recipes", "simulated_cann")
    plugin = os.path.join(_mindspore_dir(), "lib", "plugin", "libmindspore_ascend.so.2")
    key = hashlib.sha256(f"{mindspore.__version__}:{os.path.getsize(plugin)}:{os.path.getmtime(plugin)}".encode())
    root = os.path.join(base, f"{mindspore.__version__}-{key.hexdigest()[:12]}")
    if not os.path.isdir(root):
        try:
            build(root)
        except (LaunchError, OSError):
            if not os.path.isdir(root):  # unless another process built it first
                raise
    return root


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ascend_llm_recipes.training.tools.simulated_cann",
                                     description="Build a simulated CANN (no-op libraries) so that `--check --dry-run` "
                                                 "compiles Ascend recipes on a host without CANN.")
    parser.add_argument("dir", help="folder to create (must not exist), or an existing tree with --print-env")
    parser.add_argument("--soc", default=SOC_NAME, help=f"SoC name the runtime reports (default {SOC_NAME})")
    parser.add_argument("--print-env", action="store_true", help="only print the export line of an existing tree")
    args = parser.parse_args(argv)
    try:
        if not args.print_env:
            build(args.dir, args.soc)
        elif not os.path.isdir(os.path.join(args.dir, "latest", "lib64")):
            raise PretrainError(f"{args.dir}: not a simulated CANN tree",
                                hint=f"build one in a new folder: {parser.prog} NEW_DIR")
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: nothing was written to {args.dir}", file=sys.stderr)
        return 130
    except (OSError, subprocess.CalledProcessError) as err:  # a full disk, a read-only or missing parent, a file
        print(f"error: cannot build a simulated CANN at {args.dir}: {err}\n---> HINT: name a new folder where you "
              "can write, with ~20 MB free; nothing was left there", file=sys.stderr)
        return 2
    env = merged_environment(os.path.abspath(args.dir))
    print("export " + " ".join(f"{k}={shlex.quote(env[k])}" for k in environment(args.dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
