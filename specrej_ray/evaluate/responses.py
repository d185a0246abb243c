"""One model's responses to the evaluation prompts, judged on their instructions.

Each model answers every prompt twice with the job's own engine (job.local, job.engines):
greedy (temperature 0), and once sampled with the job's sampling and seed (candidate 0's
stream: the same text in every run, by candidate identity). One candidate per prompt, no
rejection, no bounds: the response is the model's own. Each response is judged strict and
loose on each of its row's instructions (reward.instructions, IFEval's checkers).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from specrej_ray.data.prompts import Prompt, PromptError, RowProblem, iter_prompts
from specrej_ray.job.local_rewards import instruction_rows, row_fields, row_problem
from specrej_ray.quality.instruction_eval import Response
from specrej_ray.spec import JobSpec, validate_spec

DECODINGS = {
    "greedy": "temperature 0",
    "sampled": "one sample with the job's sampling and seed (candidate 0's stream)",
}
PROGRESS_SECONDS = 10.0


class EvalError(Exception):
    """A user error in what to evaluate; str() is one line naming the option or field."""


def say(message: str) -> None:
    """A progress line on stderr (stdout is left for results)."""
    print(f"evaluate: {message}", file=sys.stderr, flush=True)


def eval_spec(spec: JobSpec, model: str | None = None, prompts: str | None = None,
              limit: int | None = None) -> JobSpec:
    """The job that evaluates `model` (None: generator.model): the spec's generator, engine
    and sampling, one candidate per prompt with nothing rejected or pruned, the spec's
    first instructions reward alone, on `prompts` (None: the spec's prompts, `limit` at
    most)."""
    instructions = [r for r in spec.reward if r.type == "instructions"]
    if not instructions:
        raise EvalError("reward: the evaluation scores each prompt's verifiable instructions "
                        "with the spec's reward of type instructions, and the spec has none; "
                        "add `reward: {type: instructions}` (docs/rewards.md)")
    data: dict[str, Any] = spec.model_dump(mode="json", exclude={"iterate"}, exclude_unset=True)
    data["name"] = f"{spec.name}-evaluate"
    if model is not None and model != spec.generator.model:
        data["generator"]["model"] = model
        data["generator"]["revision"] = None  # a local directory has none
    data["reward"] = [instructions[0].model_dump(mode="json", exclude_unset=True)]
    s = spec.search
    data["search"] = {"mode": "bon", "n": 1, "bounds": False, "audit_fraction": 0.0,
                      "kv_budget_gb": s.kv_budget_gb, "refill": s.refill,
                      "gpu_memory_utilization": s.gpu_memory_utilization}
    p = data["prompts"]
    if prompts is not None:
        p.update(path=prompts, offset=0, limit=limit, format=None)
    elif limit is not None:
        p["limit"] = min(limit, spec.prompts.limit or limit)
    return validate_spec(data)


def prompts_key(espec: JobSpec, field: str) -> str:
    """What an evaluation's figures depend on besides the model: the evaluation job (its
    generator settings, seed, reward, prompt slice) and the prompts' content."""
    digest = hashlib.sha256(espec.fingerprint().encode())
    for p in read_prompts(espec, field):
        digest.update(json.dumps([p.id, p.text, p.system, p.extra]).encode())
    return digest.hexdigest()[:16]


def read_prompts(espec: JobSpec, field: str) -> list[Prompt]:
    """The evaluation's prompts, each with its instruction columns; a bad file or row is an
    EvalError naming `field` (the option or spec key that gave the file)."""
    out = []
    try:
        for got in iter_prompts(espec.prompts, row_fields(espec)):
            if isinstance(got, Prompt) and (why := row_problem(espec, got)) is not None:
                got = RowProblem(got.row, got.id, why)
            if isinstance(got, RowProblem):
                raise EvalError(f"{field}: {_row(got, espec)}; an evaluation runs on every "
                                "row: fix or remove it")
            out.append(got)
    except PromptError as e:
        raise EvalError(f"{field}: {str(e).removeprefix('prompts.path: ')}") from None
    if not out:
        raise EvalError(f"{field}: '{espec.prompts.path}' holds no prompts; give a file of "
                        "prompts with verifiable instructions")
    return out


def _row(problem: RowProblem, espec: JobSpec) -> str:
    return problem.line(espec.prompts.path).removesuffix("; row skipped")


def check_model(model: str) -> str:
    """The model source's path (not converted): a missing one fails now, before any other
    model loads."""
    from specrej_ray.models.loader import resolve_model

    return resolve_model(model, "--model", convert=False)


@dataclass
class ModelEval:
    """One model's evaluation: who it is, and its responses by decoding."""

    model: str  # as given
    path: str  # resolved
    revision: str | None
    sha256: str | None
    instructions: dict[str, list[str]]  # prompt id -> its instruction ids
    responses: dict[str, list[Response]]  # decoding -> one per prompt, in prompt order
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "responses"},
                "responses": {d: [asdict(r) for r in rs] for d, rs in self.responses.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelEval:
        responses = {d: [Response(r["prompt_id"], tuple(r["strict"]), tuple(r["loose"]),
                                  r["tokens"], r["text"]) for r in rs]
                     for d, rs in data["responses"].items()}
        return cls(**{**data, "responses": responses})


def evaluate_model(espec: JobSpec, progress: Callable[[str], None] = say) -> ModelEval:
    """Load the evaluation job's model here, answer every prompt greedy and sampled."""
    from specrej_ray.job.local import load_local
    from specrej_ray.models.identity import describe_model
    from specrej_ray.models.loader import resolve_model

    t0 = time.perf_counter()
    g = espec.generator
    progress(f"loading {g.model}")
    job = load_local(espec)
    try:
        if job.problems:
            raise EvalError(f"{_row(job.problems[0], espec)} ({len(job.problems)} row(s) "
                            f"{g.model} cannot answer); an evaluation runs on every row: "
                            "fix or remove them")
        rows = {t.prompt_id: instruction_rows(espec, t.text, t.extra)[0] for t in job.tasks}
        responses = {d: _respond(job, d, rows, progress) for d in DECODINGS}
    finally:
        job.engine.close()
    path = resolve_model(g.model, "generator.model", revision=g.revision)  # converted: cached
    who = describe_model(g.model, path, g.revision)
    return ModelEval(g.model, path, who["revision"], who["sha256"],
                     {k: list(v.ids) for k, v in rows.items()}, responses,
                     time.perf_counter() - t0)


def _respond(job, decoding: str, rows: dict, progress: Callable[[str], None]) -> list[Response]:
    from specrej_ray.reward.instructions import followed

    engine = job.engine.with_sampling(temperature=0.0) if decoding == "greedy" else job.engine
    tasks = job.engine_tasks()
    t0 = last = time.perf_counter()
    done = 0

    def tick(_result) -> None:
        nonlocal done, last
        done += 1
        now = time.perf_counter()
        if now - last >= PROGRESS_SECONDS or done == len(tasks):
            last = now
            progress(f"{job.spec.generator.model} {decoding}: {done}/{len(tasks)} prompts, "
                     f"{now - t0:.0f} s")

    out = []
    for result in engine.run(tasks, refill=job.spec.search.refill, on_result=tick):
        c = result.candidates[0]
        strict, loose = followed(rows[result.prompt_id], c.text)
        out.append(Response(result.prompt_id, tuple(strict), tuple(loose), len(c.tokens),
                            c.text))
    return out
