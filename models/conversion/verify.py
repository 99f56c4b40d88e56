"""Parity: our logits against a reference's on the same random tokens, one rule for every direction.

The reference is transformers for HuggingFace directories, a pure-torch forward for Meta's layout
(torch_state.py) and for Megatron's (megatron.py); verify_against runs any of them.
"""

import os
import tempfile
from dataclasses import fields

import numpy as np

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.models.conversion.ours import (CHECKPOINT_FILE, MODEL_SECTION_FILE, STACKED, expert_layout,
                                                       read_model_file, unstack_moe_layers)


# --verify bounds for float32 weights (bf16 sources are widened exactly). Rounding error grows with the
# logits' magnitude, so max |delta| is bounded relative to the reference's largest |logit| (at least 1).
LOGIT_TOLERANCE = 1e-4
KL_TOLERANCE = 1e-6


def load_our_model(converted_dir: str):
    """Our LlamaForCausalLM with a converted checkpoint loaded strictly (every parameter, nothing else); MoE layers
    stacked as MindFormers' MoELayer holds them (--expert-layout stacked) are split into our experts on load."""
    if "LOCAL_DEFAULT_PATH" not in os.environ:  # MindFormers logs to ./output from import time on otherwise
        os.environ["LOCAL_DEFAULT_PATH"] = tempfile.mkdtemp(prefix="mindformers-log-")
    import mindspore as ms
    from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
    from ascend_llm_recipes.models.shapes import STATISTICS

    cfg = read_model_file(os.path.join(converted_dir, MODEL_SECTION_FILE))
    if ms.get_context("device_target") != "CPU":  # compared with transformers on the CPU
        ms.set_device("CPU")
    net = LlamaForCausalLM(LlamaConfig(**{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "type"}))
    params = ms.load_checkpoint(os.path.join(converted_dir, CHECKPOINT_FILE), format="safetensors")
    if expert_layout(params, cfg) == STACKED:
        params = {name: ms.Parameter(ms.Tensor(value), name=name) for name, value in
                  unstack_moe_layers({name: param.asnumpy() for name, param in params.items()}, cfg).items()}
    not_loaded, unused = ms.load_param_into_net(net, params, strict_load=True)
    not_loaded = [name for name in not_loaded if not name.endswith(STATISTICS)]  # MoE counters, not weights
    if not_loaded or unused:
        raise ConversionError(f"{converted_dir}: checkpoint and model disagree: parameters not loaded "
                              f"{not_loaded}, checkpoint entries unused {unused}")
    return net, cfg


def verify_logits(hf_dir: str, converted_dir: str, batch: int = 2, max_tokens: int = 128, seed: int = 0) -> dict:
    """Logits of transformers (float32, CPU) and of our model on the same random tokens.

    Returns max |delta logits| and the mean over positions of KL(hf || ours); raises when
    either exceeds its tolerance.
    """
    return verify_against(lambda tokens: reference_logits(hf_dir, tokens), converted_dir, hf_dir, batch=batch,
                          max_tokens=max_tokens, seed=seed)


def verify_against(reference, converted_dir: str, where: str, name: str = "transformers",
                   hint: str = "nothing was written; report the model's config.json", batch: int = 2,
                   max_tokens: int = 128, seed: int = 0, label: str = None) -> dict:
    """Our logits against reference(tokens) -> (B, S, vocab) logits on random tokens; raises outside PARITY_RULE.

    The one parity check of every direction: transformers for from_hf (verify_logits), a pure-torch
    forward for Meta's layout and for Megatron's (megatron.py). `name` is recorded in the manifest,
    `label` (default: name) is what the error says the logits differ from.
    """
    import mindspore as ms

    net, cfg = load_our_model(converted_dir)
    length = min(cfg.seq_length, max_tokens)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(batch, length))
    ours = net.logits(ms.Tensor(tokens.astype(np.int32))).asnumpy().astype(np.float64)[..., :cfg.vocab_size]
    del net
    result = compare_logits(reference(tokens), ours)
    result.update(batch=batch, tokens=length, reference=name)
    check_parity(result, where, reference=label or (name if name != "transformers" else "transformers'"), hint=hint)
    return result


def reference_logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
    """transformers' float32 CPU logits (float64) of an HF directory on `tokens` (B, S): the parity reference."""
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return reference.eval()(torch.from_numpy(tokens)).logits.double().numpy()


def compare_logits(reference: np.ndarray, ours: np.ndarray) -> dict:
    """max |delta|, its tolerance (relative to the reference's largest |logit|) and mean KL(reference || ours)."""
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    log_p, log_q = log_softmax(reference), log_softmax(ours)
    kl = float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())
    scale = float(np.abs(reference).max())
    return {"max_abs_delta": float(np.abs(reference - ours).max()), "logit_scale": scale,
            "max_abs_tolerance": LOGIT_TOLERANCE * max(1.0, scale), "kl": kl}


PARITY_RULE = (f"max |delta| <= {LOGIT_TOLERANCE:g} x max(1, largest |logit|), "
               f"KL(hf || ours) <= {KL_TOLERANCE:g}")


def check_parity(result: dict, where: str, reference: str = "transformers'",
                 hint: str = "nothing was written; report the model's config.json") -> None:
    """Refuse logits outside PARITY_RULE (float32 rounding scales with the logits; a wrong tensor does not)."""
    if not (result["max_abs_delta"] <= result["max_abs_tolerance"] and result["kl"] <= KL_TOLERANCE):
        raise ConversionError(f"{where}: converted logits differ from {reference}: max |delta| "
                              f"{result['max_abs_delta']:.3e} (tolerance {result['max_abs_tolerance']:.2e} = "
                              f"{LOGIT_TOLERANCE:g} x largest |logit| {result['logit_scale']:.3g}, at least "
                              f"{LOGIT_TOLERANCE:g}), KL(reference || ours) {result['kl']:.3e} "
                              f"(tolerance {KL_TOLERANCE:.0e})",
                              hint=hint)
