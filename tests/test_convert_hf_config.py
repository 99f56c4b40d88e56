"""--from-hf then --to-hf keeps what HuggingFace's config.json and generation_config.json say that our model does not
(the context length, use_cache, layer_types, sampling defaults), and says which values an export changes."""

import json

import pytest
import torch
import transformers
import yaml

from conftest import TINY_RECIPE, load_script
from ascend_llm_recipes.models.conversion.ours import CHECKPOINT_FILE, MODEL_SECTION_FILE
from ascend_llm_recipes.training.launcher.cli import launch
from test_convert import TINY, TINY_RECIPE_MODEL, make_hf_model, recipe_model_overrides

CONTEXT = 40960  # Qwen3's max_position_embeddings
GENERATION = dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, bos_token_id=1, eos_token_id=[2, 3])


def save_with_generation_config(model, path):
    model.generation_config = transformers.GenerationConfig(**GENERATION)
    model.save_pretrained(path)


def make_qwen3(path, dtype=torch.float32):
    """A tiny random Qwen3 with Qwen3's context length and a generation config, saved by save_pretrained."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**TINY, "max_position_embeddings": CONTEXT}, head_dim=16, bos_token_id=1,
                                      eos_token_id=[2, 3])
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    save_with_generation_config(model, path)
    return model


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def test_qwen3_context_length_and_generation_config_survive_the_cli_round_trip(tmp_path, capsys):
    convert = load_script("convert_checkpoint")
    hf_dir, ours, back = tmp_path / "hf", tmp_path / "ours", tmp_path / "back"
    model = make_qwen3(hf_dir, torch.bfloat16)
    assert convert.main(["--from-hf", str(hf_dir), "--output", str(ours), "--quiet"]) == 0
    assert yaml.safe_load((ours / MODEL_SECTION_FILE).read_text())["model"]["model_config"]["seq_length"] == 4096
    capsys.readouterr()

    assert convert.main(["--to-hf", str(ours), "--output", str(back), "--quiet"]) == 0
    printed = capsys.readouterr().out
    source, exported = read_json(hf_dir / "config.json"), read_json(back / "config.json")
    assert exported["max_position_embeddings"] == CONTEXT
    assert exported["eos_token_id"] == [2, 3]
    # every source key kept with its value, but the dtype: the exported weights are float32, and the note says so
    assert {k: v for k, v in exported.items() if k != "dtype"} == {
        **{k: v for k, v in source.items() if k != "dtype"}, **{k: exported[k] for k in set(exported) - set(source)}}
    assert exported["dtype"] == "float32"
    assert "Note: dtype: 'bfloat16' -> 'float32' (the exported weights are float32)" in printed
    assert "max_position_embeddings" not in printed
    assert read_json(back / "generation_config.json") == read_json(hf_dir / "generation_config.json")
    assert f"generation_config.json: written as {hf_dir} had it" in printed

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(back))
    assert reloaded.config.max_position_embeddings == CONTEXT
    assert reloaded.generation_config.to_dict() == model.generation_config.to_dict()
    for name, weight in model.named_parameters():
        assert torch.equal(reloaded.get_parameter(name), weight.float()), name


def test_exports_without_a_source_config_or_beyond_its_context_say_what_they_wrote(tmp_path, capsys):
    """A checkpoint with no HuggingFace source writes seq_length, and says so; a model trained on longer sequences
    than its source's context writes its own seq_length, and names the change."""
    convert = load_script("convert_checkpoint")
    hf_dir, ours, bare = tmp_path / "hf", tmp_path / "ours", tmp_path / "bare"
    make_qwen3(hf_dir)
    assert convert.main(["--from-hf", str(hf_dir), "--output", str(ours), "--seq-length", "64", "--quiet"]) == 0
    section = yaml.safe_load((ours / MODEL_SECTION_FILE).read_text())
    section["model"]["model_config"]["seq_length"] = 65536
    longer = tmp_path / "longer.yaml"
    longer.write_text(yaml.safe_dump(section))
    capsys.readouterr()
    assert convert.main(["--to-hf", str(ours / CHECKPOINT_FILE), "--model-config", str(longer),
                         "--output", str(tmp_path / "long"), "--quiet"]) == 0
    assert read_json(tmp_path / "long" / "config.json")["max_position_embeddings"] == 65536
    assert ("Note: max_position_embeddings: 40960 -> 65536 (the model was trained on sequences of 65536 tokens, "
            "longer than the source's)") in capsys.readouterr().out

    bare.mkdir()
    (bare / "model.safetensors").write_bytes((ours / CHECKPOINT_FILE).read_bytes())
    assert convert.main(["--to-hf", str(bare / "model.safetensors"), "--model-config", str(ours / MODEL_SECTION_FILE),
                         "--output", str(tmp_path / "scratch"), "--quiet"]) == 0
    assert read_json(tmp_path / "scratch" / "config.json")["max_position_embeddings"] == 64
    assert not (tmp_path / "scratch" / "generation_config.json").exists()
    assert ("Note: max_position_embeddings: 64, the model_config's seq_length: no HuggingFace config.json travels "
            "with these weights") in capsys.readouterr().out


def test_a_run_trained_from_a_conversion_exports_its_sources_context_length(tmp_path, tiny_dataset, capsys):
    """The issue's case: converted, trained at seq_length 64, exported from the run directory."""
    hf_dir, ours, run_dir, back = tmp_path / "hf", tmp_path / "ours", tmp_path / "run", tmp_path / "back"
    model = make_hf_model(hf_dir, **{**TINY_RECIPE_MODEL, "max_position_embeddings": CONTEXT})
    save_with_generation_config(model, hf_dir)
    convert = load_script("convert_checkpoint")
    assert convert.main(["--from-hf", str(hf_dir), "--output", str(ours), "--seq-length", "64", "--quiet"]) == 0
    assert launch(TINY_RECIPE, [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                                f"load_checkpoint={ours}", "load_ckpt_format=safetensors", "runner_config.stop_step=2",
                                "callbacks.1.save_checkpoint_steps=1", *recipe_model_overrides(ours)],
                  show_progress=False) == 0
    capsys.readouterr()
    assert convert.main(["--to-hf", str(run_dir), "--output", str(back), "--quiet"]) == 0
    assert "max_position_embeddings" not in capsys.readouterr().out
    assert read_json(back / "config.json")["max_position_embeddings"] == CONTEXT
    assert read_json(back / "generation_config.json") == read_json(hf_dir / "generation_config.json")
    assert transformers.AutoModelForCausalLM.from_pretrained(str(back)).config.max_position_embeddings == CONTEXT


@pytest.mark.parametrize("broken", ["{not json", "[1, 2]"])
def test_an_unreadable_generation_config_is_refused_by_name(tmp_path, capsys, broken):
    hf_dir = tmp_path / "hf"
    make_qwen3(hf_dir)
    (hf_dir / "generation_config.json").write_text(broken)
    assert load_script("convert_checkpoint").main(["--from-hf", str(hf_dir), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"error: {hf_dir / 'generation_config.json'}: not a JSON object of generation settings" in err
    assert "HINT: repair it" in err
    assert not (tmp_path / "o").exists()
