"""How long a run is: stop_step against the data, a rerun of a finished run, an amended schedule's learning rate,
integer keys MindSpore cannot hold, and checkpoints of other frameworks given to load_checkpoint (issue 39)."""

import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import typing

import pytest

from conftest import TINY_RECIPE, tiny_corpus_files
from ascend_llm_recipes.common.errors import DataError, LaunchError, RecipeError
from ascend_llm_recipes.training.launcher.cli import main
from ascend_llm_recipes.training.recipe.loading import load_recipe

SMALL_BATCH = 8  # the small dataset's 50 samples hold 6 global batches of 8


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, tiny_dataset):
    """50 samples (one stdlib module) with the tiny dataset's tokenizer: 6 steps of SMALL_BATCH per epoch."""
    from ascend_llm_recipes.data.prepare import prepare_dataset

    out = str(tmp_path_factory.mktemp("small") / "small")
    prepare_dataset(out, 64, inputs=tiny_corpus_files()[:1], tokenizer=os.path.join(tiny_dataset, "tokenizer.model"),
                    show_progress=False, workers=0)
    return out


def small_settings(run_dir, dataset, *extra) -> list:
    return [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={dataset}",
            f"runner_config.batch_size={SMALL_BATCH}", *extra]


def cli(settings, *flags) -> int:
    return main([TINY_RECIPE, *[a for s in settings for a in ("--set", s)], *flags])


@pytest.fixture(scope="module")
def every_epoch_run(tmp_path_factory, small_data):
    """The tiny recipe run with runner_config.stop_step 0 (every epoch) on the small dataset: 6 steps."""
    run_dir = str(tmp_path_factory.mktemp("runs") / "every_epoch")
    assert cli(small_settings(run_dir, small_data, "runner_config.stop_step=0")) == 0
    return run_dir


# D1: more steps than the data holds is refused before training, naming the count and the fix.

def test_stop_step_past_the_data_is_refused_at_check_and_at_launch(small_data, tmp_path, capsys):
    settings = small_settings(tmp_path / "run", small_data, "runner_config.stop_step=30")
    expected = (f"runner_config.stop_step: 30 is more steps than the training data holds: {small_data} gives 6 "
                f"global batches of 8 (50 samples x runner_config.epochs 1 x train_dataset.repeat 1); the run "
                "would end at step 6 with its learning rate schedule sized for 30 steps. To fix: set "
                "runner_config.stop_step to at most 6, or repeat the data: runner_config.epochs 5")
    assert cli(settings, "--check") == 2
    assert expected in capsys.readouterr().out
    assert cli(settings) == 2
    out, err = capsys.readouterr()
    assert expected in out and "nothing was started" in err
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
    # the same refusal where the dataset is first built (launch) and in every worker: check_datasets
    from ascend_llm_recipes.training.launcher.datasets import check_datasets
    with pytest.raises(DataError, match=re.escape(expected.split(". To fix")[0])):
        check_datasets(load_recipe(TINY_RECIPE, tuple(map(str, settings))))


def test_the_epochs_the_hint_names_hold_stop_step_as_the_loader_reads_them(small_data, tmp_path):
    from ascend_llm_recipes.data.loader import rank_samples
    from ascend_llm_recipes.training.launcher.datasets import data_steps, run_length_problem
    from ascend_llm_recipes.training.recipe.loader_spec import loader_spec

    for epochs, steps in ((1, 6), (4, 25), (5, 31)):
        recipe = load_recipe(TINY_RECIPE, tuple(small_settings(tmp_path, small_data, "runner_config.stop_step=30",
                                                                f"runner_config.epochs={epochs}")))
        _, ids, batch = rank_samples(loader_spec(recipe))
        assert data_steps(recipe) == len(ids) // batch == steps
        assert (run_length_problem(recipe) is None) == (steps >= 30)


# D2: the same command again after a run that used all its data.

def test_a_run_of_every_epoch_is_already_complete_when_rerun(every_epoch_run, small_data, capsys):
    with open(os.path.join(every_epoch_run, "metrics.jsonl"), encoding="utf-8") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4, 5, 6]
    assert cli(small_settings(every_epoch_run, small_data, "runner_config.stop_step=0")) == 0
    assert (f"{every_epoch_run} is already complete (step 6 of the 6 steps its data holds; runner_config.stop_step 0 "
            "runs every epoch); nothing to do") in capsys.readouterr().out


def test_a_longer_rerun_is_refused_until_the_data_repeats_then_continues(every_epoch_run, small_data, tmp_path,
                                                                         capsys):
    run_dir = str(tmp_path / "run")
    shutil.copytree(every_epoch_run, run_dir)
    assert cli(small_settings(run_dir, small_data, "runner_config.stop_step=12"), "--amend") == 2
    assert ("runner_config.stop_step: 12 is more steps than the training data holds" in capsys.readouterr().out)
    assert cli(small_settings(run_dir, small_data, "runner_config.stop_step=12", "runner_config.epochs=2"),
               "--amend") == 0
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, 13))


# D5: an amendment that re-sizes the schedule says what it does to the learning rate, and how to keep the schedule.

def test_schedule_lr_is_what_mindformers_schedules_compute(tmp_path):
    import mindspore as ms
    from mindformers.core.lr import build_lr
    import ascend_llm_recipes.training.worker.optim  # noqa: F401  (registers StartStepLR)
    from ascend_llm_recipes.training.launcher.resume import schedule_lr
    from ascend_llm_recipes.training.recipe.mindformers import worker_config

    s = "lr_schedule."
    for overrides in ((), (s + "warmup_steps=null", s + "warmup_ratio=0.1"), (s + "type=LinearWithWarmUpLR",),
                      (s + "type=LinearWithWarmUpLR", s + "lr_end=0.0"), (s + "type=ConstantWarmUpLR",),
                      (s + "start_step=7",), (s + "total_steps=12",), (s + "lr_end=0.0", s + "warmup_steps=0")):
        recipe = load_recipe(TINY_RECIPE, (f"output_dir={tmp_path}", "runner_config.stop_step=20", *overrides))
        schedule = build_lr(worker_config(recipe, str(tmp_path))["lr_schedule"])
        for step in range(0, 25):
            real = float(schedule(ms.Tensor(step, ms.int32)).asnumpy())
            assert schedule_lr(recipe, step) == pytest.approx(real, rel=1e-5, abs=1e-9), (overrides, step)


def test_amending_stop_step_warns_of_the_lr_jump_records_it_and_names_the_keys_that_keep_the_schedule(
        every_epoch_run, small_data, tmp_path, capsys):
    from ascend_llm_recipes.training.launcher.resume import prepare_run_dir

    run_dir = str(tmp_path / "run")
    shutil.copytree(every_epoch_run, run_dir)
    longer = small_settings(run_dir, small_data, "runner_config.stop_step=12", "runner_config.epochs=2")
    recipe = load_recipe(TINY_RECIPE, tuple(longer))
    prepare_run_dir(recipe, TINY_RECIPE, amend=True)
    new = 5e-4 + 4.5e-3 * 0.5 * (1 + math.cos(math.pi * 4 / 10))  # step 7: a cosine of 12 steps at optimizer step 6
    out = capsys.readouterr().out
    assert (f"[launch] warning: this amendment moves the learning rate of step 7 from 5.000e-04 (the schedule the "
            f"run trained with) to {new:.3e}: lr_schedule.total_steps -1 sizes the schedule to the run (6 steps "
            "before, 12 now)") in out
    assert "--set lr_schedule.total_steps=6   (the schedule as trained" in out
    with open(os.path.join(run_dir, "amendments.jsonl"), encoding="utf-8") as f:
        first = json.loads(f.readline())
    assert first["lr"] == {"step": 7, "old": pytest.approx(5e-4), "new": pytest.approx(new)}
    assert f"the LR of step 7: 5.000e-04 -> {new:.3e}" in out
    # the named keys keep the trained schedule: no jump, nothing to warn of
    shutil.rmtree(run_dir)
    shutil.copytree(every_epoch_run, run_dir)
    prepare_run_dir(load_recipe(TINY_RECIPE, (*longer, "lr_schedule.total_steps=6")), TINY_RECIPE, amend=True)
    assert "warning" not in capsys.readouterr().out


def test_amending_mid_decay_offers_a_new_decay_from_the_current_lr(tmp_path, capsys):
    from ascend_llm_recipes.training.launcher.resume import lr_change, schedule_lr

    trained = load_recipe(TINY_RECIPE, (f"output_dir={tmp_path}",))
    longer = ("runner_config.stop_step=40",)
    change = lr_change(trained, load_recipe(TINY_RECIPE, (f"output_dir={tmp_path}", *longer)), 10)
    current = schedule_lr(trained, 10)
    assert change == {"step": 11, "old": current, "new": pytest.approx(schedule_lr(
        load_recipe(TINY_RECIPE, (f"output_dir={tmp_path}", *longer)), 10))}
    keys = f"--set lr_schedule.learning_rate={current:.4g} --set lr_schedule.warmup_steps=10"
    assert keys in capsys.readouterr().out
    continued = load_recipe(TINY_RECIPE, (f"output_dir={tmp_path}", *longer,
                                          *[k for k in shlex.split(keys) if k != "--set"]))
    assert schedule_lr(continued, 10) == pytest.approx(current, rel=1e-3)  # continuous at the resumed step
    assert schedule_lr(continued, 40) == trained.lr_schedule.lr_end  # and decays to lr_end by the new end
    assert lr_change(trained, continued, 10) is None


# D7: integer keys that MindSpore holds in 32 bits are range-checked at load, every one of them.

def integer_keys(obj, prefix=""):
    """(dotted key, dataclass field) of every integer field (int or Optional[int]) set in the loaded recipe, list items
    by index."""
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            yield from integer_keys(item, f"{prefix}.{i}")
        return
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}.{f.name}".lstrip(".")
        if dataclasses.is_dataclass(value) or (isinstance(value, list) and any(map(dataclasses.is_dataclass, value))):
            yield from integer_keys(value, key)
        elif hints[f.name] in (int, typing.Optional[int]) and value is not None:
            yield key, f


def test_every_integer_key_past_what_mindspore_holds_is_refused_at_load_naming_it():
    with pytest.raises(RecipeError, match=re.escape("runner_config.stop_step: 99999999999999999999 is out of range: "
                                                    "must be from -2147483648 to 2147483647 (MindSpore holds steps "
                                                    "and sizes as 32-bit integers)")):
        load_recipe(TINY_RECIPE, ("runner_config.stop_step=99999999999999999999",))
    from ascend_llm_recipes.common.schema import INT32_MAX, INT_MAX

    keys = {key: f.metadata.get(INT_MAX, INT32_MAX) for key, f in integer_keys(load_recipe(TINY_RECIPE))}
    assert {"runner_config.stop_step", "runner_config.batch_size", "model.model_config.seq_length",
            "lr_schedule.warmup_steps", "callbacks.1.save_checkpoint_steps", "seed"} <= set(keys)
    for key, largest in keys.items():
        with pytest.raises(RecipeError) as info:
            load_recipe(TINY_RECIPE, (f"{key}={largest + 1}",))
        named = re.sub(r"\.(\d+)", r"[\1]", key)  # callbacks.1.x is set so, and named callbacks[1].x
        assert info.value.problems[0].startswith(f"{named}: {largest + 1} is out of range"), key
    assert keys["seed"] == 2**32 - 1  # MindSpore's dataset seed is unsigned 32-bit
    assert load_recipe(TINY_RECIPE, (f"seed={2**32 - 1}",)).seed == 2**32 - 1
    with pytest.raises(RecipeError, match=r"lr_schedule\.learning_rate: must be a finite number"):
        load_recipe(TINY_RECIPE, ("lr_schedule.learning_rate=1" + "0" * 400,))


# D12: another framework's checkpoint as load_checkpoint is named, with the conversion command.

def test_a_huggingface_megatron_or_torch_checkpoint_as_load_checkpoint_names_the_conversion(tmp_path,
                                                                                           every_epoch_run):
    import torch
    from test_convert import make_hf_model
    from ascend_llm_recipes.models.conversion.hf import from_hf
    from ascend_llm_recipes.training.launcher.datasets import check_load_checkpoint
    from ascend_llm_recipes.training.launcher.preflight import run_checks

    hf_dir = tmp_path / "Tiny Llama"
    make_hf_model(str(hf_dir))
    recipe = load_recipe(TINY_RECIPE, (f"load_checkpoint={hf_dir}", "load_ckpt_format=safetensors",
                                       f"output_dir={tmp_path}/run"))
    command = (f"python scripts/convert_checkpoint.py --from-hf '{hf_dir}' --output '{hf_dir}-converted'")
    with pytest.raises(LaunchError, match=re.escape(f"load_checkpoint: {hf_dir} is a HuggingFace model directory")) \
            as info:
        check_load_checkpoint(recipe)
    assert ("this is a HuggingFace model directory: convert it with scripts/convert_checkpoint.py --from-hf first: "
            + command) in info.value.hint
    [finding] = [f for f in run_checks(recipe) if f.check == "load_checkpoint"]
    assert finding.level == "error" and command in finding.message
    from ascend_llm_recipes.training.launcher.datasets import foreign_checkpoint
    assert foreign_checkpoint(str(hf_dir / "model.safetensors"))[:2] == ("a HuggingFace model directory", "--from-hf")

    megatron = tmp_path / "megatron"
    (megatron / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    (megatron / "latest_checkpointed_iteration.txt").write_text("10\n")
    assert foreign_checkpoint(str(megatron)) == ("a Megatron-LM checkpoint", "--from-megatron", str(megatron))
    assert foreign_checkpoint(str(megatron / "iter_0000010"))[1] == "--from-megatron"
    torch.save({"tok_embeddings.weight": torch.zeros(2, 2)}, tmp_path / "consolidated.00.pth")
    with pytest.raises(LaunchError, match=r"(?s)is a torch\.save file.*--from-torch .*consolidated\.00\.pth "
                                          r"--model-config CONFIG\.json --output .*consolidated\.00-converted"):
        check_load_checkpoint(load_recipe(TINY_RECIPE, (f"load_checkpoint={tmp_path}/consolidated.00.pth",)))

    # ours are not: a conversion, a run's step directory and its rank file
    from_hf(str(hf_dir), str(tmp_path / "ours"), show_progress=False)
    step = os.path.join(every_epoch_run, "checkpoints", "step_00000006")
    for path in (str(tmp_path / "ours"), step, os.path.join(step, "rank_0")):
        assert foreign_checkpoint(path) is None, path
