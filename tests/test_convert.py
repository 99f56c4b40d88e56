"""HuggingFace <-> ours conversion, proven with real transformers models and our real Cell.

Every reference model is a tiny random transformers model built here (no Hub access), with
norms and biases randomised too so that a swapped or dropped tensor changes the logits.
"""

import itertools
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import sentencepiece as spm
import torch
import transformers
import yaml
from safetensors.torch import load_file, save_file

from conftest import TINY_RECIPE, load_script
from ascend_llm_recipes.common.errors import ConversionError, LaunchError
from ascend_llm_recipes.data.mindrecord_io import read_manifest, read_samples
from ascend_llm_recipes.data.prepare import prepare_dataset
from ascend_llm_recipes.models.conversion.ours import CHECKPOINT_FILE, HF_WEIGHTS_FILE, MODEL_SECTION_FILE
from ascend_llm_recipes.models.conversion.verify import KL_TOLERANCE, verify_logits
from ascend_llm_recipes.models.conversion.hf import from_hf
from ascend_llm_recipes.models.conversion.write import summary
from ascend_llm_recipes.training.checkpoint import MANIFEST, STATE, read_json, step_dir, write_rank
from ascend_llm_recipes.training.launcher.datasets import check_load_checkpoint
from ascend_llm_recipes.training.tools.export import to_hf
from ascend_llm_recipes.training.launcher.cli import launch
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.worker.train import check_checkpoint_parameters

PAD = 3  # the tiny dataset's pad id (labels equal to it are not trained on)

TINY = dict(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def make_hf_model(path, family="llama", dtype=torch.float32, seed=0, save_kwargs=None, **overrides):
    """A tiny random transformers model saved with save_pretrained; returns the model (float32 or dtype)."""
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "mistral": transformers.MistralConfig}[family]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.05 + (1.0 if "norm" in name else 0.0))
    model = model.to(dtype)
    model.save_pretrained(path, **(save_kwargs or {}))
    return model


def original_tensors(model):
    """What the HF model stores, as float32 (a tied head is not stored)."""
    state = {k: v.float() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def assert_nothing_written(out_dir):
    parent, name = os.path.split(os.path.abspath(out_dir))
    assert not os.path.exists(out_dir)
    assert not [p for p in os.listdir(parent) if p.startswith(f".{name}.partial")]


CASES = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(),
    "tied": dict(tie_word_embeddings=True),
    "qwen2_qkv_bias": dict(family="qwen2"),
    "mistral_no_sliding_window": dict(family="mistral", sliding_window=None),
    "rope_theta_500000": dict(rope_theta=500000.0),
    "bfloat16_weights": dict(dtype=torch.bfloat16),
    "sharded_safetensors": dict(save_kwargs=dict(max_shard_size="40KB")),
    "pytorch_model_bin": dict(save_kwargs=dict(safe_serialization=False)),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_and_round_trip_is_exact(tmp_path, case):
    hf_dir, ours, back = tmp_path / "hf", tmp_path / "ours", tmp_path / "back"
    model = make_hf_model(hf_dir, **CASES[case])
    if case == "sharded_safetensors":
        assert len([f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]) > 2
    if case == "pytorch_model_bin":
        assert "pytorch_model.bin" in os.listdir(hf_dir)

    manifest = from_hf(str(hf_dir), str(ours), verify=True, show_progress=False)
    parity = manifest["verify"]
    print(f"\n[parity] {case}: max |delta logits| {parity['max_abs_delta']:.3e}, KL(hf || ours) {parity['kl']:.3e}")
    assert parity["max_abs_delta"] <= parity["max_abs_tolerance"] and parity["kl"] <= KL_TOLERANCE
    assert manifest["padded_vocab_size"] == 512  # 500 real tokens, tables padded to a multiple of 16
    assert sorted(os.listdir(ours)) == sorted([CHECKPOINT_FILE, MODEL_SECTION_FILE, "conversion.json"])

    to_hf(str(ours), str(back), show_progress=False)
    restored = load_file(str(back / HF_WEIGHTS_FILE))
    expected = original_tensors(model)
    assert sorted(restored) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(restored[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(back))
    if model.config.tie_word_embeddings:
        assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()


def recipe_model_overrides(converted_dir, **changes):
    """--set overrides giving the recipe the converted model section (with `changes` on top)."""
    with open(os.path.join(converted_dir, MODEL_SECTION_FILE), encoding="utf-8") as f:
        model_config = {**yaml.safe_load(f)["model"]["model_config"], **changes}
    return [f"model.model_config.{key}={json.dumps(value)}" for key, value in model_config.items()]


TINY_RECIPE_MODEL = dict(vocab_size=512, intermediate_size=176, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)


@pytest.fixture(scope="module")
def converted_run(tmp_path_factory, tiny_dataset):
    """A HF model converted, then trained 2 steps from it with the tiny recipe (a checkpoint each step)."""
    root = tmp_path_factory.mktemp("converted_run")
    hf_dir, ours, run_dir = root / "hf", root / "ours", root / "run"
    model = make_hf_model(hf_dir, **TINY_RECIPE_MODEL)
    from_hf(str(hf_dir), str(ours), show_progress=False)
    code = launch(TINY_RECIPE, [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                                "train_dataset.data_loader.shuffle=False", f"load_checkpoint={ours}",
                                "load_ckpt_format=safetensors", "runner_config.stop_step=2",
                                "callbacks.1.save_checkpoint_steps=1", "lr_schedule.learning_rate=1e-6",
                                "lr_schedule.lr_end=0",
                                *recipe_model_overrides(ours)], show_progress=False)
    assert code == 0
    return SimpleNamespace(model=model, ours=ours, run_dir=run_dir)


def test_converted_checkpoint_trains_from_a_recipe_with_the_transformers_loss(converted_run, tiny_dataset, tmp_path):
    """load_checkpoint: the first training step's loss is the HF model's loss on the same batch."""
    with open(converted_run.run_dir / "metrics.jsonl", encoding="utf-8") as f:
        first_loss = json.loads(f.readline())["loss"]

    batch = np.stack(list(itertools.islice(read_samples(tiny_dataset, read_manifest(tiny_dataset)), 4)))
    ids = torch.from_numpy(batch).long()
    with torch.no_grad():
        logits = converted_run.model.eval()(ids[:, :-1]).logits.double()
    labels = ids[:, 1:].reshape(-1)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, reduction="none")
    mask = (labels != PAD).double()
    hf_loss = float((nll * mask).sum() / mask.sum())
    print(f"\n[train] first-step loss {first_loss:.7f}, transformers {hf_loss:.7f}")
    assert first_loss == pytest.approx(hf_loss, rel=1e-5)

    # The run's own checkpoint (weights after two steps, AdamW moments, counters) converts back, with
    # the optimizer tensors summarised and the dataset's tokenizer alongside.
    back = tmp_path / "back"
    manifest = to_hf(str(converted_run.run_dir), str(back), show_progress=False)
    assert manifest["source"]["step"] == 2
    assert any(name.startswith("adam_m.") for name in manifest["ignored"])
    text = summary(manifest, str(back))
    assert "ignored 48 tensors that are not weights (42 AdamW moments, 6 training counters;" in text
    assert "adam_m." not in text
    assert transformers.AutoModelForCausalLM.from_pretrained(str(back)).config.vocab_size == 512
    sp = spm.SentencePieceProcessor(model_file=os.path.join(tiny_dataset, "tokenizer.model"))
    sample = "def mean(values):\n    return sum(values) / len(values)  # 平均，不是中位数\n"
    for tokenizer in (transformers.LlamaTokenizer.from_pretrained(str(back)),
                      transformers.AutoTokenizer.from_pretrained(str(back))):
        assert tokenizer.encode(sample) == sp.encode(sample), type(tokenizer).__name__
    assert "tokenizer copied from" in text

    # A step of this run (weights, AdamW moments, counters) passes the load checks for another run's resume.
    recipe = load_recipe(TINY_RECIPE, (f"load_checkpoint={step_dir(str(converted_run.run_dir), 2)}",
                                       "resume_training=true", *recipe_model_overrides(converted_run.ours)))
    check_load_checkpoint(recipe)
    check_checkpoint_parameters(recipe, 0)


def test_continued_pretraining_with_the_models_own_tokenizer_matches_transformers(tmp_path, llama2_hf_tokenizer):
    """HF dir (tiny random Llama + the real 32,000-piece Llama-2-layout tokenizer) -> from_hf copies the tokenizer
    -> prepare_data --tokenizer CONVERTED_DIR -> the first training step's loss is transformers' loss."""
    hf_dir, ours, data, run_dir = tmp_path / "hf", tmp_path / "ours", tmp_path / "data", tmp_path / "run"
    shutil.copytree(llama2_hf_tokenizer, hf_dir)
    model = make_hf_model(hf_dir, vocab_size=32000, num_hidden_layers=1,
                          bos_token_id=1, eos_token_id=2)
    manifest = from_hf(str(hf_dir), str(ours), show_progress=False)
    assert [f["file"] for f in manifest["tokenizer_files"]] == ["tokenizer.json", "tokenizer.model",
                                                                "tokenizer_config.json", "special_tokens_map.json"]
    assert f"--tokenizer {ours}" in summary(manifest, str(ours))
    corpus = tmp_path / "c.jsonl"
    texts = [f"Document {i}: the converted model keeps pretraining on its own tokens. 第{i}篇文档，继续预训练。"
             for i in range(8)]
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    data_manifest = prepare_dataset(str(data), 64, inputs=[str(corpus)], tokenizer=str(ours), show_progress=False,
                                    workers=0, packing="best_fit")  # pads every row: padding in the first batch
    assert (data_manifest["tokenizer"]["kind"], data_manifest["tokenizer"]["pad_id"]) == ("hf", -1)
    code = launch(TINY_RECIPE, [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={data}",
                                "train_dataset.data_loader.shuffle=False", f"load_checkpoint={ours}",
                                "load_ckpt_format=safetensors", "runner_config.stop_step=1",
                                "lr_schedule.learning_rate=1e-6", "lr_schedule.warmup_steps=0",
                                "lr_schedule.lr_end=0",
                                *recipe_model_overrides(ours)], show_progress=False)
    assert code == 0
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        first_loss = json.loads(f.readline())["loss"]
    batch = np.stack(list(itertools.islice(read_samples(str(data), read_manifest(str(data))), 4)))
    assert (batch == -1).any()  # the batch holds the tail padding: its labels must not count
    ids = torch.from_numpy(batch).long()
    with torch.no_grad():
        logits = model.eval()(ids[:, :-1].clamp(min=0)).logits.double()
    hf_loss = float(torch.nn.functional.cross_entropy(logits.reshape(-1, 32000), ids[:, 1:].reshape(-1),
                                                      ignore_index=-1))
    print(f"\n[continued pretraining] first-step loss {first_loss:.7f}, transformers {hf_loss:.7f}")
    assert first_loss == pytest.approx(hf_loss, rel=1e-5)

    # Back to HF: the run's dataset tokenizer goes out as the tokenizer.json it came in as.
    back = tmp_path / "back"
    to_hf(str(run_dir), str(back), show_progress=False)
    text = texts[0]
    assert transformers.AutoTokenizer.from_pretrained(str(back)).encode(text, add_special_tokens=False) == \
        transformers.AutoTokenizer.from_pretrained(str(hf_dir)).encode(text, add_special_tokens=False)


def test_missing_shard_is_refused(tmp_path):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    make_hf_model(hf_dir, save_kwargs=dict(max_shard_size="40KB"))
    victim = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))[1]
    os.remove(hf_dir / victim)
    with pytest.raises(ConversionError, match=f"missing shard.*{victim}"):
        from_hf(str(hf_dir), str(out), show_progress=False)
    assert_nothing_written(out)


def test_truncated_safetensors_is_refused(tmp_path):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    make_hf_model(hf_dir)
    path = hf_dir / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    with pytest.raises(ConversionError, match="model.safetensors: truncated"):
        from_hf(str(hf_dir), str(out), show_progress=False)
    assert_nothing_written(out)


def test_shape_mismatch_names_the_tensor(tmp_path):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    make_hf_model(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config["intermediate_size"] = 128
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: expected shape "
                                              r"\(128, 64\) from the config, found \(96, 64\)"):
        from_hf(str(hf_dir), str(out), show_progress=False)
    assert_nothing_written(out)


def test_unknown_tensor_is_refused(tmp_path):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    make_hf_model(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: unknown tensor"):
        from_hf(str(hf_dir), str(out), show_progress=False)
    assert_nothing_written(out)


def test_unknown_architecture_is_refused(tmp_path):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    with pytest.raises(ConversionError, match="model_type 'gpt2'.*not supported; supported: llama, qwen2, mistral"):
        from_hf(str(hf_dir), str(out), show_progress=False)
    assert_nothing_written(out)


@pytest.mark.parametrize("option, value", [("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
                                           ("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu")])
def test_unsupported_llama_options_are_refused_by_name(tmp_path, option, value):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    make_hf_model(hf_dir, **{option: value})
    with pytest.raises(ConversionError, match=f"{option}: .* is not supported"):
        from_hf(str(hf_dir), str(out), show_progress=False)
    assert_nothing_written(out)


def test_qwen2_sliding_window_is_refused(tmp_path):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    make_hf_model(hf_dir, family="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ConversionError, match="use_sliding_window: True is not supported"):
        from_hf(str(hf_dir), str(out), show_progress=False)


def test_mistral_sliding_window_is_refused_by_name(tmp_path):
    """A window of 4096 equals full attention only up to 4096 tokens: refused, where null converts (CASES)."""
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    make_hf_model(hf_dir, family="mistral", sliding_window=4096)
    with pytest.raises(ConversionError, match=r"sliding_window: 4096 is not supported \(None only\): attention "
                                              r"is full causal attention"):
        from_hf(str(hf_dir), str(out), show_progress=False)
    assert_nothing_written(out)


def test_tied_checkpoint_may_store_the_head_only_as_a_copy_of_the_embedding(tmp_path):
    hf_dir = tmp_path / "hf"
    model = make_hf_model(hf_dir, tie_word_embeddings=True)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}  # lm_head stored again
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    assert "lm_head.weight" in from_hf(str(hf_dir), str(tmp_path / "ok"), show_progress=False)["ignored"]

    state["lm_head.weight"] += 1.0
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="lm_head.weight: differs from model.embed_tokens.weight"):
        from_hf(str(hf_dir), str(tmp_path / "bad"), show_progress=False)
    assert_nothing_written(tmp_path / "bad")


def test_output_holding_a_different_model_is_refused(tmp_path):
    first, same_config, other_config, out = (tmp_path / n for n in ("a", "b", "c", "out"))
    make_hf_model(first, seed=0)
    make_hf_model(same_config, seed=1)
    make_hf_model(other_config, num_hidden_layers=1)
    from_hf(str(first), str(out), show_progress=False)
    before = (out / CHECKPOINT_FILE).read_bytes()

    assert from_hf(str(first), str(out), show_progress=False).get("already_converted")
    with pytest.raises(ConversionError, match="already holds a different model"):
        from_hf(str(other_config), str(out), show_progress=False)
    with pytest.raises(ConversionError, match="already holds a different model with the same config"):
        from_hf(str(same_config), str(out), show_progress=False)
    assert (out / CHECKPOINT_FILE).read_bytes() == before
    assert not [p for p in os.listdir(tmp_path) if ".partial" in p]

    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="holds files that are not a conversion"):
        from_hf(str(first), str(stranger), show_progress=False)
    assert os.listdir(stranger) == ["notes.txt"]


def cli():
    return load_script("convert_checkpoint")


def test_cli_converts_and_reports_errors_with_exit_code_2(tmp_path, capsys):
    convert_checkpoint = cli()
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    make_hf_model(hf_dir)
    assert convert_checkpoint.main(["--from-hf", str(hf_dir), "--output", str(out), "--seq-length", "32",
                                    "--verify", "--quiet"]) == 0
    assert "Parity with transformers on 2x32 random tokens" in capsys.readouterr().out
    assert yaml.safe_load((out / MODEL_SECTION_FILE).read_text())["model"]["model_config"]["seq_length"] == 32

    assert convert_checkpoint.main(["--from-hf", str(hf_dir), "--output", str(tmp_path / "long"),
                                    "--seq-length", "128"]) == 2
    assert "--seq-length 128 exceeds max_position_embeddings 64" in capsys.readouterr().err
    os.remove(hf_dir / "model.safetensors")
    assert convert_checkpoint.main(["--from-hf", str(hf_dir), "--output", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {hf_dir}: no weights found")


def test_cli_bad_input_gets_a_message_not_a_traceback(tmp_path, capsys):
    convert_checkpoint = cli()
    hf_dir, empty, listed, garbage = (tmp_path / n for n in ("hf", "empty", "listed", "garbage"))
    make_hf_model(hf_dir)
    empty.mkdir()
    listed.mkdir()
    (listed / "config.json").write_text("[1, 2]")
    shutil.copytree(hf_dir, garbage)
    (garbage / "model.safetensors").write_text("not a tensor file, just some text\n" * 4)
    (tmp_path / "notes.txt").write_text("mine")
    cases = [
        (["--from-hf", str(tmp_path / "nope")], "does not exist"),
        (["--from-hf", str(empty)], "no config.json, so not a HuggingFace model directory"),
        (["--from-hf", str(listed)], "holds a JSON list, not a model config object"),
        (["--from-hf", str(garbage)], "model.safetensors: truncated"),
        (["--from-hf", str(hf_dir), "--output", str(tmp_path / "notes.txt" / "out")], "is a file, not a directory"),
        (["--to-hf", str(tmp_path / "nope")], "does not exist"),
        (["--to-hf", str(tmp_path / "notes.txt")], "neither a converted directory"),
        (["--to-hf", str(hf_dir)], "neither a converted directory"),
    ]
    for args, message in cases:
        if "--output" not in args:
            args = args + ["--output", str(tmp_path / "out")]
        assert convert_checkpoint.main(args + ["--quiet"]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err, (args, err)
    assert not os.path.exists(tmp_path / "out")


def test_verify_tolerance_scales_with_the_logits(tmp_path):
    """A correct conversion with large logits passes --verify; a wrong rope_theta still fails it."""
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    model = make_hf_model(hf_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(250.0)  # logits up to ~400: float32 rounding grows with them
    model.save_pretrained(hf_dir)
    manifest = from_hf(str(hf_dir), str(out), verify=True, show_progress=False)
    parity = manifest["verify"]
    assert parity["logit_scale"] > 200 and parity["max_abs_delta"] > 1e-4  # beyond the former absolute limit
    assert "passes max |delta| <= 0.0001 x max(1, largest |logit|), KL(hf || ours) <= 1e-06" in \
        summary(manifest, str(out))

    section = out / MODEL_SECTION_FILE
    section.write_text(section.read_text().replace("rope_theta: 10000.0", "rope_theta: 20000.0"))
    with pytest.raises(ConversionError, match=r"converted logits differ from transformers'.*tolerance .* = 0\.0001 "
                                              r"x largest \|logit\|"):
        verify_logits(str(hf_dir), str(out))


def test_load_checkpoint_of_another_architecture_is_refused_before_launch(tmp_path, tiny_dataset):
    hf_dir, ours, run_dir = tmp_path / "hf", tmp_path / "ours", tmp_path / "run"
    make_hf_model(hf_dir, rope_theta=500000.0, rms_norm_eps=1e-6, **TINY_RECIPE_MODEL)
    from_hf(str(hf_dir), str(ours), show_progress=False)
    # The tiny recipe has this model's sizes, with its own rope_theta 10000 and rms_norm_eps 1e-5.
    with pytest.raises(LaunchError, match=r"(?s)another architecture.*rms_norm_eps: checkpoint 1e-06, recipe 1e-05"
                                          r".*rope_theta: checkpoint 500000.0, recipe 10000.0"):
        launch(TINY_RECIPE, [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                             f"load_checkpoint={ours}", "load_ckpt_format=safetensors"], show_progress=False)
    assert not run_dir.exists()


def test_tied_checkpoint_into_an_untied_model_is_refused(tmp_path, tiny_dataset, converted_run):
    hf_dir, tied, bare, run_dir = tmp_path / "hf", tmp_path / "tied", tmp_path / "bare", tmp_path / "run"
    make_hf_model(hf_dir, tie_word_embeddings=True, **TINY_RECIPE_MODEL)
    from_hf(str(hf_dir), str(tied), show_progress=False)
    common = [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
              "load_ckpt_format=safetensors"]
    with pytest.raises(LaunchError, match="tie_word_embeddings: checkpoint True, recipe False"):
        launch(TINY_RECIPE, [*common, f"load_checkpoint={tied}"], show_progress=False)

    # Weights without their recorded config: the parameter check names what would not be loaded,
    # at launch and in the worker (the same check, before MindFormers loads anything).
    bare.mkdir()
    shutil.copyfile(tied / CHECKPOINT_FILE, bare / CHECKPOINT_FILE)
    with pytest.raises(LaunchError, match=r"lm_head\.weight: not in the checkpoint \(would train from its random"):
        launch(TINY_RECIPE, [*common, f"load_checkpoint={bare}"], show_progress=False)
    assert not run_dir.exists()
    recipe = load_recipe(TINY_RECIPE, (f"load_checkpoint={bare}", "load_ckpt_format=safetensors"))
    with pytest.raises(LaunchError, match=r"1 parameter problem\(s\):\n  - lm_head\.weight: not in the checkpoint"):
        check_checkpoint_parameters(recipe, 0)

    # The other way round: an untied checkpoint's lm_head would be dropped by a tied model.
    shutil.copyfile(converted_run.ours / CHECKPOINT_FILE, bare / CHECKPOINT_FILE)
    recipe.model.model_config.tie_word_embeddings = True
    with pytest.raises(LaunchError, match=r"lm_head\.weight: in the checkpoint but not a parameter"):
        check_checkpoint_parameters(recipe, 0)


def test_to_hf_of_a_run_takes_its_newest_verified_step(converted_run, tmp_path, capsys):
    """Never a nan_/spike_ post-mortem snapshot, a half-written save or a corrupt step; never a non-finite weight.

    Each of those is newer than step 2, so a rule by modification time would take it.
    """
    import mindspore as ms

    run, out = tmp_path / "run", tmp_path / "out"
    shutil.copytree(converted_run.run_dir, run)
    rank0 = os.path.join(step_dir(str(run), 2), "rank_0")
    name = read_json(os.path.join(rank0, MANIFEST))["file"]
    params = ms.load_checkpoint(os.path.join(rank0, name))

    def write_step(step, kind, poison):
        """A checkpoint written by the trainer's own writer (file, then manifest): step 2's tensors, poisoned."""
        directory = os.path.join(step_dir(str(run), step, kind), "rank_0")
        tensors = [{"name": k, "data": ms.Tensor(poison(k, v.asnumpy()))} for k, v in params.items()]
        meta = {"step": step, "epoch": 1, "rank": 0, "world_size": 1, "kind": kind}
        written = write_rank(directory, name.replace("_2.ckpt", f"_{step}.ckpt"), tensors, {}, meta)
        shutil.copy(os.path.join(os.path.dirname(rank0), STATE), os.path.dirname(directory))  # step 2's state
        return written

    def nan(key, array):
        return np.full_like(array, np.nan) if array.dtype == np.float32 else array

    def inf_head(key, array):
        array = array.copy()
        if key == "lm_head.weight":
            array[0] = np.inf
        return array

    snapshot = write_step(3, "nan", nan)
    write_step(6, "spike", lambda key, array: array)  # finite and verifying, yet a post-mortem snapshot
    crashed = os.path.join(step_dir(str(run), 4), "rank_0")  # a save killed before its manifest
    os.makedirs(crashed)
    with open(os.path.join(rank0, name), "rb") as f, \
            open(os.path.join(crashed, ".partial-" + name.replace("_2.ckpt", "_4.ckpt")), "wb") as partial:
        partial.write(f.read()[:5000])
    manifest = to_hf(str(run), str(out), show_progress=False)
    assert manifest["source"]["step"] == 2 and manifest["source"]["path"] == os.path.join(rank0, name)
    assert torch.equal(load_file(str(out / HF_WEIGHTS_FILE))["lm_head.weight"],
                       torch.from_numpy(params["lm_head.weight"].asnumpy()))
    shutil.rmtree(out)

    # Named explicitly, the snapshot is read, and refused for its NaN weights.
    with pytest.raises(ConversionError, match=r"non-finite values in \d+ tensor\(s\): model\.embed_tokens\.weight "
                                              r"\(32768 NaN, 0 inf\)"):
        to_hf(snapshot, str(out), show_progress=False)
    assert_nothing_written(out)

    # A newest step that verifies but holds +inf in lm_head: refused, naming the tensor.
    diverged = write_step(5, "step", inf_head)
    with pytest.raises(ConversionError,
                       match=r"non-finite values in 1 tensor\(s\): lm_head\.weight \(0 NaN, 64 inf\)") as err:
        to_hf(str(run / "checkpoints"), str(out), show_progress=False)
    assert_nothing_written(out)
    assert "export an earlier checkpoint" in err.value.hint

    # The same step damaged on disk no longer verifies: skipped with a note, step 2 taken.
    with open(diverged, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\xff" * 50)
    assert cli().main(["--to-hf", str(run), "--output", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "step 2, the run's newest verified checkpoint (newer ones skipped:" in printed
    assert "step_00000005/rank_0" in printed and "sha256 differs" in printed
    assert read_json(str(out / "conversion.json"))["source"]["step"] == 2

    # Named directly, the damaged file is still checked against the manifest beside it.
    with pytest.raises(ConversionError, match="sha256 differs from .*manifest.json"):
        to_hf(diverged, str(tmp_path / "named"), show_progress=False)


def test_non_finite_hf_weights_are_refused(tmp_path):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    model = make_hf_model(hf_dir)
    with torch.no_grad():
        model.model.norm.weight[3] = float("nan")
    model.save_pretrained(hf_dir)
    with pytest.raises(ConversionError, match=r"non-finite values in 1 tensor\(s\): model\.norm\.weight \(1 NaN") \
            as err:
        from_hf(str(hf_dir), str(out), show_progress=False)
    assert_nothing_written(out)
    # The hint fits a HuggingFace source (there is no earlier .ckpt file to name).
    assert "HuggingFace checkpoint itself" in err.value.hint and ".ckpt" not in err.value.hint


WRITER_DRILL = """
import sys
import numpy as np
from ascend_llm_recipes.models.conversion.formats import SafetensorsWriter
from ascend_llm_recipes.common.errors import ConversionError

writer = SafetensorsWriter(sys.argv[1], {"a": (2, 3), "b": (4,)}, metadata={})
try:
    writer.write("a", np.zeros((3, 2), np.float32))  # the right size, the wrong shape
except ConversionError as err:
    print(err)
"""


def test_safetensors_writer_refuses_what_its_header_does_not_announce_even_under_python_O(tmp_path):
    """The header is written first: a tensor of another shape, name or dtype, or a missing one, would make it lie."""
    from ascend_llm_recipes.models.conversion.formats import SafetensorsFile, SafetensorsWriter

    path = tmp_path / "w.safetensors"
    run = subprocess.run([sys.executable, "-O", "-c", WRITER_DRILL, str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert f"{path}: tensor a (3, 2) float32 written where the header announces a (2, 3) float32" in run.stdout
    assert not path.exists()

    writer = SafetensorsWriter(str(path), {"a": (2, 3), "b": (4,)}, metadata={})
    writer.write("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(ConversionError, match=r"closed after 1 of the 2 tensors its header announces \(next: b\)"):
        writer.close()
    assert not path.exists()
    writer = SafetensorsWriter(str(path), {"a": (2, 3)}, metadata={})
    with pytest.raises(ConversionError, match=r"tensor a \(2, 3\) float64 written where"):
        writer.write("a", np.zeros((2, 3)))
    assert not path.exists()

    writer = SafetensorsWriter(str(path), {"a": (2, 3)}, metadata={})
    writer.write("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.close()
    assert SafetensorsFile(str(path)).read("a").tolist() == [[0, 1, 2], [3, 4, 5]]
