"""The shared base, below everything else: error types, the strict dataclass loader,
hashing and atomic file writes.

Installed as `ascend_llm_recipes.common`. Imports run one way: common <- models, data <- training <- scripts;
nothing here imports from the other packages.
"""

import os

# MindSpore's generated protobuf modules load only under protobuf's pure-Python implementation. MindSpore sets
# this variable when it is imported (mindspore/run_check/_check_version.py:469-472), which is too late when a
# process imported protobuf first (sentencepiece's model proto, transformers) and MindSpore later, as the
# launcher does when it prepares a dataset: set it before anything of this package can import protobuf.
os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
