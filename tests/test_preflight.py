"""Preflight on this machine: real versions, sockets, processes, limits and disk; no mocks."""

import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import yaml

from conftest import DEMO_RECIPE, REPO_ROOT, TINY_RECIPE
from ascend_llm_recipes.training.launcher.preflight import (MIN_MAX_MAP_COUNT, check_device, check_disk, check_hccl,
                                                            check_leftover_processes, check_master_port,
                                                            check_max_map_count, check_memlock, check_model,
                                                            check_versions,
                                                            check_writable_dir, checkpoint_bytes, format_findings,
                                                            has_errors, hccl_env, run_checks, training_processes,
                                                            visible_npus, write_findings)
from ascend_llm_recipes.training.launcher.versions import installed_versions, load_table
from ascend_llm_recipes.common.errors import LaunchError, PretrainError
from ascend_llm_recipes.training.recipe.loading import load_recipe


@pytest.fixture(scope="module")
def installed():
    return installed_versions()


@pytest.fixture(scope="module")
def table():
    return load_table()


def version_map():
    import importlib.util
    folder = importlib.util.find_spec("mindformers").submodule_search_locations[0]
    with open(os.path.join(folder, "VERSION_MAP.json"), encoding="utf-8") as f:
        return json.load(f)


def test_pinned_stack_is_supported(installed, table):
    assert installed["mindspore"] == importlib.metadata.version("mindspore")
    assert installed["mindformers"] == importlib.metadata.version("mindformers")
    findings = check_versions(installed, table, "CPU")
    assert [f.level for f in findings] == ["ok"], format_findings(findings)
    assert f"mindspore {installed['mindspore']}" in findings[0].message
    assert "supported (pinned CPU stack)" in findings[0].message


def test_table_agrees_with_installed_version_map():
    own = load_table(version_map=None)
    pairs = {r["when"]["mindformers"]: r["requires"]["mindspore"] for r in own["known_bad"]
             if "mindformers" in r["when"]}
    assert pairs == {mf: entry["support"] for mf, entry in version_map()["mf"].items()}


def test_mindformers_with_other_mindspore_is_refused(installed, table):
    findings = check_versions(dict(installed, mindspore="2.7.2"), table, "CPU")
    assert [f.level for f in findings] == ["error"]
    assert "known-bad combination: mindformers 1.9.0 with mindspore 2.7.2" in findings[0].message
    assert "VERSION_MAP.json" in findings[0].message and "Install mindspore 2.9.0" in findings[0].message


def test_installed_version_map_covers_releases_the_table_omits(installed, tmp_path):
    bare = tmp_path / "supported.yaml"
    bare.write_text(yaml.safe_dump({"supported": [], "known_bad": []}))
    findings = check_versions(dict(installed, mindformers="1.8.0"), load_table(str(bare)), "CPU")
    assert [f.level for f in findings] == ["error"]
    assert "MindFormers 1.8.0 supports MindSpore 2.7.2" in findings[0].message


def test_cann_outside_mindspores_own_list_is_refused(installed, table):
    ascend = dict(installed, cann="8.0.0", driver="26.0.RC1")
    findings = check_versions(ascend, table, "Ascend")
    assert [f.level for f in findings] == ["error"]
    assert "mindspore 2.9.0 with cann 8.0.0" in findings[0].message


def test_cann_accepted_but_unpublished_warns(installed, table):
    findings = check_versions(dict(installed, cann="8.5.0", driver="25.5.0"), table, "Ascend")
    assert [f.level for f in findings] == ["warn"]
    assert "untested combination" in findings[0].message and "cann 8.5.0 (row: 9.0.0)" in findings[0].message
    published = check_versions(dict(installed, cann="9.0.0", driver="26.0.rc1"), table, "Ascend")
    assert [f.level for f in published] == ["ok"], format_findings(published)


def test_firmware_outside_driver_range_is_refused(installed, table):
    stack = dict(installed, cann="9.0.0", driver="26.0.RC1", firmware="7.7.0.9.220", firmware_range="7.0.0,7.5.99")
    findings = check_versions(stack, table, "Ascend")
    assert [f.level for f in findings] == ["error"]
    assert "firmware 7.7.0.9.220 is outside the range driver 26.0.RC1 declares" in findings[0].message


def test_unknown_python_warns(installed, table):
    findings = check_versions(dict(installed, python="3.12.4"), table, "CPU")
    assert [f.level for f in findings] == ["warn"]
    assert "python 3.12.4 (row: 3.11)" in findings[0].message


def test_unquoted_version_in_table_is_rejected(tmp_path):
    bad = tmp_path / "supported.yaml"
    bad.write_text("supported:\n  - {name: x, device: CPU, python: 3.10}\nknown_bad: []\n")
    with pytest.raises(LaunchError, match=r"supported.0.python: 3.1 must be a quoted string"):
        load_table(str(bad), version_map=None)


@pytest.mark.skipif(bool(visible_npus() or shutil.which("npu-smi")), reason="this machine has an NPU")
def test_ascend_without_npu_is_refused():
    recipe = load_recipe(TINY_RECIPE, ("context.device_target=Ascend",))
    findings = check_device(recipe)
    assert [f.level for f in findings] == ["error"]
    assert "no NPU is visible" in findings[0].message and "recipes/tiny_cpu.yaml trains on CPU" in findings[0].message
    assert [f.level for f in check_device(load_recipe(TINY_RECIPE))] == ["ok"]


@pytest.mark.parametrize("name", ["qwen3_30b_a3b_16dev", "mixtral_8x7b_64dev"])
def test_ascend_moe_recipes_plan_and_are_what_mindformers_moe_layer_is_built_from(name):
    from ascend_llm_recipes.training.recipe.mindformers_mcore_export import moe_transformer_config
    from ascend_llm_recipes.training.tools.planner import plan

    path = os.path.join(REPO_ROOT, "recipes", f"{name}.yaml")
    recipe = load_recipe(path, planning=True)
    assert plan(recipe).fits and check_model(recipe) == []
    # what the worker builds on Ascend (training/recipe/mindformers.py model_layout): no key refused
    tc = moe_transformer_config(recipe, path)
    p = recipe.parallel_config
    assert (tc.expert_model_parallel_size, tc.data_parallel_size, tc.tensor_model_parallel_size) == (
        p.expert_parallel, p.data_parallel, p.model_parallel)
    assert tc.sequence_parallel == (p.model_parallel > 1)  # MindFormers' MoE layer: sequence parallel under TP


def test_what_mindformers_moe_layer_would_compute_otherwise_is_an_error_before_launch(tmp_path):
    recipe = load_recipe(os.path.join(REPO_ROOT, "recipes", "tiny_moe_ascend.yaml"),
                         [f"output_dir={tmp_path}", "model.model_config.router_z_loss_coef=0.001",
                          "runner_config.gradient_accumulation_steps=2", "model.model_config.capacity_factor=1.25"],
                         planning=True)
    errors = [f.message for f in check_model(recipe) if f.level == "error"]
    # several forward passes per step (accumulation 2) balance the load as MindFormers' gbs_aux_loss: not refused
    assert [m.split(":")[0] for m in errors] == ["model.model_config.router_z_loss_coef",
                                                  "model.model_config.capacity_factor"]
    assert all(m.endswith("(on Ascend the MoE layers are MindFormers 1.9's MoELayer)") for m in errors)


def test_deepseek_v3_recipe_plans_and_its_model_passes_the_launch_checks(tmp_path, capsys):
    """Multi-head latent attention runs on Ascend (models/mla.py on FlashAttention), and nothing of DeepSeek-V3's MoE
    layers computes otherwise in MindFormers' MoELayer: the launch checks name only what this machine lacks."""
    from ascend_llm_recipes.training.launcher.cli import launch
    from ascend_llm_recipes.training.tools.planner import plan

    path = os.path.join(REPO_ROOT, "recipes", "deepseek_v3_256dev.yaml")
    recipe = load_recipe(path, planning=True)
    assert plan(recipe).fits and recipe.model.model_config.use_flash_attention
    assert check_model(recipe) == []
    nodes = recipe.world_size // recipe.hardware.devices_per_node
    assert launch(path, (f"output_dir={tmp_path}",), nodes=nodes, node_rank=0, master_addr="127.0.0.1",
                  dry_run=True) == 2  # no CANN, no NPU here
    out = capsys.readouterr().out
    assert "ERROR model" not in out and "ERROR device" in out
    # what MindFormers' DeepSeek-V3 router computes otherwise is still named: its group score is the best
    # num_experts_per_tok // topk_group experts of a group (router.py:336-338), ours the best two
    other = load_recipe(path, ["model.model_config.topk_group=8"], planning=True)
    assert [f.message.split(":")[0] for f in check_model(other)] == ["model.model_config.topk_group"]
    assert check_model(load_recipe(os.path.join(REPO_ROOT, "recipes", "tiny_deepseek_cpu.yaml"))) == []


def test_hccl_values_from_recipe_and_defaults():
    assert hccl_env(load_recipe(TINY_RECIPE)) == {"HCCL_CONNECT_TIMEOUT": "1200", "HCCL_EXEC_TIMEOUT": "1836",
                                                  "HCCL_BUFFSIZE": "200"}
    recipe = load_recipe(TINY_RECIPE, ("hccl.connect_timeout=300",))
    assert hccl_env(recipe)["HCCL_CONNECT_TIMEOUT"] == "300"
    findings = check_hccl(recipe, env={"HCCL_CONNECT_TIMEOUT": "300"})
    assert [f.level for f in findings] == ["ok"] and "from recipe hccl.connect_timeout" in findings[0].message


def test_hccl_environment_that_differs_warns_and_bad_value_is_refused():
    findings = check_hccl(load_recipe(TINY_RECIPE), env={"HCCL_EXEC_TIMEOUT": "600", "HCCL_BUFFSIZE": "200"})
    assert [f.level for f in findings] == ["warn"]
    assert "HCCL_EXEC_TIMEOUT=600 in your environment" in findings[0].message
    assert "exports HCCL_EXEC_TIMEOUT=1836" in findings[0].message
    findings = check_hccl(load_recipe(TINY_RECIPE, ("hccl.connect_timeout=60",)), env={})
    assert [f.level for f in findings] == ["error"] and "[120, 7200]" in findings[0].message


def test_environment_is_the_one_the_user_exported():
    """Importing MindSpore sets HCCL_CONNECT_TIMEOUT=600; that is not the user's setting."""
    code = ("import os, mindspore; from ascend_llm_recipes.training.launcher.versions import launch_environment; "
            "print(os.environ.get('HCCL_CONNECT_TIMEOUT'), launch_environment().get('HCCL_CONNECT_TIMEOUT'))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HCCL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         check=True).stdout.split()
    assert out[-2:] == ["600", "None"]


def test_limits_are_read_from_this_machine():
    with open("/proc/sys/vm/max_map_count") as f:
        value = int(f.read())
    [finding] = check_max_map_count()
    assert finding.level == ("ok" if value >= MIN_MAX_MAP_COUNT else "warn")
    assert str(value) in finding.message
    if finding.level == "warn":
        assert f"sysctl -w vm.max_map_count={MIN_MAX_MAP_COUNT}" in finding.message
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    [finding] = check_memlock("Ascend")
    assert finding.level == ("ok" if soft == resource.RLIM_INFINITY else "warn")
    if finding.level == "warn":
        assert "ulimit -l" in finding.message and "memlock" in finding.message


def test_busy_master_port_is_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        findings = check_master_port(port)
        assert [f.level for f in findings] == ["error"]
        assert f"master port {port} is in use" in findings[0].message and "choose another" in findings[0].message
    assert [f.level for f in check_master_port(port)] == ["ok"]


def test_leftover_training_process_is_named(tmp_path):
    run_dir = str(tmp_path / "run")
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "scripts/train.py", "--run-dir",
                               run_dir])
    try:
        deadline = time.time() + 10
        while worker.pid not in [pid for pid, _ in training_processes()] and time.time() < deadline:
            time.sleep(0.05)  # until the child has exec'd and /proc shows its own command line
        warnings = [f for f in check_leftover_processes() if f.data.get("pid") == worker.pid]
        assert [f.level for f in warnings] == ["warn"]
        assert f"process {worker.pid} is still running" in warnings[0].message
        assert "scripts/train.py" in warnings[0].message and f"kill {worker.pid}" in warnings[0].message
        # The same run directory's previous launch, still stopping: not "another run", and not to be killed.
        own = [f for f in check_leftover_processes(run_dir) if f.data.get("pid") == worker.pid]
        assert "previous launch, still stopping" in own[0].message and f"kill {worker.pid}" not in own[0].message
    finally:
        worker.kill()
        worker.wait()
    assert worker.pid not in [pid for pid, _ in training_processes()]


def test_own_process_is_not_a_leftover():
    code = ("import os; from ascend_llm_recipes.training.launcher.preflight import training_processes; "
            "print(os.getpid(), training_processes())")
    out = subprocess.run([sys.executable, "-c", code, "scripts/train.py"], capture_output=True, text=True,
                         cwd=REPO_ROOT, timeout=60, check=True).stdout
    pid, found = out.split(" ", 1)
    assert f"({pid}," not in found


def test_checkpoints_that_do_not_fit_are_refused(tmp_path):
    recipe = load_recipe(TINY_RECIPE, ("model.model_config.hidden_size=1048576", f"output_dir={tmp_path}/run"))
    free = shutil.disk_usage(tmp_path).free
    assert checkpoint_bytes(recipe) * 2 > free  # keep_checkpoint_max 2 in tiny_cpu.yaml
    [finding] = check_disk(recipe)
    assert finding.level == "error"
    assert "checkpoints will not fit" in finding.message and str(tmp_path) in finding.message
    assert finding.data["needed_bytes"] == checkpoint_bytes(recipe) * 2


def test_checkpoint_estimate_counts_weights_and_adamw_moments():
    recipe = load_recipe(DEMO_RECIPE)
    # the parameter count in the recipe's header x (fp32 weight + two fp32 moments), + the optimizer's step and
    # the loss scale (8 B)
    assert checkpoint_bytes(recipe) == 4_212_992 * 12 + 8


def test_findings_are_written_to_the_run_directory(tmp_path):
    recipe = load_recipe(TINY_RECIPE, (f"output_dir={tmp_path}/run",))
    findings = run_checks(recipe, run_dir=str(tmp_path / "run"))
    assert {f.check for f in findings} >= {"versions", "device", "hccl", "memlock", "max_map_count",
                                           "master_port", "processes", "output_dir", "disk"}
    assert not has_errors(findings), format_findings(findings)
    json_path, txt_path = write_findings(findings, str(tmp_path / "run"))
    with open(json_path) as f:
        record = json.load(f)
    assert len(record["findings"]) == len(findings) and record["errors"] == 0
    versions = next(f for f in record["findings"] if f["check"] == "versions")
    assert versions["data"]["mindspore"] == importlib.metadata.version("mindspore")
    with open(txt_path) as f:
        assert f.read() == format_findings(findings) + "\n"


@pytest.mark.parametrize("command", [
    ["bash", "scripts/run_distributed.sh", TINY_RECIPE, "--set", "output_dir={out}"],
    [sys.executable, "scripts/prepare_data.py", "--output", "{out}", "--seq-length", "64"],
    [sys.executable, "scripts/convert_checkpoint.py", "--from-hf", "{out}-hf", "--output", "{out}"],
], ids=["launcher", "prepare_data", "convert_checkpoint"])
def test_output_under_a_file_is_refused_before_anything_starts(tmp_path, command):
    (tmp_path / "file").write_text("not a directory\n")
    out = tmp_path / "file" / "out"
    result = subprocess.run([a.format(out=out) for a in command], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    key = "output_dir" if "run_distributed" in command[1] else "--output"
    assert f"{key}: {out} cannot be created: {tmp_path / 'file'} is a file, not a directory" in result.stderr + \
        result.stdout
    assert "Traceback" not in result.stderr
    assert (tmp_path / "file").read_text() == "not a directory\n"


def test_read_only_output_dir_is_refused_by_preflight(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only filesystem needs root (a chmod 0555 directory does not stop root)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    try:
        recipe = load_recipe(TINY_RECIPE, (f"output_dir={read_only}/run",))
        [finding] = [f for f in run_checks(recipe) if f.check == "output_dir"]
        assert finding.level == "error"
        assert f"output_dir: {read_only}/run is not writable: Read-only file system in {read_only}" \
            in finding.message
        with pytest.raises(PretrainError, match=r"--output: .*/ro/data is not writable: Read-only file system"):
            check_writable_dir(str(read_only / "data"), "--output")
    finally:
        subprocess.run(["umount", str(read_only)], check=True)


def test_more_loader_workers_than_cpus_is_an_error_naming_the_key():
    from ascend_llm_recipes.training.launcher.preflight import check_loader_workers

    recipe = load_recipe(TINY_RECIPE, ("train_dataset.num_parallel_workers=8",))
    [finding] = check_loader_workers(recipe, cpus=2)
    assert finding.level == "error" and finding.message.startswith(
        "train_dataset.num_parallel_workers: 8 exceeds this machine's 2 CPUs")
    assert "--set train_dataset.num_parallel_workers=2" in finding.message
    assert [f.level for f in check_loader_workers(recipe, cpus=8)] == ["ok"]


def test_optimizer_parallel_on_cpu_is_refused_by_key():
    from ascend_llm_recipes.common.errors import RecipeError

    with pytest.raises(RecipeError, match=r"parallel\.enable_parallel_optimizer: True on CPU: MindSpore's optimizer "
                                          "parallel runs on Ascend only"):
        load_recipe(TINY_RECIPE, ("parallel.enable_parallel_optimizer=True",))
