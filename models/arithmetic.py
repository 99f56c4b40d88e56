"""Closed-form sizes of a Llama-style model: padded vocabulary, parameters, training FLOPs.

Import-light (no MindSpore): recipes and planners use it on plain configs. `cfg` is any
object with the LlamaConfig field names (the recipe's model_config section, a preset, ...).
"""

VOCAB_ALIGN = 16  # Ascend's Cube unit works on 16x16 tiles


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_vocab_size(vocab_size: int, pad_multiple: int = VOCAB_ALIGN, tensor_parallel: int = 1) -> int:
    """Rows of the embedding/output tables: the vocabulary rounded up to pad_multiple x TP."""
    return round_up(vocab_size, pad_multiple * tensor_parallel)


def _kv_heads(cfg) -> int:
    return cfg.num_kv_heads if getattr(cfg, "num_kv_heads", None) else cfg.num_heads


def layer_matmul_params(cfg) -> int:
    """Weights of one decoder layer's matrix multiplications: q/k/v/o and the SwiGLU MLP."""
    h, head_dim = cfg.hidden_size, cfg.hidden_size // cfg.num_heads
    kv = _kv_heads(cfg) * head_dim
    return h * h + 2 * h * kv + h * h + 3 * h * cfg.intermediate_size


def layer_params(cfg) -> int:
    """All parameters of one decoder layer: matmul weights, q/k/v bias if any, two RMSNorms."""
    h, head_dim = cfg.hidden_size, cfg.hidden_size // cfg.num_heads
    bias = h + 2 * _kv_heads(cfg) * head_dim if getattr(cfg, "qkv_bias", False) else 0
    return layer_matmul_params(cfg) + bias + 2 * h


def param_count(cfg, tensor_parallel: int = 1, padded: bool = True) -> int:
    """All parameters; with padded=True the embedding/output tables include the padding rows."""
    vocab = cfg.vocab_size
    if padded:
        vocab = padded_vocab_size(vocab, getattr(cfg, "vocab_pad_multiple", VOCAB_ALIGN), tensor_parallel)
    tables = vocab * cfg.hidden_size * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    return tables + cfg.num_layers * layer_params(cfg) + cfg.hidden_size


def flops_per_token(cfg, seq_length: int = None) -> int:
    """Training FLOPs per token (forward + backward = 3 x forward), matmuls plus attention.

    6 x (parameters that take part in a matmul: every layer and the output projection, not
    the embedding lookup) + 12 x layers x hidden x seq_length for the attention scores and
    their weighted sum (PaLM, Chowdhery et al. 2022, appendix B; causal masking not discounted).
    """
    seq_length = seq_length or cfg.seq_length
    matmul_params = cfg.num_layers * layer_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size
    return 6 * matmul_params + 12 * cfg.num_layers * cfg.hidden_size * seq_length
