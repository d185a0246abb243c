"""The rewards a generator scores in its own process (RewardSpec.local): reward.instructions,
IFEval's verifiable instruction checks on each row's own instructions. They are cheap Python,
so the engine asks no reward actor for them, and their bounds can be asked for every few
tokens (engine.task.LocalScores, search.bounds).

Each row's instructions are read from its prompt columns (RewardSpec.row_fields, carried as
Prompt.extra), checked once when the prompts are prepared (a bad row is a row problem, named
by `validate`) and built into checkers when its task is made."""

from __future__ import annotations

import json

from specrej_ray.data.prompts import Extra, Prompt, PromptTask
from specrej_ray.errors import RewardError
from specrej_ray.spec import JobSpec


def _keys(spec: JobSpec) -> list[str]:
    """How errors name each reward: reward, or reward.1."""
    return ["reward"] if len(spec.reward) == 1 else [f"reward.{i}" for i in
                                                     range(len(spec.reward))]


def row_fields(spec: JobSpec) -> Extra:
    """The prompt columns the rewards read, each with the spec key that names it."""
    fields = {}
    for key, r in zip(_keys(spec), spec.reward, strict=True):
        if r.type == "instructions":
            fields.setdefault(r.instructions_field, f"{key}.instructions_field")
            fields.setdefault(r.kwargs_field, f"{key}.kwargs_field")
    return tuple((key, column) for column, key in fields.items())


def row_problem(spec: JobSpec, prompt: Prompt) -> str | None:
    """Why the row's instructions cannot be scored (one line, without the row), or None."""
    if not any(r.local for r in spec.reward):
        return None
    try:
        instruction_rows(spec, prompt.text, prompt.extra)
    except RewardError as e:
        return str(e)
    return None


def local_scores(spec: JobSpec, task: PromptTask):
    """The task's rewards scored in the generator's process (engine.task.LocalScores), or None
    if it has none."""
    local = [(j, r) for j, r in enumerate(spec.reward) if r.local]
    if not local:
        return None
    # The checkers' package imports `datasets` (a second and more): only jobs that use it.
    from specrej_ray.job.instruction_scores import InstructionScores

    return InstructionScores(local, instruction_rows(spec, task.text, task.extra))


def instruction_rows(spec: JobSpec, text: str, extra: str | None) -> list:
    """Each instructions reward's RowInstructions of the row (reward.instructions), or
    RewardError naming the column."""
    from specrej_ray.reward.instructions import InstructionError, parse_row

    fields = json.loads(extra) if extra else {}
    out = []
    for r in spec.reward:
        if r.type != "instructions":
            continue
        try:
            out.append(parse_row(fields.get(r.instructions_field), fields.get(r.kwargs_field),
                                 text))
        except InstructionError as e:
            raise RewardError(f"{r.instructions_field}: {e}") from None
    return out
