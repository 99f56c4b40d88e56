"""HuggingFace <-> ours conversion, proven with real transformers models and our real Cell.

Every reference model is a tiny random transformers model built here (no Hub access), with
norms and biases randomised too so that a swapped or dropped tensor changes the logits.
"""

import itertools
import json
import os
import sys

import numpy as np
import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file, save_file

from conftest import REPO_ROOT, TINY_RECIPE
from data.mindrecord_io import read_manifest, read_samples
from models.convert import (CHECKPOINT_FILE, HF_WEIGHTS_FILE, KL_TOLERANCE, MAX_ABS_TOLERANCE, MODEL_SECTION_FILE,
                            from_hf, to_hf)
from training.errors import ConversionError
from training.launch import launch

PAD = 3  # the tiny dataset's pad id (labels equal to it are not trained on)

TINY = dict(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def make_hf_model(path, family="llama", dtype=torch.float32, seed=0, save_kwargs=None, **overrides):
    """A tiny random transformers model saved with save_pretrained; returns the model (float32 or dtype)."""
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
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
    assert parity["max_abs_delta"] <= MAX_ABS_TOLERANCE and parity["kl"] <= KL_TOLERANCE
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


def test_converted_checkpoint_trains_from_a_recipe_with_the_transformers_loss(tmp_path, tiny_dataset):
    """load_checkpoint: the first training step's loss is the HF model's loss on the same batch."""
    hf_dir, ours, run_dir = tmp_path / "hf", tmp_path / "ours", tmp_path / "run"
    model = make_hf_model(hf_dir, vocab_size=512, intermediate_size=176, bos_token_id=1, eos_token_id=2,
                          pad_token_id=PAD)
    from_hf(str(hf_dir), str(ours), show_progress=False)
    with open(ours / MODEL_SECTION_FILE, encoding="utf-8") as f:
        model_config = yaml.safe_load(f)["model"]["model_config"]
    overrides = [f"model.model_config.{key}={json.dumps(value)}" for key, value in model_config.items()]
    code = launch(TINY_RECIPE, [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                                "train_dataset.data_loader.shuffle=False", f"load_checkpoint={ours}",
                                "load_ckpt_format=safetensors", "runner_config.stop_step=1",
                                "lr_schedule.learning_rate=1e-6", *overrides], show_progress=False)
    assert code == 0
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        first_loss = json.loads(f.readline())["loss"]

    batch = np.stack(list(itertools.islice(read_samples(tiny_dataset, read_manifest(tiny_dataset)), 4)))
    ids = torch.from_numpy(batch).long()
    with torch.no_grad():
        logits = model.eval()(ids[:, :-1]).logits.double()
    labels = ids[:, 1:].reshape(-1)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, reduction="none")
    mask = (labels != PAD).double()
    hf_loss = float((nll * mask).sum() / mask.sum())
    print(f"\n[train] first-step loss {first_loss:.7f}, transformers {hf_loss:.7f}")
    assert first_loss == pytest.approx(hf_loss, rel=1e-5)

    # The run's own checkpoint (weights after one step, AdamW moments, counters) converts back.
    back = tmp_path / "back"
    manifest = to_hf(str(run_dir), str(back), show_progress=False)
    assert any(name.startswith("adam_m.") for name in manifest["ignored"])
    assert transformers.AutoModelForCausalLM.from_pretrained(str(back)).config.vocab_size == 512


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
    with pytest.raises(ConversionError, match="model_type 'gpt2'.*not supported; supported: llama, qwen2"):
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


def test_cli_converts_and_reports_errors_with_exit_code_2(tmp_path, capsys):
    sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
    try:
        import convert_checkpoint
    finally:
        sys.path.pop(0)
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
