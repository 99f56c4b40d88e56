"""The recipe: the typed schema, its loading and overrides, and its translation to and from MindFormers."""
