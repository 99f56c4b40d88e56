"""Raw text -> cleaned, deduplicated documents -> sentencepiece tokens -> packed samples -> MindRecord.

`data.prepare.prepare_dataset` runs the whole chain (data/pipeline.py: streaming, worker
processes, restartable); each step is its own module. `data.loader` is the training side.
"""
