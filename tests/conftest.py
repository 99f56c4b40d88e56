"""Shared fixtures: a tiny real dataset (stdlib text, real sentencepiece, real MindRecord)."""

import os
import sys
import tempfile

import pytest

# Importing MindFormers creates ./output/log unless told where to log; keep the checkout clean.
os.environ.setdefault("LOCAL_DEFAULT_PATH", tempfile.mkdtemp(prefix="mindformers-log-"))

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

TINY_RECIPE = os.path.join(REPO_ROOT, "recipes", "tiny_cpu.yaml")
DEMO_RECIPE = os.path.join(REPO_ROOT, "recipes", "demo_cpu.yaml")


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """The tiny recipe's dataset, prepared once per test session."""
    from data.prepare import prepare_dataset
    from training.recipe import load_recipe

    recipe = load_recipe(TINY_RECIPE)
    out = str(tmp_path_factory.mktemp("data") / "tiny")
    prepare_dataset(out, recipe.model.model_config.seq_length, recipe.data_preparation.vocab_size,
                    max_documents=recipe.data_preparation.max_documents, show_progress=False)
    return out
