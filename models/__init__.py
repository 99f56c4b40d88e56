"""Decoder-only language models as MindSpore Cells, and their checkpoints.

    config.py      ModelConfig: the architecture, the recipe's `model:` section
    presets.py     published sizes, one row each with its source
    shapes.py      every parameter's name and shape, without building the model (converter, planner and
                   FLOP counts derive from it)
    arithmetic.py  closed-form sizes: padded vocabulary, parameters, training FLOPs, a step's GEMMs
    llama.py       the Llama-family decoder in paper order: norm, attention, MLP, block, model, head
    loss.py        the causal-LM loss (one fused kernel, or vocabulary-parallel operators in semi-auto parallel)
    parallel.py    the parallel layout: shard strategies, pipeline stages, recompute
    conversion/    checkpoints to and from HuggingFace, Megatron-LM and torch state dicts, on one table per format

The registry names below are what a recipe's `model:` section uses; they are kept here
(import-light) so recipes can be validated without importing MindSpore. Importing
`models.llama` registers the classes with MindFormers.
"""

LLAMA_CONFIG_TYPE = "RecipeLlamaConfig"
LLAMA_MODEL_TYPE = "RecipeLlamaForCausalLM"
