"""Shared fixtures: a tiny real dataset (shipped stdlib text, real sentencepiece, real MindRecord)."""

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from clusters import RayCluster, SlurmCluster
from netns import netns_nodes  # noqa: F401 (a fixture: network-namespace "nodes" for the multi-node tests)

# Importing MindFormers creates ./output/log unless told where to log; keep the checkout clean.
os.environ.setdefault("LOCAL_DEFAULT_PATH", tempfile.mkdtemp(prefix="mindformers-log-"))
# Under pytest-xdist (-n 2 on 2 cores) each worker gets one OpenMP thread, read by torch and oneDNN at import and
# inherited by the training workers it launches (training/launcher/cluster.py keeps a value already set): two
# workers with two threads each spin against each other on two cores (the suite took 1.6x its CPU time so).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_RECIPE = os.path.join(REPO_ROOT, "recipes", "tiny_cpu.yaml")
MEGATRON_GENERATOR = os.path.join(REPO_ROOT, "tests", "make_megatron_fixtures.py")
# The tiny dataset's text, shipped so that it is the same on every machine (tests/data/README.md): the first 60
# modules of CPython 3.11.7's standard library, one file one document, named NN-<path>.txt to keep their order.
TINY_CORPUS = os.path.join(REPO_ROOT, "tests", "data", "tiny_corpus")
DP2_RECIPE = os.path.join(REPO_ROOT, "recipes", "tiny_dp2_cpu.yaml")
MOE_RECIPE = os.path.join(REPO_ROOT, "recipes", "tiny_moe_cpu.yaml")
DP_STEPS = 8  # data_parallel_runs
DP_SAVE_STEPS = 4  # data_parallel_runs save at steps 4 and 8 (the recipes keep 2): the resume drills start from step 4
DEMO_RECIPE = os.path.join(REPO_ROOT, "recipes", "demo_cpu.yaml")
# Mistral-7B's tokenizer.model.v1, shipped in the Apache-2.0 package mistral-common (test extra; only this data
# file is read): 32,000 pieces, unk 0, bos 1, eos 2 and no pad id, the layout of Llama 2's tokenizer.
LLAMA2_LAYOUT_SP_MODEL = os.path.join(importlib.util.find_spec("mistral_common").submodule_search_locations[0],
                                      "data", "tokenizer.model.v1")


# Fixtures that are process drills themselves (a minute or more of real multi-process runs to set up): every test
# that needs one, directly or through another fixture, is marked `drill` (setup.cfg) by pytest_collection_modifyitems.
DRILL_FIXTURES = {"data_parallel_runs", "megatron_dir", "slurm_run", "dense_readback", "moe_readback"}


# With pytest-xdist (`-n 2 --dist loadgroup`, the README's command) each worker process builds its own session and
# module fixtures: a test module and every module sharing one of these session fixtures with it form one group,
# which xdist runs in one worker, so each fixture and cluster is built once.
SHARED_FIXTURES = ("data_parallel_runs", "megatron_dir", "slurm_cluster", "ray_cluster", "tiny_run",
                   "dense_readback", "moe_readback")


@pytest.hookimpl(tryfirst=True)  # xdist's own hook reads the groups: ours must run before it
def pytest_collection_modifyitems(items):
    for item in items:
        if DRILL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.drill)
    # the groups: connected sets of modules and shared fixtures (union-find over their names)
    parent = {}

    def root(name):
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    for item in items:
        for fixture in set(getattr(item, "fixturenames", ())) & set(SHARED_FIXTURES):
            parent[root(fixture)] = root(item.module.__name__)
    groups = {}
    for item in items:
        groups.setdefault(root(item.module.__name__), []).append(item)
    # the longest groups first (xdist hands them out in this order): drills weigh most, then the count of tests
    order = sorted(groups.values(), key=lambda group: (-sum(bool(i.get_closest_marker("drill")) for i in group),
                                                       -len(group)))
    items[:] = [item for group in order for item in group]
    for group in order:
        name = "+".join(sorted({item.module.__name__ for item in group}))
        for item in group:
            item.add_marker(pytest.mark.xdist_group(name))


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # keep the order above (xdist would sort groups by test count)
        config.option.loadscopereorder = False


def load_script(name: str):
    """scripts/NAME.py as a module (scripts/ is not a package), to call its main() in the test process.

    scripts/ goes on sys.path (last, shadowing nothing), as it is first when a script in it runs: the scripts
    import their shared modules (torch_peer, benchmark_training) by name.
    """
    import importlib.util
    import sys

    if os.path.join(REPO_ROOT, "scripts") not in sys.path:
        sys.path.append(os.path.join(REPO_ROOT, "scripts"))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, "scripts", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def tiny_corpus_files() -> list:
    """TINY_CORPUS's files in the order the data pipeline reads them."""
    return sorted(os.path.join(TINY_CORPUS, name) for name in os.listdir(TINY_CORPUS))


def prepare_tiny_dataset(out: str) -> None:
    """The tiny recipe's dataset (its seq_length, vocab_size and max_documents) built from TINY_CORPUS into OUT."""
    from ascend_llm_recipes.data.prepare import prepare_dataset
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    recipe = load_recipe(TINY_RECIPE)
    prepare_dataset(out, recipe.model.model_config.seq_length, recipe.data_preparation.vocab_size,
                    inputs=[TINY_CORPUS], max_documents=recipe.data_preparation.max_documents, show_progress=False)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """The tiny recipe's dataset, prepared once per test session from the shipped TINY_CORPUS."""
    out = str(tmp_path_factory.mktemp("data") / "tiny")
    prepare_tiny_dataset(out)
    return out


def data_parallel_settings(run_dir: str, dataset: str) -> list:
    """data_parallel_runs' settings (either recipe): its data order, DP_STEPS steps, a save every DP_SAVE_STEPS."""
    return [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={dataset}",
            "train_dataset.data_loader.shuffle=False", f"runner_config.stop_step={DP_STEPS}",
            f"callbacks.1.save_checkpoint_steps={DP_SAVE_STEPS}"]


# The shared tiny run's saves (tiny_run): every 5 steps, the newest 3 kept (steps 10, 15 and 20 at the end).
TINY_RUN_SAVES = ("callbacks.1.save_checkpoint_steps=5", "callbacks.1.keep_checkpoint_max=3")


def tiny_run_extras(dataset: str) -> tuple:
    """The shared tiny run's other settings beyond the recipe and TINY_RUN_SAVES: held-out evaluation every 6 steps
    on 4 batches (20 is not a multiple: the run ends with an extra final evaluation), the profiler over steps 3-4,
    and the dataset as data_preparation's folder (the recipe's is relative: resolved in the working directory of
    each launch). A launch on that run directory passes them too, or it would be a launch with other settings."""
    return (f"data_preparation.output_dir={dataset}", "do_eval=True", "eval_step_interval=6",
            f"eval_dataset={{data_loader: {{dataset_dir: {dataset}}}, max_batches: 4}}",
            "profile={start_step: 3, stop_step: 4}")


def tiny_run_settings(run_dir: str, dataset: str) -> list:
    """The shared tiny run's settings (the --set values) for a launch or recipe on RUN_DIR: its own, so that only
    the keys a test adds change."""
    return [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={dataset}", *TINY_RUN_SAVES,
            *tiny_run_extras(dataset)]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_dataset):
    """One real 20-step run of the tiny recipe (TINY_RUN_SAVES, tiny_run_extras), launched from an empty working
    directory: (run dir, that directory). Read by the training tests and, as the uninterrupted baseline, by the
    checkpoint tests; a test that changes the run directory copies it first (shutil.copytree)."""
    from ascend_llm_recipes.training.launcher.cli import launch

    cwd = tmp_path_factory.mktemp("cwd")
    run_dir = str(tmp_path_factory.mktemp("runs") / "baseline")
    old = os.getcwd()
    os.chdir(cwd)
    try:
        code = launch(TINY_RECIPE, tiny_run_settings(run_dir, tiny_dataset), show_progress=False)
    finally:
        os.chdir(old)
    assert code == 0
    return run_dir, str(cwd)


@pytest.fixture(scope="session")
def data_parallel_runs(tmp_path_factory, tiny_dataset):
    """The tiny recipe trained DP_STEPS steps as one process and as two (tiny_dp2_cpu.yaml): (dp1 dir, dp2 dir).

    Shared by the data-parallel and the multi-node tests (both compare layouts against it). Each run also saved at
    step DP_SAVE_STEPS, which the resume drills start from (test_data_parallel.py interrupted_copy).
    """
    from ascend_llm_recipes.training.launcher.cli import launch

    one = str(tmp_path_factory.mktemp("dp") / "dp1")
    two = str(tmp_path_factory.mktemp("dp") / "dp2")
    assert launch(TINY_RECIPE, data_parallel_settings(one, tiny_dataset), show_progress=False) == 0
    assert launch(DP2_RECIPE, data_parallel_settings(two, tiny_dataset), show_progress=False) == 0
    return one, two


@pytest.fixture(scope="session")
def tiny_moe_run(tmp_path_factory, tiny_dataset):
    """recipes/tiny_moe_cpu.yaml as shipped, trained as one process on the tiny dataset: its run directory.

    Read by its golden-curve test (test_train.py) and, as the one-process reference, by the MoE data-parallel
    drill (test_data_parallel.py). Not in SHARED_FIXTURES: that would put those two modules' groups (tiny_run's,
    data_parallel_runs') in one xdist worker; a second worker needing it builds its own (~9 CPU-s).
    """
    from ascend_llm_recipes.training.launcher.cli import launch

    run_dir = str(tmp_path_factory.mktemp("runs") / "moe")
    assert launch(MOE_RECIPE, [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={tiny_dataset}"],
                  show_progress=False) == 0
    return run_dir


@pytest.fixture(scope="session")
def megatron_dir(tmp_path_factory):
    """Every layout of tests/make_megatron_fixtures.py, written once per session by megatron-core in 4 ranks (forked
    after one import): tests/test_megatron.py and tests/test_megatron_moe.py read them."""
    out = tmp_path_factory.mktemp("megatron")
    command = [sys.executable, MEGATRON_GENERATOR, str(out), "--processes", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # its own process group: a timeout kills the ranks too, not only the process that forked them
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:  # a failed torch_dist writer hangs its parent instead of exiting
        _, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"megatron fixture generation timed out after 240 s:\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-5000:]
    return out


@pytest.fixture(scope="session")
def llama2_hf_tokenizer(tmp_path_factory):
    """An HF tokenizer directory made by transformers' slow-to-fast conversion of LLAMA2_LAYOUT_SP_MODEL, as
    `save_pretrained` writes it: Llama 2's own layout (legacy normalizer: prepend and replace the space by
    U+2581, the sentencepiece model's add_dummy_prefix)."""
    from transformers import LlamaTokenizerFast

    out = tmp_path_factory.mktemp("hf_tokenizer")
    LlamaTokenizerFast(vocab_file=LLAMA2_LAYOUT_SP_MODEL, legacy=True, add_prefix_space=True,
                       from_slow=True).save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A one-node Slurm cluster on this machine (tests/clusters.py), started on first use, stopped at session end."""
    missing = SlurmCluster.missing_programs()
    if missing:
        pytest.skip(f"no {', '.join(missing)}: the Slurm test cluster needs `apt-get install slurm-wlm munge` "
                    "(.ci/run tries it)")
    if os.geteuid() != 0:
        pytest.skip("the Slurm test cluster runs slurmd, which must be root to start jobs")
    cluster = SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        left = cluster.stop()
    assert not left, f"the Slurm test cluster left processes behind (killed): {left}"


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray head on 127.0.0.1 (tests/clusters.py), started on first use, stopped at session end."""
    pytest.importorskip("ray", reason="ray is not installed: pip install -e .[scale]")
    cluster = RayCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        left = cluster.stop()
    assert not left, f"the Ray test cluster left processes behind (killed): {left}"
