"""Continued pretraining of a Qwen3-MoE model, end to end as a user runs it, against transformers.

A tiny random Qwen3-MoE (bf16 weights) with its own byte-level BPE tokenizer (trained on the shipped tiny corpus,
saved by transformers as a real HF tokenizer directory) -> convert_checkpoint --from-hf --verify -> prepare_data
--tokenizer CONVERTED_DIR -> a few steps of tiny_moe_cpu.yaml with the converted model section, launched from
load_checkpoint -> convert_checkpoint --to-hf of the run directory -> transformers.
"""

import json
import os
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

from conftest import MOE_RECIPE, load_script, tiny_corpus_files
from ascend_llm_recipes.data.loader import build_train_dataset
from ascend_llm_recipes.models.conversion.ours import HF_WEIGHTS_FILE, MODEL_SECTION_FILE
from ascend_llm_recipes.models.conversion.verify import check_parity, compare_logits, reference_logits
from ascend_llm_recipes.training.launcher.cli import launch
from ascend_llm_recipes.training.recipe.loader_spec import loader_spec
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.run_files import RESOLVED_RECIPE
from ascend_llm_recipes.training.tools.export import find_our_checkpoint, read_model_section

STEPS = 3  # step 1 trains at learning rate 0 (warmup), steps 2 and 3 move the weights
END_OF_TEXT = "<|endoftext|>"
VOCAB = 512
# Qwen3-MoE as transformers builds it, at the tiny recipe's sizes: layer 0 dense (mlp_only_layers), layer 1 with
# 4 experts of width 48, top 2 renormalised. bos_token_id stays transformers' default (None), as Qwen configs may.
HF_CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0])


def save_tokenizer(out_dir):
    """A byte-level BPE of VOCAB tokens trained on the tiny corpus, saved by transformers (tokenizer.json and its
    config), Qwen's way: <|endoftext|> ends documents and is also named the pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    engine = Tokenizer(models.BPE())
    engine.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    engine.decoder = decoders.ByteLevel()
    engine.train(tiny_corpus_files(), trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[END_OF_TEXT],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                          show_progress=False))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=engine, eos_token=END_OF_TEXT,
                                                     pad_token=END_OF_TEXT)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def save_model(out_dir, eos_token_id):
    """The tiny random Qwen3-MoE, saved in bf16; norms randomised too, so a swapped tensor changes the logits."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**HF_CONFIG, eos_token_id=eos_token_id)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.05 + (1.0 if "norm" in name else 0.0))
    model.to(torch.bfloat16).save_pretrained(out_dir)


def write_paragraphs(path):
    """The tiny corpus's paragraphs as JSON lines: short documents, so that best-fit packing pads rows."""
    with open(path, "w", encoding="utf-8") as f:
        for name in tiny_corpus_files():
            with open(name, encoding="utf-8") as src:
                f.writelines(json.dumps({"text": p}) + "\n" for p in src.read().split("\n\n") if p.strip())


def write_recipe(path, converted, dataset, run_dir):
    """tiny_moe_cpu.yaml with the converted model section, continuing from the converted weights."""
    with open(os.path.join(converted, MODEL_SECTION_FILE), encoding="utf-8") as f:
        model = yaml.safe_load(f)["model"]
    recipe = {"base": MOE_RECIPE, "output_dir": str(run_dir), "load_checkpoint": str(converted),
              "load_ckpt_format": "safetensors", "runner_config": {"stop_step": STEPS},
              "train_dataset": {"data_loader": {"dataset_dir": str(dataset)}}, "model": model}
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(recipe, f, sort_keys=False)


@pytest.fixture(scope="module")
def continued(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_cpt")
    hf_dir, ours, data, run_dir = root / "hf", root / "ours", root / "data", root / "run"
    tokenizer = save_tokenizer(hf_dir)
    save_model(hf_dir, tokenizer.eos_token_id)
    convert, prepare = load_script("convert_checkpoint").main, load_script("prepare_data").main
    assert convert(["--from-hf", str(hf_dir), "--output", str(ours), "--verify", "--quiet"]) == 0
    write_paragraphs(root / "paragraphs.jsonl")
    assert prepare(["--input", str(root / "paragraphs.jsonl"), "--output", str(data), "--seq-length", "64",
                    "--tokenizer", str(ours), "--packing", "best_fit", "--max-chars", "200", "--workers", "0"]) == 0
    write_recipe(root / "recipe.yaml", ours, data, run_dir)
    assert launch(str(root / "recipe.yaml"), [], show_progress=False) == 0
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return SimpleNamespace(hf_dir=hf_dir, ours=ours, run_dir=run_dir, records=records)


def first_batch(run_dir):
    """The first global batch exactly as training read it: the run's recorded recipe, its loader, its order."""
    recipe = load_recipe(os.path.join(run_dir, RESOLVED_RECIPE))
    batches = build_train_dataset(loader_spec(recipe, 0)).create_tuple_iterator(output_numpy=True)
    return next(batches)[0]


def test_first_step_losses_are_transformers_on_the_first_batch(continued):
    """lm_loss is transformers' cross-entropy on the batch (labels shifted, padding -1 masked); the recorded router
    terms are transformers' on the same routing; the loss weights them with the converted model's coefficients."""
    first = continued.records[0]
    batch = first_batch(continued.run_dir)
    assert batch.shape == (4, 65) and (batch == -1).any()  # best-fit rows end in padding: its labels must not count
    ids = torch.from_numpy(batch).long()
    model = transformers.AutoModelForCausalLM.from_pretrained(continued.hf_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model.eval()(ids[:, :-1].clamp(min=0), output_router_logits=True)  # padding ids read as token 0
    hf_loss = float(torch.nn.functional.cross_entropy(out.logits.double().reshape(-1, VOCAB), ids[:, 1:].reshape(-1),
                                                      ignore_index=-1))
    print(f"\n[moe continued pretraining] first-step lm_loss {first['lm_loss']:.7f}, transformers {hf_loss:.7f}")
    assert first["lm_loss"] == pytest.approx(hf_loss, rel=1e-5)

    (router_logits,) = out.router_logits  # one MoE layer: (B * S, experts)
    k = HF_CONFIG["num_experts_per_tok"]
    # transformers counts each token's k slots (sum_e f_e = k), ours the slots' fractions (models/moe.py)
    assert first["load_balancing_loss"] * k == pytest.approx(float(out.aux_loss), rel=1e-5)
    z = torch.logsumexp(router_logits.double(), dim=-1).pow(2).mean()
    assert first["router_z_loss"] == pytest.approx(float(z), rel=1e-5)
    slots = torch.bincount(router_logits.topk(k, dim=-1).indices.reshape(-1), minlength=HF_CONFIG["num_experts"])
    assert first["expert_load"] == [round(float(slots.max() / slots.double().mean()), 4)]
    # The converted section's router coefficients (Qwen3's 0.001, no z-loss) replace the recipe's.
    for r in continued.records:
        assert r["loss"] == pytest.approx(r["lm_loss"] + 0.001 * r["load_balancing_loss"], rel=1e-6)


def our_logits(checkpoint, section, tokens):
    """Our model's (B, S, vocab) float64 logits with the weights of a run's checkpoint."""
    import mindspore as ms
    from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
    from ascend_llm_recipes.models.shapes import STATISTICS

    cfg, _ = read_model_section(section)
    net = LlamaForCausalLM(LlamaConfig(**{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "type"}))
    not_loaded, _ = ms.load_param_into_net(net, ms.load_checkpoint(checkpoint))
    assert [name for name in not_loaded if not name.endswith(STATISTICS)] == []
    return net.logits(ms.Tensor(tokens.astype(np.int32))).asnumpy().astype(np.float64)[..., :cfg.vocab_size]


def test_the_continued_run_exports_to_transformers_with_its_trained_weights(continued, tmp_path):
    back = tmp_path / "back"
    assert load_script("convert_checkpoint").main(["--to-hf", str(continued.run_dir), "--output", str(back),
                                                   "--quiet"]) == 0
    checkpoint, section, _ = find_our_checkpoint(str(continued.run_dir))
    assert f"step_{STEPS:08d}" in checkpoint
    trained, original = load_file(str(back / HF_WEIGHTS_FILE)), load_file(str(continued.hf_dir / HF_WEIGHTS_FILE))
    assert sorted(trained) == sorted(original)
    moved = [name for name in original if not torch.equal(trained[name], original[name].float())]
    assert "model.layers.1.mlp.gate.weight" in moved and "model.layers.1.mlp.experts.3.down_proj.weight" in moved
    assert len(moved) == len(original)  # every tensor trained, the router and each expert included

    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 64))
    result = compare_logits(reference_logits(str(back), tokens), our_logits(checkpoint, section, tokens))
    print(f"\n[moe export] step {STEPS}: max |delta logits| {result['max_abs_delta']:.3e}, KL {result['kl']:.3e}")
    check_parity(result, str(back))
    exported = transformers.AutoModelForCausalLM.from_pretrained(back).config
    assert (exported.model_type, exported.num_experts, exported.mlp_only_layers) == ("qwen3_moe", 4, [0])
    assert (exported.bos_token_id, exported.eos_token_id) == (None, 0)  # no begin-of-text token, as it came in
    text = "def mean(values):\n    return sum(values) / len(values)\n"
    assert transformers.AutoTokenizer.from_pretrained(back).encode(text) == \
        transformers.AutoTokenizer.from_pretrained(continued.hf_dir).encode(text)
