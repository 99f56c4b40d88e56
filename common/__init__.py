"""The shared base, below everything else: error types, the strict dataclass loader,
hashing and atomic file writes.

Installed as `ascend_llm_recipes.common`. Imports run one way: common <- models, data <- training <- scripts;
nothing here imports from the other packages.
"""
