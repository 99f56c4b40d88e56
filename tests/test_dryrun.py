"""`--check --dry-run`: MindSpore's DryRun compiles the Ascend recipes on this CPU against a simulated CANN.

The simulated CANN (training/tools/simulated_cann.py) is generated from the installed wheel's symbols; what the tests
assert is what MindSpore's compiler produced (the compile went through, its memory pool's peak), never a value the
no-op libraries return.
"""

import ctypes
import os
import signal
import subprocess
import sys
import time

import pytest

from ascend_llm_recipes.training.tools import simulated_cann
from conftest import REPO_ROOT

LAUNCHER = os.path.join(REPO_ROOT, "scripts", "run_distributed.sh")
CANN_VARIABLES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")


def without_cann() -> dict:
    return {k: v for k, v in os.environ.items() if k not in CANN_VARIABLES}


@pytest.fixture(scope="session")
def simulated_cann_root():
    """The simulated CANN for the installed wheel (built once, ~15 s, under ~/.cache)."""
    missing = simulated_cann.missing_tools()
    if missing:
        pytest.skip(f"the simulated CANN {missing}")
    return simulated_cann.cached()


def test_check_dry_run_without_cann_says_in_one_line_how_to_get_one(tmp_path):
    result = subprocess.run(["bash", LAUNCHER, os.path.join(REPO_ROOT, "recipes", "llama2_70b_32dev.yaml"), "--check",
                             "--dry-run"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env=without_cann())
    lines = [line for line in result.stdout.splitlines() if line.startswith("dry-run:")]
    assert result.returncode == 2 and len(lines) == 1, result.stdout + result.stderr
    assert "needs CANN, and none is installed here" in lines[0]
    assert "python -m ascend_llm_recipes.training.tools.simulated_cann DIR" in lines[0]


def test_the_simulated_cann_is_shaped_like_cann_and_holds_no_logic(simulated_cann_root):
    home = os.path.join(simulated_cann_root, "latest")  # MindSpore finds the CANN root by this component
    for name in simulated_cann.LIBRARIES:
        assert os.path.isfile(os.path.join(home, "lib64", f"lib{name}.so"))
    from ascend_llm_recipes.training.launcher.versions import cann_version
    assert cann_version({"ASCEND_HOME_PATH": home})[0] == simulated_cann.CANN_VERSION
    acl = ctypes.CDLL(os.path.join(home, "lib64", "libascendcl.so"))
    acl.aclrtGetSocName.restype = ctypes.c_char_p
    assert acl.aclrtGetSocName() == simulated_cann.SOC_NAME.encode()
    assert acl.aclnnInit(None) == 0 and acl.aclrtMalloc(None, 1024, 0) == 0  # every other function returns 0


def test_the_stubs_cover_what_the_ascend_plugin_imports(simulated_cann_root):
    """Every library the wheel's Ascend plugin names and no package provides is in the tree (ldd finds them all)."""
    import importlib.util

    plugin = os.path.join(importlib.util.find_spec("mindspore").submodule_search_locations[0], "lib", "plugin",
                          "libmindspore_ascend.so.2")
    env = dict(os.environ, LD_LIBRARY_PATH=simulated_cann.environment(simulated_cann_root)["LD_LIBRARY_PATH"])
    linked = subprocess.run(["ldd", "-r", plugin], capture_output=True, text=True, env=env)
    # the interpreter's own symbols (Py*) resolve once Python loads the plugin
    unresolved = [line.strip() for line in (linked.stdout + linked.stderr).splitlines()
                  if "not found" in line or ("undefined symbol" in line and "undefined symbol: Py" not in line
                                             and "undefined symbol: _Py" not in line)]
    assert not unresolved, "\n".join(unresolved[:20])


def test_a_cpu_recipe_is_refused_for_a_dry_run(tmp_path):
    result = subprocess.run(["bash", LAUNCHER, os.path.join(REPO_ROOT, "recipes", "tiny_cpu.yaml"), "--check",
                             "--dry-run"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "context.device_target CPU: --dry-run compiles an Ascend recipe" in result.stderr


def test_building_the_simulated_cann_where_it_cannot_be_written_is_a_message(tmp_path):
    from ascend_llm_recipes.training.tools.simulated_cann import main

    (tmp_path / "afile").write_text("")
    assert main([str(tmp_path / "afile" / "cann")]) == 2
    assert main([str(tmp_path / "afile"), "--print-env"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing half-built left beside it


def test_dry_run_with_DRY_RUN_set_prints_the_compiles_and_runs_none(tmp_path):
    env = dict(without_cann(), DRY_RUN="1")
    result = subprocess.run(["bash", LAUNCHER, os.path.join(REPO_ROOT, "recipes", "tiny_ascend.yaml"), "--check",
                             "--dry-run", "--set", f"output_dir={tmp_path / 'run'}"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "DRY_RUN set: nothing compiled" in result.stdout
    assert "stage 0, rank 0: MS_SIMULATION_LEVEL=1 RANK_SIZE=8 RANK_ID=0 " in result.stdout
    assert not (tmp_path / "run").exists()


TINY_ASCEND = os.path.join(REPO_ROOT, "recipes", "tiny_ascend.yaml")
_DRIVER = """
import sys
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.tools.dryrun import dry_run_compile
sys.exit(dry_run_compile(load_recipe(sys.argv[1], (f"output_dir={sys.argv[2]}",), planning=True), sys.argv[1]))
"""


def _worker_pids(out) -> list:
    """The PIDs of processes running a dry-run compile under `out` (their command line names their run dir)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if b"--run-dir" in command and str(out).encode() in command:
            pids.append(int(pid))
    return pids


def test_dry_runs_of_one_output_dir_wait_for_none_and_die_with_their_launcher(tmp_path, simulated_cann_root):
    """A second dry run of the same output_dir is refused while one runs; kill -9 of the first stops its compile."""
    from ascend_llm_recipes.training.tools.dryrun import DRYRUN_DIR

    env = simulated_cann.merged_environment(simulated_cann_root,
                                            {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_")})
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-c", _DRIVER, TINY_ASCEND, str(out)], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while not _worker_pids(out / DRYRUN_DIR) and first.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        workers = _worker_pids(out / DRYRUN_DIR)
        assert workers, ("no compile started within 300 s" if first.poll() is None else
                         f"the dry run ended (exit {first.returncode}): {first.stdout.read().decode()[-2000:]}")
        second = subprocess.run(["bash", LAUNCHER, TINY_ASCEND, "--check", "--dry-run", "--set", f"output_dir={out}"],
                                capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert second.returncode == 2 and "is in use" in second.stderr, second.stdout + second.stderr
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        deadline = time.time() + 30
        while any(_alive(pid) for pid in workers) and time.time() < deadline:
            time.sleep(0.5)
        assert not [pid for pid in workers if _alive(pid)], "a compile outlived its launcher's kill -9"
    finally:
        first.kill()
        for pid in _worker_pids(out / DRYRUN_DIR):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_rank_killed_after_its_parallel_pass_says_the_simulated_step_ran_out_of_host_memory(tmp_path):
    """deepseek_v3_256dev at 2 layers, 12 GiB of host memory: the worker wrote its strategy file, then was killed
    (exit -9) while the simulated step allocated an unsharded [256, 2048, 7168] float32 on the host. The log's last
    line below is MindSpore 2.9's, verbatim from that run."""
    from ascend_llm_recipes.training.tools.dryrun import Compiled, after_compile

    (tmp_path / "strategy").mkdir()
    log = tmp_path / "worker.log"
    log.write_text("[WARNING] CORE(28462,7f23ff87db80,python):2026-12-04-04:35:56.262.597 "
                   "[mindspore/core/include/ir/tensor_data.h:565] data] Try to alloca a large memory, "
                   "size is:15032385536\n")
    result = Compiled(0, 0, 767.8, -9, str(tmp_path), str(log), None, 0)
    assert after_compile(result) == ""  # no strategy file: the failure may be the compile's own
    (tmp_path / "strategy" / "ckpt_strategy_rank_0.ckpt").write_bytes(b"")
    said = after_compile(result)
    assert "got through MindSpore's parallel pass" in said and "14.00 GiB at once: out of host memory" in said
    assert after_compile(Compiled(0, 0, 1.0, 1, str(tmp_path), str(log), None, 0)).endswith("simulated step failed")
