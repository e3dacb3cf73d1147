"""User-facing errors.

Anything raised as a :class:`UserError` (bad config, budget, checkpoint, model name...) is
printed by the CLI as one line naming what is wrong and what is allowed, with exit code 2 and
no traceback. Library callers get an ordinary exception they can catch.
"""


class UserError(ValueError):
    """Bad input from the user: the message must name the offending thing and what is allowed."""


class ConfigError(UserError):
    """A config key or value is unknown or invalid."""
