"""User-facing errors of the modules that import torch, defined here without it, so the CLI
can name them (and take its output lock) before loading torch or Ray."""


class ModelError(Exception):
    """A model source that cannot be resolved or loaded; str() is one line."""


class RewardError(Exception):
    """A user-facing reward failure; str() is one line naming what and what to do."""
