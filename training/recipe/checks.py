"""Helpers for the recipe sections' checks: each returns the problems it finds, each naming its dotted key."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ascend_llm_recipes.training.recipe.schema import Recipe


def at_least(prefix: str, section, low, *names) -> list:
    """A problem for each field of `section` in `names` that is below `low` (None means unset and is fine)."""
    return [f"{dotted(prefix, name)}: must be >= {low}, got {getattr(section, name)}" for name in names
            if getattr(section, name) is not None and getattr(section, name) < low]


def positive(prefix: str, section, *names) -> list:
    """A problem for each field of `section` in `names` that is not > 0."""
    return [f"{dotted(prefix, name)}: must be > 0, got {getattr(section, name)}" for name in names
            if getattr(section, name) is not None and not getattr(section, name) > 0]


def dotted(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def callback_key(recipe: "Recipe", callback) -> str:
    """`callbacks[N]` of this callback (by identity: two callbacks may be equal)."""
    return f"callbacks[{next(i for i, c in enumerate(recipe.callbacks) if c is callback)}]"
