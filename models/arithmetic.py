"""Closed-form sizes of a Llama-style model: alignment, padded vocabulary, parameters, training FLOPs.

Import-light (no MindSpore): recipes and planners use it on plain configs. `cfg` is a ModelConfig
(models/config.py) or a LlamaConfig; the counts are sums over models/shapes.py's tensors.
"""

import math

ALIGN = 16  # Ascend's Cube unit works on 16x16 tiles: sequence, widths and vocabulary are multiples of it


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= value."""
    return -(-value // multiple) * multiple


def padded_vocab_size(vocab_size: int, pad_multiple: int = ALIGN, tensor_parallel: int = 1) -> int:
    """Rows of the embedding/output tables: the vocabulary rounded up to pad_multiple x TP."""
    return round_up(vocab_size, pad_multiple * tensor_parallel)


def _layer_shapes(cfg) -> list:
    from ascend_llm_recipes.models.shapes import parameter_shapes  # shapes.py uses padded_vocab_size above

    return [shape for name, shape in parameter_shapes(cfg, layers=range(1)).items() if ".layers." in name]


def layer_matmul_params(cfg) -> int:
    """Weights of one decoder layer's matrix multiplications: q/k/v/o and the SwiGLU MLP."""
    return sum(math.prod(shape) for shape in _layer_shapes(cfg) if len(shape) == 2)


def layer_params(cfg) -> int:
    """All parameters of one decoder layer: matmul weights, q/k/v bias if any, two RMSNorms."""
    return sum(math.prod(shape) for shape in _layer_shapes(cfg))


def param_count(cfg, tensor_parallel: int = 1, padded: bool = True) -> int:
    """All parameters; with padded=True the embedding/output tables include the padding rows."""
    from ascend_llm_recipes.models.shapes import parameter_shapes

    return sum(math.prod(shape) for shape in parameter_shapes(cfg, tensor_parallel, padded).values())


def flops_per_token(cfg, seq_length: int = None) -> int:
    """Training FLOPs per token (forward + backward = 3 x forward), matmuls plus attention.

    6 x (parameters that take part in a matmul: every layer and the output projection, not
    the embedding lookup) + 12 x layers x hidden x seq_length for the attention scores and
    their weighted sum (PaLM, Chowdhery et al. 2022, appendix B; causal masking not discounted).
    """
    seq_length = seq_length or cfg.seq_length
    matmul_params = cfg.num_layers * layer_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size
    return 6 * matmul_params + 12 * cfg.num_layers * cfg.hidden_size * seq_length
