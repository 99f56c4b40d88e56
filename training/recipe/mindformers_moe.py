"""MindFormers 1.9's own format (`use_legacy: False`): its router, MoE layer and multi-latent attention keys.

A mixin of McoreImporter (mindformers_mcore.py). Each key is accepted only where MindFormers' training graph
computes what ours does (models/moe.py Router, models/mla.py, training/worker/router_stats.py); anything else is
refused by name with the difference. The value of a setting is the one MindFormers' TransformerConfig ends up
with: the family's Hugging Face key (DeepSeek-V3's n_group, ...), else the TransformerConfig key itself (any of
its names is accepted in model_config, parallel_core/config_converter.py:157-168), else the family's default.
File:line references are to the installed MindFormers 1.9 (site-packages `mindformers/`); "router.py" is
parallel_core/training_graph/transformer/moe/router.py.
"""

import math

M = "model.model_config."
R = M  # our keys: the same section
# TransformerConfig field -> the family's Hugging Face key converted to it (models/qwen3_moe/
# config_converter_qwen3_moe.py:26-33, models/deepseek3/config_converter_deepseek_v3.py:26-54).
HF_NAMES = {
    "qwen3_moe": {"num_moe_experts": "num_experts", "moe_router_topk_scaling_factor": "routed_scaling_factor"},
    "deepseek_v3": {"num_moe_experts": "n_routed_experts", "moe_router_topk_scaling_factor": "routed_scaling_factor",
                    "moe_router_num_groups": "n_group", "moe_router_group_topk": "topk_group",
                    "shared_expert_num": "n_shared_experts", "mtp_num_layers": "num_nextn_predict_layers",
                    "mtp_loss_scaling_factor": "mtp_loss_factor", "qk_head_dim": "qk_nope_head_dim",
                    "qk_pos_emb_head_dim": "qk_rope_head_dim"},
}
# What a key left out becomes: MLATransformerConfig's / TransformerConfig's field defaults
# (parallel_core/transformer_config.py), overridden per family by its config class: DeepseekV3Config's __init__
# defaults and registered MindFormers parameters (models/deepseek3/configuration_deepseek_v3.py:139-199).
TC_DEFAULTS = dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
                   moe_router_bias_update_rate=0.001, moe_router_num_groups=None, moe_router_group_topk=None,
                   moe_router_topk_scaling_factor=None, moe_shared_expert_intermediate_size=None, shared_expert_num=0,
                   use_shared_expert_gating=False, first_k_dense_replace=None, moe_layer_freq=1, mtp_num_layers=None,
                   rotary_scaling_factor=40.0, mscale=0.707, qk_layernorm=False, q_lora_rank=512, kv_lora_rank=512,
                   qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
FAMILY_DEFAULTS = {
    "deepseek_v3": dict(num_moe_experts=256, moe_router_num_groups=8, moe_router_group_topk=4, shared_expert_num=1,
                        moe_router_topk_scaling_factor=2.5, first_k_dense_replace=3, moe_layer_freq=1,
                        mtp_num_layers=1, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                        qk_pos_emb_head_dim=64, v_head_dim=128, moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True),
}
# Models whose update_topk_bias TopkBiasBalanceCallback calls after every step (core/callback/callback.py:2934-2949):
# DeepSeek-V3 (models/deepseek3/modeling_deepseek_v3_train.py:102). Qwen3-MoE's training class has none, and the
# callback's other path reads legacy layers only when balance_via_topk_bias (callback.py:2950): its bias never moves.
BIAS_UPDATED = ("deepseek_v3",)

# moe_router_load_balancing_type whose token groups are those of model_config.router_aux_loss_scope (models/moe.py
# LoadBalancingLoss) at every layout: written by mindformers_mcore_export.py, read back by mindformers_mcore.py
# balancing. "global": gbs_aux_loss takes f over every data-parallel block of the pass (router.py:411-422) and P per
# block, averaged by the loss's mean over blocks (router.py:424-425): E * sum_e f_e * P_e over the whole
# micro-batch; with several passes per step (pipeline micro-batches, gradient accumulation) each pass's f is the
# mean of the step's passes so far (fi_accu, router.py:412-419), as megatron-core's global_aux_loss; fi_accu is
# zeroed every step (training/worker/router_stats.py). "micro_batch": seq_aux_loss takes f per data-parallel block,
# averaged over its model-parallel parts (router.py:403-406), each pass alone.
LOAD_BALANCING = {"global": "gbs_aux_loss", "micro_batch": "seq_aux_loss"}


class MoEKeys:
    """Router, MoE-layer and MLA keys of McoreImporter (which provides get/carry/put/drop/problems/...)."""

    def setting(self, name: str):
        """(value, the key that gave it or None) of TransformerConfig field `name` for this family."""
        for key in (HF_NAMES.get(self.family, {}).get(name), name):
            if key and self.has(M + key):
                return self.get(M + key), key
        return FAMILY_DEFAULTS.get(self.family, {}).get(name, TC_DEFAULTS.get(name)), None

    def take(self, name: str, ours: str = None, value=None, reason: str = "") -> None:
        """Report the key of setting `name` (or its default) as carried to `ours`, or dropped when ours is None."""
        given, key = self.setting(name)
        key = key or HF_NAMES.get(self.family, {}).get(name, name)
        if ours is None:
            if self.has(M + key):
                self.drop(M + key, reason)
            return
        self.put(R + ours, given if value is None else value)
        if self.has(M + key):
            self.taken.add(M + key)
            self.report.add(M + key, given, "carried" if key == ours and value in (None, given) else "translated",
                            R + ours, reason)
        else:
            self.report.add(M + key, "(absent)", "default", R + ours, reason or "MindFormers' default")

    def refuse(self, name: str, message: str) -> None:
        value, key = self.setting(name)
        key = key or HF_NAMES.get(self.family, {}).get(name, name)
        self.problems.append(f"{M}{key}: {value!r}{' (MindFormers default)' if not self.has(M + key) else ''}: "
                             f"{message}")
        self.taken.add(M + key)

    # -- the router ----------------------------------------------------------------------------
    def router(self, k: int) -> None:
        """Score function, expert bias and its update, group-limited top-k, routed scaling (router.py:259-296)."""
        score, _ = self.setting("moe_router_score_function")
        if score not in ("softmax", "sigmoid"):
            self.refuse("moe_router_score_function", "softmax or sigmoid only (router.py:34-37)")
            return
        self.take("moe_router_score_function", "router_score", reason="router.py:272: scores = softmax/sigmoid of "
                  "the logits; with sigmoid the load-balancing loss reads them normalised per token (router.py:274), "
                  "as ours (models/moe.py Router)")
        self.drop(M + "scoring_func", "DeepseekV3Config deletes it (configuration_deepseek_v3.py:157); the score "
                                      "function is moe_router_score_function")
        self.drop(M + "topk_method", "not read by MindFormers' training router (router.py)")
        self.expert_bias()
        self.groups(k)
        factor, _ = self.setting("moe_router_topk_scaling_factor")
        # router.py:290-295 renormalises the top-k weights (k > 1 and norm_topk_prob), then multiplies by the factor;
        # models/moe.py Router renormalises, then multiplies: the same order.
        self.take("moe_router_topk_scaling_factor", "routed_scaling_factor", value=1.0 if factor is None else
                  float(factor), reason="routed weights x this after renormalisation (router.py:290-295), as ours")

    def expert_bias(self) -> None:
        """moe_router_enable_expert_bias / moe_router_bias_update_rate (router.py:168-186, 277-278, 369-386)."""
        enabled, _ = self.setting("moe_router_enable_expert_bias")
        rate, _ = self.setting("moe_router_bias_update_rate")
        score, _ = self.setting("moe_router_score_function")
        callback = [i for i, c in enumerate(self.src.get("callbacks") or [])
                    if isinstance(c, dict) and c.get("type") == "TopkBiasBalanceCallback"]
        if not enabled:
            self.take("moe_router_enable_expert_bias", "expert_bias", value=False, reason="no expert bias")
            self.take("moe_router_bias_update_rate", None, reason="no expert bias to update")
            return
        if score != "sigmoid":
            self.refuse("moe_router_enable_expert_bias", "an expert bias on softmax scores is not implemented by ours "
                                                         "(DeepSeek-V3's bias applies to sigmoid scores)")
            return
        self.take("moe_router_enable_expert_bias", "expert_bias", value=True,
                  reason="top-k chosen by scores + bias, weighted by the scores alone (router.py:277-278, 369-377), "
                         "as ours")
        moved = bool(callback) and self.family in BIAS_UPDATED
        if moved:
            self.bias_target(callback[0])
        # gpt_model.py:632-641: bias += rate x sign(micro_batch_num x GA / E - load), load the fraction of routing
        # slots per expert summed over the step's passes (router.py:379-386): the sign of (mean load - load), as
        # ours from the counts summed over data-parallel ranks (router_stats.py update_expert_bias).
        why = ("bias += rate x sign(mean load - load) after every step (gpt_model.py:632-641 via "
               "TopkBiasBalanceCallback), as ours (training/worker/router_stats.py)" if moved else
               "never applied: " + ("no TopkBiasBalanceCallback in callbacks" if not callback else
                                    f"{self.family}'s training model has no update_topk_bias (callback.py:2938)") +
               ", so the bias stays 0; ours: rate 0")
        self.take("moe_router_bias_update_rate", "expert_bias_update_rate", value=float(rate) if moved else 0.0,
                  reason=why)
        for i in callback:
            for key in [k for k in self.leaves if k.startswith(f"callbacks[{i}].")]:
                self.drop(key, "ours moves expert_bias after every step (router_stats.py)")

    def bias_target(self, index: int) -> None:
        """MindFormers moves each bias towards micro_batch_num x the callback's gradient_accumulation_steps / E
        (gpt_model.py:403-404, 635), while a step's load sums to its forward passes (each adds the fraction of its
        routing slots per expert, router.py:379-386): micro_batch_num with pipeline stages, else
        runner_config.gradient_accumulation_steps (which pipeline stages ignore, trainer/base_trainer.py:228).
        Only when the two agree is the sign that of (mean load - load), as ours."""
        c = "parallel_config."
        micro, stages = self.get(c + "micro_batch_num", 1), self.get(c + "pipeline_stage", 1)
        accumulation = self.get(f"callbacks[{index}].gradient_accumulation_steps", 1)
        passes = micro if stages > 1 else self.get("runner_config.gradient_accumulation_steps", 1)
        if micro * accumulation != passes:
            self.problems.append(
                f"parallel_config.micro_batch_num, callbacks[{index}].gradient_accumulation_steps: {micro} x "
                f"{accumulation}: MindFormers moves the expert bias towards {micro * accumulation} / experts per step "
                f"(gpt_model.py:403-404, 635) while a step's {passes} forward pass(es) load each expert {passes} / "
                "experts on average, so every bias drifts the same way; ours moves it towards the step's mean load "
                f"(router_stats.py). Make micro_batch_num x the callback's gradient_accumulation_steps {passes}")
            self.taken.update({c + "micro_batch_num", f"callbacks[{index}].gradient_accumulation_steps"})

    def groups(self, k: int) -> None:
        """Group-limited top-k (router.py:246-253, 307-357)."""
        groups, _ = self.setting("moe_router_num_groups")
        top, _ = self.setting("moe_router_group_topk")
        if not groups or groups <= 1:
            self.take("moe_router_num_groups", "n_group", value=1, reason="no group-limited routing")
            self.take("moe_router_group_topk", None, reason="no group-limited routing (moe_router_num_groups unset)")
            return
        if not top or k // top != 2:
            # router.py:336-338: a group's score is the sum of its top (moe_router_topk // moe_router_group_topk)
            self.refuse("moe_router_group_topk", f"MindFormers scores each group by the sum of its best "
                        f"num_experts_per_tok // group_topk = {k // top if top else 'undefined'} scores (router.py:"
                        "336-338); ours, as DeepSeek-V3 and transformers' DeepseekV3TopkRouter, by its best two. "
                        f"The same only when num_experts_per_tok // group_topk is 2 (here {k} // {top})")
            return
        self.take("moe_router_num_groups", "n_group", reason="experts in this many groups (router.py:331-335)")
        self.take("moe_router_group_topk", "topk_group", reason="top-k within this many groups, each scored by its "
                  "best k // topk_group = 2 scores with the bias (router.py:336-346), as ours")

    # -- the MoE layer -------------------------------------------------------------------------
    def shared_experts(self) -> None:
        """moe_shared_expert_intermediate_size, else moe_ffn_hidden_size x shared_expert_num
        (transformer_config.py:2108-2121); the gate use_shared_expert_gating (moe/shared_experts.py:66-83)."""
        size, key = self.setting("moe_shared_expert_intermediate_size")
        count, _ = self.setting("shared_expert_num")
        width = self.value("moe_intermediate_size")
        total = size if size is not None else (width * count if count else 0)
        if size is not None:
            self.take("moe_shared_expert_intermediate_size", "shared_expert_intermediate_size",
                      reason="one shared SwiGLU expert of this width sees every token (moe_layer.py:65, 234-236)")
            self.take("shared_expert_num", None, reason="moe_shared_expert_intermediate_size gives the width "
                                                       "(transformer_config.py:2108-2119)")
        else:
            self.take("shared_expert_num", "shared_expert_intermediate_size", value=total,
                      reason=f"{count} x moe_intermediate_size {width} wide (transformer_config.py:2120-2121)"
                      if count else "no shared expert")
        gate, _ = self.setting("use_shared_expert_gating")
        if gate and not total:
            self.take("use_shared_expert_gating", None, reason="no shared expert to gate")
            return
        self.take("use_shared_expert_gating", "shared_expert_gate", value=bool(gate),
                  reason="sigmoid(x w) scales the shared expert (shared_experts.py:81-83; MindFormers computes the "
                         "gate in float32, ours in compute_dtype: rounding only)" if gate else "no gate")

    def dense_layers(self, layers: int) -> None:
        """DeepSeek-V3: first_k_dense_replace, else moe_layer_freq (gpt_layer_specs.py:222-248)."""
        first, _ = self.setting("first_k_dense_replace")
        freq, _ = self.setting("moe_layer_freq")
        if first:
            dense = list(range(first))
            self.take("first_k_dense_replace", "dense_layers", value=dense,
                      reason="the first layers keep the dense MLP (gpt_layer_specs.py:226-228)")
            self.take("moe_layer_freq", None, reason="first_k_dense_replace wins (gpt_layer_specs.py:226-230)")
            return
        if isinstance(freq, int) and freq >= 1:
            dense = [i for i in range(layers) if i % freq]
        elif isinstance(freq, list) and len(freq) == layers and set(freq) <= {0, 1}:
            dense = [i for i, moe in enumerate(freq) if not moe]
        else:
            self.refuse("moe_layer_freq", f"one whole number or a 0/1 list of {layers} layers "
                                          "(gpt_layer_specs.py:229-240)")
            return
        self.take("first_k_dense_replace", None, reason="unset")
        self.take("moe_layer_freq", "dense_layers", value=dense, reason="layers marked 0 keep the dense MLP "
                                                                        "(gpt_layer_specs.py:229-248)")

    def multi_token_prediction(self) -> None:
        depth, _ = self.setting("mtp_num_layers")
        if depth:
            self.refuse("mtp_num_layers", "multi-token prediction (DeepSeek-V3's MTP layers predicting further "
                                          "tokens, their loss x mtp_loss_factor: gpt_model.py, "
                                          "transformer/multi_token_prediction.py) is not implemented by ours; set "
                                          "num_nextn_predict_layers: 0")
            return
        self.take("mtp_num_layers", None, reason="no multi-token prediction")
        self.take("mtp_loss_scaling_factor", None, reason="no multi-token prediction")

    # -- multi-latent attention ----------------------------------------------------------------
    def mla(self) -> None:
        """MLA (multi_latent_attention.py:79-160, 599-705; gpt_layer_specs.py:127-158) -> models/mla.py."""
        for name, ours in (("q_lora_rank", "q_lora_rank"), ("kv_lora_rank", "kv_lora_rank"),
                           ("qk_head_dim", "qk_nope_head_dim"), ("qk_pos_emb_head_dim", "qk_rope_head_dim"),
                           ("v_head_dim", "v_head_dim")):
            self.take(name, ours, reason="" if name == ours else "our (Hugging Face's) name")
        if not self.setting("qk_layernorm")[0]:
            self.refuse("qk_layernorm", "without it MindFormers' MLA has no q/kv latent RMSNorms (IdentityOp, "
                                        "gpt_layer_specs.py:154-155); ours, as DeepSeek-V3, normalises both latents")
        else:
            self.take("qk_layernorm", None, reason="RMSNorm of the q and kv latents (gpt_layer_specs.py:154-155), as "
                                                   "ours (models/mla.py q_a_layernorm, kv_a_layernorm)")
        self.put(R + "qk_norm", False)
        factor, factor_key = self.setting("rotary_scaling_factor")
        mscale, mscale_key = self.setting("mscale")
        scale = 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
        where = "multi_latent_attention.py:137-138"
        if scale != 1.0:
            # with embeddings/yarn_rotary_pos_embedding.py:162-165, whatever rope_scaling says
            given = [f"{name} {value}" + ("" if key else " (MLATransformerConfig's default)")
                     for name, value, key in (("rotary_scaling_factor", factor, factor_key),
                                              ("mscale", mscale, mscale_key))]
            self.problems.append(f"{M}rotary_scaling_factor, {M}mscale: {' and '.join(given)}: MindFormers' MLA "
                                 "scales attention scores by (0.1 x mscale x ln(rotary_scaling_factor) + 1)^2 = "
                                 f"{scale * scale:.4f} / sqrt(qk head dim) ({where}) even with plain rotary "
                                 "embeddings; ours by 1 / sqrt(qk head dim). Set rotary_scaling_factor: 1 "
                                 "(or mscale: 0)")
            self.taken.update({M + "rotary_scaling_factor", M + "mscale"})
        else:
            for name in ("rotary_scaling_factor", "mscale"):
                self.take(name, None, reason=f"softmax scale 1 / sqrt(qk head dim) ({where})")
        self.drop(M + "mscale_all_dim", f"not read by MindFormers' training MLA ({where} reads mscale)")
        self.drop(M + "num_key_value_heads", "MLA: one key/value head per query head "
                                             "(multi_latent_attention.py:681-691), as ours")
        self.drop(M + "mla_qkv_concat", "q/kv down-projections stored as one matrix: the same math")
        self.drop(M + "head_dim", "MLA: heads of qk_nope_head_dim + qk_rope_head_dim "
                                  "(multi_latent_attention.py:114-116)")
