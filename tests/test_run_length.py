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
