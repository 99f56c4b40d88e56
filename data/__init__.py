"""Raw text -> cleaned documents -> sentencepiece tokens -> packed samples -> MindRecord.

`data.prepare.prepare_dataset` runs the whole chain; each step is its own module.
"""
