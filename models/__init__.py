"""Decoder-only language models as MindSpore Cells.

The registry names below are what a recipe's `model:` section uses; they are kept here
(import-light) so recipes can be validated without importing MindSpore. Importing
`models.llama` registers the classes with MindFormers.
"""

LLAMA_CONFIG_TYPE = "RecipeLlamaConfig"
LLAMA_MODEL_TYPE = "RecipeLlamaForCausalLM"
