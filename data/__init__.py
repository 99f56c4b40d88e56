"""Raw text -> cleaned, deduplicated documents -> sentencepiece tokens -> packed samples -> MindRecord.

`data.prepare.prepare_dataset` runs the whole chain: data/text/steps.py's step objects (reader, clean
and tokenize, account, dedup, split and pack into shards) composed by data/text/pipeline.py on one
machine (streaming, worker processes, restartable) or by data/cluster/scale.py in N tasks on datatrove's
executors (data/cluster/executors.py); data/run_state.py and data/report.py are the run's state and report.
`data.loader` is the training side.
"""
