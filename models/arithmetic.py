"""Closed-form sizes of a Llama-style model: alignment, padded vocabulary, parameters, training FLOPs.

Import-light (no MindSpore): recipes and planners use it on plain configs; step_gemms lists the GEMMs a
training step runs (the MFU yardstick of scripts/benchmark_training.py measures them). `cfg` is a ModelConfig
(models/config.py) or a LlamaConfig; the counts are sums over models/shapes.py's tensors. A Mixture-of-Experts
model has two counts: all its parameters, and the active ones a token passes through (top-k of the routed
experts), from which its training FLOPs follow.
"""

import math
from dataclasses import dataclass

ALIGN = 16  # Ascend's Cube unit works on 16x16 tiles: sequence, widths and vocabulary are multiples of it


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= value."""
    return -(-value // multiple) * multiple


def padded_vocab_size(vocab_size: int, pad_multiple: int = ALIGN, tensor_parallel: int = 1) -> int:
    """Rows of the embedding/output tables: the vocabulary rounded up to pad_multiple x TP."""
    return round_up(vocab_size, pad_multiple * tensor_parallel)


def expert_capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Routing slots one expert takes of `tokens` tokens' top_k each (model_config.capacity_factor): megatron-core's
    get_capacity(num_tokens * topk, num_experts, capacity_factor) in apply_router_token_dropping
    (megatron/core/transformer/moe/moe_utils.py:208, :832-836 in 0.16.1), the same float expression."""
    return math.ceil(tokens * top_k / num_experts * factor)


def _layer_shapes(cfg, layer: int = 0) -> dict:
    """{name: shape} of decoder layer `layer`'s parameters (layers differ in a model with dense_layers)."""
    from ascend_llm_recipes.models.shapes import parameter_shapes  # shapes.py uses padded_vocab_size above

    return {name: shape for name, shape in parameter_shapes(cfg, layers=range(layer, layer + 1)).items()
            if ".layers." in name}


def _idle_expert(cfg, name: str) -> bool:
    """Whether `name` is a routed expert beyond the first num_experts_per_tok of its layer: the experts are of
    equal size, so counting the first k of each MoE layer counts the k a token reaches."""
    return ".mlp.experts." in name and int(name.split(".mlp.experts.")[1].split(".")[0]) >= cfg.num_experts_per_tok


def layer_matmul_params(cfg, layer: int = 0, active: bool = False) -> int:
    """Weights of decoder layer `layer`'s matrix multiplications: q/k/v/o and the SwiGLU MLP, or in an MoE layer
    the router, every routed expert (active=True: the top-k a token reaches) and the shared expert and its gate."""
    return sum(math.prod(shape) for name, shape in _layer_shapes(cfg, layer).items()
               if len(shape) == 2 and not (active and _idle_expert(cfg, name)))


def layer_params(cfg, layer: int = 0) -> int:
    """All parameters of decoder layer `layer`: matmul weights, q/k/v bias if any, the norms."""
    return sum(math.prod(shape) for shape in _layer_shapes(cfg, layer).values())


def param_count(cfg, tensor_parallel: int = 1, padded: bool = True) -> int:
    """All parameters; with padded=True the embedding/output tables include the padding rows."""
    from ascend_llm_recipes.models.shapes import parameter_shapes

    return sum(math.prod(shape) for shape in parameter_shapes(cfg, tensor_parallel, padded).values())


def active_param_count(cfg, tensor_parallel: int = 1, padded: bool = True) -> int:
    """Parameters one token passes through: param_count less the routed experts beyond each MoE layer's top k
    (Mixtral 8x7B: 12.9B of 46.7B). A dense model's are all of them."""
    from ascend_llm_recipes.models.shapes import parameter_shapes

    return sum(math.prod(shape) for name, shape in parameter_shapes(cfg, tensor_parallel, padded).items()
               if not _idle_expert(cfg, name))


def flops_per_token(cfg, seq_length: int = None, padded: bool = False) -> int:
    """Training FLOPs per token (forward + backward = 3 x forward), matmuls plus attention.

    6 x (active parameters that take part in a matmul: every layer's, an MoE layer's router and
    the top-k experts and shared expert a token reaches, and the output projection, not the
    embedding lookup) + 6 x layers x seq_length x heads x (query/key head + value head) for the attention
    scores and their weighted sum: 12 x layers x hidden x seq_length when heads x head size = hidden (PaLM,
    Chowdhery et al. 2022, appendix B; causal masking not discounted).
    padded=True counts the output projection's padding rows too: what the GEMMs of a dense model
    execute (step_gemms), rather than the model's useful FLOPs that MFU counts.
    """
    seq_length = seq_length or cfg.seq_length
    vocab = padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple) if padded else cfg.vocab_size
    if cfg.moe:
        layers = sum(layer_matmul_params(cfg, n, active=True) for n in range(cfg.num_layers))
    else:
        layers = cfg.num_layers * layer_matmul_params(cfg)  # every layer is layer 0's
    # scores (query/key heads) and their weighted sum (value heads): 12 x layers x hidden x S when both are hidden wide
    attention = 6 * cfg.num_layers * seq_length * cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim)
    return 6 * (layers + vocab * cfg.hidden_size) + attention


@dataclass(frozen=True)
class Gemm:
    """One GEMM form of a training step: C = op(A) @ op(B), `count` times per step.

    op(X) is X^T where the transpose flag is set, so A is stored (k, m) when transpose_a and
    B is stored (n, k) when transpose_b; `batch` is the leading dimensions of a BatchMatMul.
    """

    name: str
    m: int
    n: int
    k: int
    transpose_a: bool
    transpose_b: bool
    count: int
    batch: tuple = ()

    @property
    def a_shape(self) -> tuple:
        return self.batch + ((self.k, self.m) if self.transpose_a else (self.m, self.k))

    @property
    def b_shape(self) -> tuple:
        return self.batch + ((self.n, self.k) if self.transpose_b else (self.k, self.n))

    @property
    def flops(self) -> int:
        """FLOPs of one call (a multiply-add is two)."""
        return 2 * math.prod(self.batch) * self.m * self.n * self.k

    @property
    def form(self) -> str:
        """'NT' for A @ B^T and so on: which operand the kernel reads transposed."""
        return ("T" if self.transpose_a else "N") + ("T" if self.transpose_b else "N")


def _linear_gemms(name: str, tokens: int, out_features: int, in_features: int, count: int) -> list:
    """y = x W^T of a (out, in) weight and the two GEMMs autodiff runs for it.

    MindSpore's bprop of MatMul(transpose_b=True) (its expander's REG_BPROP_BUILDER("MatMul")) and
    PyTorch's of linear (mm_mat1/mm_mat2_backward) both give dX = dY @ W and dW = dY^T @ X.
    """
    return [Gemm(f"{name} forward", tokens, out_features, in_features, False, True, count),
            Gemm(f"{name} dX", tokens, in_features, out_features, False, False, count),
            Gemm(f"{name} dW", out_features, in_features, tokens, True, False, count)]


def _attention_gemms(batch: tuple, seq_length: int, qk_dim: int, v_dim: int, count: int) -> list:
    """scores = q k^T (heads of qk_dim) and out = p v (values of v_dim) per (batch, head), and their gradients.

    MindSpore's BatchMatMul bprop (REG_BPROP_BUILDER("BatchMatMul")): for q k^T, dq = dS k and
    dk = dS^T q; for p v, dp = dO v^T and dv = p^T dO. PyTorch's bmm backward is the same math.
    """
    s, d, v = seq_length, qk_dim, v_dim
    return [Gemm("attention q k^T forward", s, s, d, False, True, count, batch),
            Gemm("attention q k^T dq", s, d, s, False, False, count, batch),
            Gemm("attention q k^T dk", s, d, s, True, False, count, batch),
            Gemm("attention p v forward", s, v, s, False, False, count, batch),
            Gemm("attention p v dp", s, s, v, False, True, count, batch),
            Gemm("attention p v dv", s, v, s, True, False, count, batch)]


def step_gemms(cfg, batch_size: int, seq_length: int = None) -> list:
    """Every GEMM one training step of models/llama.py runs (forward and both backward GEMMs), with counts.

    One device (no tensor parallel). Derived from models/shapes.py's weights: each 2-D weight of a
    layer is a Linear (weights of equal shape share a row), the output projection (lm_head, or the
    embedding table when tied) has the padded vocabulary's rows. Attention runs over all query heads
    (grouped KV heads are tiled to them first, models/llama.py repeat_kv), scores over query/key heads of
    qk_head_dim and values of value_head_dim (multi-head latent attention's differ). An MoE layer's experts each
    compute every token (models/moe.py's "loop" and "stacked" dispatch; the default "sorted" runs the routed
    tokens' GEMMs as BatchMatMuls over blocks of about 1.25 x the routed rows instead).
    Their total FLOPs are flops_per_token(cfg, seq_length, padded=True) x batch_size x seq_length, plus, in a
    model with MoE layers, 6 x tokens x the weights of the experts beyond each layer's top k.
    """
    from ascend_llm_recipes.models.shapes import parameter_shapes

    seq_length = seq_length or cfg.seq_length
    tokens = batch_size * seq_length
    shapes = parameter_shapes(cfg)
    groups, counts = {}, {}  # (out, in) -> projection names, in the model's order; how many such Linears
    for name, shape in shapes.items():
        if ".layers." in name and len(shape) == 2:
            label = name.split(".")[-2]
            label = f"experts.{label}" if ".experts." in name else (
                f"shared_expert.{label}" if ".shared_expert." in name else label)
            if label not in groups.setdefault(shape, []):
                groups[shape].append(label)
            counts[shape] = counts.get(shape, 0) + 1
    gemms = []
    for (out_features, in_features), names in groups.items():
        gemms += _linear_gemms(",".join(names), tokens, out_features, in_features, counts[(out_features, in_features)])
    head = shapes["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    gemms += _linear_gemms("lm_head (tied)" if cfg.tie_word_embeddings else "lm_head", tokens, *head, 1)
    return gemms + _attention_gemms((batch_size, cfg.num_heads), seq_length, cfg.qk_head_dim, cfg.value_head_dim,
                                    cfg.num_layers)
