"""--plan's what-ifs: the recipe with one memory lever changed, and the levers a recipe leaves unused with what each
would save (training/tools/planner.py plans each what-if as it plans the recipe)."""

from dataclasses import replace as copy_with

from ascend_llm_recipes.common.units import byte_size


def what_if(recipe, **changes):
    """The recipe with one lever changed: recompute, shard (optimizer parallel), expert_parallel, level (optimizer
    level), use_flash_attention, param_dtype."""
    if "recompute" in changes:
        recipe = copy_with(recipe, recompute_config=copy_with(recipe.recompute_config, recompute=True,
                                                              select_recompute=False))
    if "shard" in changes:
        recipe = copy_with(recipe, parallel=copy_with(recipe.parallel, enable_parallel_optimizer=True))
    if "expert_parallel" in changes:
        recipe = copy_with(recipe, parallel_config=copy_with(recipe.parallel_config,
                                                             expert_parallel=changes["expert_parallel"]))
    if "level" in changes:
        parallel = recipe.parallel
        recipe = copy_with(recipe, parallel=copy_with(parallel, parallel_optimizer_config=copy_with(
            parallel.parallel_optimizer_config, optimizer_level=changes["level"])))
    model_changes = {k: changes[k] for k in ("use_flash_attention", "param_dtype") if k in changes}
    if model_changes:
        model = recipe.model
        recipe = copy_with(recipe, model=copy_with(model, model_config=copy_with(model.model_config, **model_changes)))
    return recipe


def peak(recipe, mode: str) -> int:
    """Bytes of the recipe's heaviest stage at recompute `mode` (what --plan compares with the device)."""
    from ascend_llm_recipes.training.tools.planner import stage_memory

    return max(s.total(mode) for s in stage_memory(recipe))


def unused_levers(recipe, mode, shard, total) -> list:
    """The memory levers the recipe does not use yet, in the order practitioners reach for them, with savings."""
    from ascend_llm_recipes.training.tools.planner import expert_parallel_degrees

    p, cfg = recipe.parallel_config, recipe.model.model_config
    levers = []
    if mode != "full":
        full = peak(what_if(recipe, recompute=True), "full")
        levers.append(f"{'full ' if mode == 'selective' else ''}recompute "
                      f"(full: -{byte_size(total - full)}, ~20-40% more compute)")
    if not shard:
        if p.data_parallel > 1:
            needs = "" if recipe.parallel.parallel_mode in (1, 2) else "; needs parallel.parallel_mode 1"
            if recipe.parallel.parallel_mode in (1, 2):
                sharded = peak(what_if(recipe, shard=True), mode)
                levers.append(f"optimizer-state sharding (-{byte_size(total - sharded)} at DP {p.data_parallel})")
            else:
                levers.append(f"optimizer-state sharding (at DP {p.data_parallel}{needs})")
        else:
            levers.append("optimizer-state sharding (needs data_parallel > 1)")
    elif p.data_parallel > 1 and recipe.parallel.parallel_optimizer_config.optimizer_level != "level3":
        saved = total - peak(what_if(recipe, level="level3"), mode)
        if saved > 0:
            levers.append(f"optimizer level3 (parallel.parallel_optimizer_config.optimizer_level: -{byte_size(saved)}, "
                          "weights re-gathered for backward)")
    if recipe.context.device_target != "CPU" and not cfg.use_flash_attention and cfg.compute_dtype != "float32":
        saved = total - peak(what_if(recipe, use_flash_attention=True), mode)
        levers.append(f"FlashAttention (model.model_config.use_flash_attention: -{byte_size(saved)})")
    if cfg.param_dtype == "float32" and cfg.compute_dtype != "float32":
        saved = total - peak(what_if(recipe, param_dtype=cfg.compute_dtype), mode)
        if saved > 0:
            levers.append(f"16-bit weights (model.model_config.param_dtype: {cfg.compute_dtype}: "
                          f"-{byte_size(saved)}; float32 masters stay in the optimizer)")
    if p.pipeline_stage == 1:
        levers.append("pipeline")
    largest = expert_parallel_degrees(recipe)[-1] if cfg.moe else 1
    if p.expert_parallel < largest:
        levers.append(f"expert parallel (up to {largest}: the table by degree above)")
    if p.model_parallel == 1:
        levers.append("tensor parallel")
    return levers
