"""The few exception types a user sees; each says what, where, and what to do next."""


class PretrainError(Exception):
    """Base for user-facing errors: `message` says what and where, `hint` what to do next."""

    def __init__(self, message: str, hint: str = ""):
        self.message = message
        self.hint = hint
        super().__init__(message + (f"\n---> HINT: {hint}" if hint else ""))


class RecipeError(PretrainError):
    """A recipe file, key or value is wrong; collects every problem found."""

    def __init__(self, source: str, problems: list, hint: str = ""):
        self.source = source
        self.problems = list(problems)
        listing = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"recipe {source}: {len(self.problems)} problem(s):\n{listing}", hint)


class DataError(PretrainError):
    """A dataset is missing, incomplete, or disagrees with the recipe."""


class LaunchError(PretrainError):
    """The job could not be started, or a worker failed."""


class ConversionError(PretrainError):
    """A checkpoint cannot be converted: unsupported option, unknown or misshapen tensor, bad file."""
