"""Raw text to tokens on one machine: reading (corpus), cleaning, dedup, the per-document worker, the steps and
the single-machine run that chains them (pipeline)."""
