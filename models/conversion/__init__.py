"""Checkpoint conversion between our format and HuggingFace, Megatron-LM and torch.save'd state dicts.

    tables.py          the mapping tables, one per format, of one Row type (our name, theirs, transform,
                       parallel split, fusing); both directions are generated from them
    formats.py         safetensors, pytorch_model.bin and MindSpore .ckpt files, read and written by tensor
    megatron_files.py  Megatron-LM legacy and torch_dist checkpoint files
    ours.py            our converted directory: file names, model section, manifest identity
    write.py           write_conversion (build, verify, publish by rename) and write_ours
    verify.py          the parity check against a reference's logits
    hf_families.py     the HuggingFace model_types (llama, qwen2/3, mistral, qwen2_moe, qwen3_moe, mixtral,
                       deepseek_v3):
                       config.json <-> our model_config, the options each refuses, its tensor table
    hf.py              HuggingFace <-> ours (from_hf, write_hf; hf_config_from_model and transformers_config:
                       our model_config as HuggingFace's config)
    megatron.py        Megatron-LM <-> ours (from_megatron, to_megatron)
    megatron_reference.py  the reader's --verify reference: a pure-torch Megatron forward from its own files
    torch_state.py     torch.save'd state dicts and Meta's consolidated shards -> ours (from_torch)

A second model family is its tensors in models/shapes.py plus rows in tables.py, not a new code path.
"""
