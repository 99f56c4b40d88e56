"""The model's configuration, defined once: the recipe's `model:` section and LlamaConfig's fields.

Import-light (no MindSpore): recipes are validated, converted and planned without building the
model. models/llama.py's LlamaConfig takes these fields and these defaults.
"""

from dataclasses import dataclass, field
from typing import Literal, Optional

from ascend_llm_recipes.models import LLAMA_CONFIG_TYPE, LLAMA_MODEL_TYPE
from ascend_llm_recipes.models.arithmetic import ALIGN, round_up


@dataclass
class ModelConfig:
    """The recipe's model.model_config: architecture of the Llama-style decoder (models/llama.py) and its kernels."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    seq_length: int
    type: Literal[LLAMA_CONFIG_TYPE] = LLAMA_CONFIG_TYPE
    num_kv_heads: Optional[int] = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    qkv_bias: bool = False                 # bias on q/k/v projections (Qwen2-style checkpoints)
    vocab_pad_multiple: int = ALIGN        # tables padded to a multiple of this x model_parallel
    document_attention: bool = False       # packed documents: reset positions, block attention at EOD
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 3
    compute_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # dtype the matmul weights and tables are stored in (MindFormers' param_init_type / params_dtype). float32:
    # they are their own master copy (the CPU reference). 16-bit: half the weight, gathered-weight and accu_grads
    # bytes; the fp32 master copy then lives in the optimizer (training/worker/optim.py FoldedAdamW), sliced over DP
    # with the moments. Norm weights stay float32 (models/shapes.py parameter_dtype).
    param_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # Ascend kernels, MindFormers' keys and meanings (mindformers/models/llama/llama_config.py:165-186);
    # the math path (all False) is the CPU default and the reference. None changes a parameter.
    use_flash_attention: bool = False
    use_attn_mask_compression: bool = False      # FlashAttention's 2048 x 2048 causal band (sparse_mode 2)
    use_eod_attn_mask_compression: bool = False  # FlashAttention per document (TND, sparse_mode 8)
    fused_rms_norm: bool = False                 # MindFormers' default is True (on Ascend)

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or one per query head when unset (no grouped-query attention)."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def kernel_problems(self, recipe) -> list:
        """Ascend-kernel keys that cannot apply, each named."""
        p = "model.model_config"
        kernels = ("use_flash_attention", "use_attn_mask_compression", "use_eod_attn_mask_compression",
                   "fused_rms_norm")
        if recipe.runs_on_cpu:
            return [f"{p}.{name}: selects an Ascend kernel that has no CPU implementation; set it to False on CPU "
                    "(the math path computes the same)" for name in kernels if getattr(self, name)]
        problems = []
        # MindFormers' own rules (mindformers/models/llama/llama.py:115-116; modules/transformer/transformer.py:820).
        for name in ("use_attn_mask_compression", "use_eod_attn_mask_compression"):
            if getattr(self, name) and not self.use_flash_attention:
                problems.append(f"{p}.{name}: needs {p}.use_flash_attention: True")
        if self.use_eod_attn_mask_compression and not self.document_attention:
            problems.append(f"{p}.use_eod_attn_mask_compression: is FlashAttention's document mode; it needs "
                            f"{p}.document_attention: True")
        if (self.use_attn_mask_compression or self.use_eod_attn_mask_compression) and self.seq_length < 2048:
            problems.append(f"{p}.use_attn_mask_compression: the compressed mask is 2048 x 2048; seq_length "
                            f"{self.seq_length} is below 2048 (use the full mask: set it to False)")
        return problems

    def check(self, recipe) -> list:
        """Problems of this section, each naming its key; `recipe` is the Recipe (its runs_on_cpu)."""
        p = "model.model_config"
        problems = [f"{p}.{name}: must be >= 1, got {getattr(self, name)}"
                    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                                 "seq_length") if getattr(self, name) < 1]
        if problems:
            return problems
        problems.extend(f"{p}.{name}: must be > 0, got {getattr(self, name)}"
                        for name in ("rms_norm_eps", "rope_theta", "initializer_range")
                        if getattr(self, name) is not None and not getattr(self, name) > 0)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if name == "pad_token_id" and self.pad_token_id == -1:
                continue  # no pad token: data prepared with such a tokenizer pads with -1, masked from the loss
            if not 0 <= getattr(self, name) < self.vocab_size:
                problems.append(f"{p}.{name}: {getattr(self, name)} is not a token id of the vocabulary "
                                f"(0..{self.vocab_size - 1})")
        if self.seq_length % ALIGN:
            problems.append(f"{p}.seq_length: {self.seq_length} is not a multiple of {ALIGN}; Ascend pads "
                            f"such shapes inside every matmul. Use {round_up(self.seq_length, ALIGN)}")
        if self.vocab_pad_multiple < 1 or self.vocab_pad_multiple % ALIGN:
            problems.append(f"{p}.vocab_pad_multiple: {self.vocab_pad_multiple} must be a positive multiple of "
                            f"{ALIGN}")
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % ALIGN:
                problems.append(f"{p}.{name}: {getattr(self, name)} is not a multiple of {ALIGN} (the Cube "
                                f"unit's tile); use {round_up(getattr(self, name), ALIGN)}")
        if not self.hidden_size % self.num_heads and (self.hidden_size // self.num_heads) % ALIGN:
            problems.append(f"{p}.hidden_size, {p}.num_heads: head size {self.hidden_size // self.num_heads} is not "
                            f"a multiple of {ALIGN}; attention matmuls would be padded on Ascend")
        if self.hidden_size % self.num_heads:
            problems.append(f"{p}.hidden_size, {p}.num_heads: hidden_size {self.hidden_size} is not "
                            f"divisible by num_heads {self.num_heads}")
        elif (self.hidden_size // self.num_heads) % 2:
            problems.append(f"{p}.hidden_size, {p}.num_heads: head size {self.hidden_size // self.num_heads} "
                            "must be even for rotary embeddings")
        if self.kv_heads < 1 or self.num_heads % self.kv_heads:
            problems.append(f"{p}.num_kv_heads: {self.kv_heads} must divide num_heads {self.num_heads}")
        if self.compute_dtype == "bfloat16" and recipe.runs_on_cpu:
            problems.append(f"{p}.compute_dtype: bfloat16 kernels exist only on Ascend/GPU; "
                            "use float32 (or float16) on CPU")
        if self.param_dtype == "bfloat16" and recipe.runs_on_cpu:
            problems.append(f"{p}.param_dtype: bfloat16 kernels exist only on Ascend/GPU; "
                            "use float32 (or float16) on CPU")
        if self.param_dtype != "float32" and self.param_dtype != self.compute_dtype:
            problems.append(f"{p}.param_dtype: {self.param_dtype} weights are cast to compute_dtype "
                            f"{self.compute_dtype} at every use; store them in the compute dtype or in float32")
        return problems + self.kernel_problems(recipe)


@dataclass
class ArchConfig:
    type: Literal[LLAMA_MODEL_TYPE] = LLAMA_MODEL_TYPE


@dataclass
class ModelSection:
    model_config: ModelConfig
    arch: ArchConfig = field(default_factory=ArchConfig)
