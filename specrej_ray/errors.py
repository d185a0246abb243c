"""User-facing errors of the modules that import torch, Ray or pyarrow, defined here without
them, so the CLI can name them (and take its output lock) before loading any."""


class OutputError(Exception):
    """The output directory cannot be used as asked (one line, names output.path)."""


class ModelError(Exception):
    """A model source that cannot be resolved or loaded; str() is one line."""


class RewardError(Exception):
    """A user-facing reward failure; str() is one line naming what and what to do."""


class JobError(Exception):
    """The job could not finish; finished shards are kept for a resume. `shard`: the one
    whose failure stopped the job, if any (errors.jsonl names it and its prompts)."""

    def __init__(self, message: str, shard=None) -> None:
        super().__init__(message)
        self.shard = shard


class RewardFailed(JobError):
    """A reward raised, or returned scores that cannot be ranked: the user's to fix (exit 2),
    unlike a failure of the infrastructure."""


class ModelFailed(JobError):
    """An actor could not load its model source (ModelError in the actor): the user's to fix
    (exit 2), like a model-source error found before Ray starts."""


class TrainError(Exception):
    """Training a round's policy failed for a reason the user fixes (a bad trainer argument,
    a command that exits non-zero or saves no model); str() is one line."""


class LibraryChanged(RuntimeError):
    """An installed library lacks a private or version-specific part that specrej-ray reaches
    through that library's seam module, or it no longer behaves as assumed: an infrastructure
    failure (exit 1), found when the seam is imported or first used. str() is one line naming
    the library's version and the part."""

    def __init__(self, library: str, version: str, what: str, supported: str) -> None:
        super().__init__(f"{library} {version}: {what}; specrej-ray supports {supported}")


def first_line(err: BaseException) -> str:
    """An exception's first line for a one-line message (its type's name if it has no text):
    libraries raise many-line errors."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
