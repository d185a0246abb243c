"""Ray-free job core: a spec's model sources and its prompts, rendered and tokenized.

`validate`, the driver, the generator actor and in-process runs (bench, tune) share these,
so each refuses the same inputs in the same words; nothing here imports Ray or torch (the
engine is built in engines.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

from specrej_ray.data.prompt_scan import may_hold
from specrej_ray.data.prompts import (
    Prompt,
    PromptError,
    PromptTask,
    RowProblem,
    check_lengths,
    infer_format,
    iter_prompts,
    render_prompt,
)
from specrej_ray.job.local_rewards import row_fields, row_problem
from specrej_ray.models.identity import describe_model
from specrej_ray.models.loader import ModelError, load_tokenizer, pretrained_args, resolve_model
from specrej_ray.models.weights_check import check_weights
from specrej_ray.spec import JobSpec


def self_likelihood(spec: JobSpec) -> tuple[bool, ...]:
    """Per reward: is it the generator's own likelihood (lm_likelihood on the generator's
    model, loaded the same way, no window)? The engine then scores it from the
    log-probabilities its decode loop computes, with no second forward pass."""
    g = spec.generator

    def same(r) -> bool:
        return (r.type == "lm_likelihood" and r.model == g.model and r.revision == g.revision
                and r.dtype == g.dtype and r.device == g.device
                and r.chat_template == g.chat_template and r.max_length is None
                and r.trust_remote_code == g.trust_remote_code)

    return tuple(same(r) for r in spec.reward)


def reward_keys(spec: JobSpec) -> list[str]:
    """How errors name each reward's model field: reward.model, or reward.1.model."""
    if len(spec.reward) == 1:
        return ["reward.model"]
    return [f"reward.{i}.model" for i in range(len(spec.reward))]


def resolve_generator(spec: JobSpec, convert: bool = True, build: bool = True) -> str:
    """The generator's resolved model path, its weights checked against its config
    (`build=False`: the headers and the embedding only, models/weights_check.py)."""
    g = spec.generator
    path = resolve_model(g.model, "generator.model", convert=convert, revision=g.revision)
    check_model_weights(spec, path, [], build=build)
    return path


def resolve_rewards(spec: JobSpec, convert: bool = True, build: bool = True
                    ) -> list[str | None]:
    """Each reward's resolved model path (None for a callable), in spec order, its weights
    checked against its config (`build` as for resolve_generator)."""
    paths = [resolve_model(r.model, key, convert=convert, revision=r.revision) if r.model
             else None for r, key in zip(spec.reward, reward_keys(spec), strict=True)]
    check_model_weights(spec, None, paths, build=build)
    return paths


def check_model_weights(spec: JobSpec, gen_path: str | None, rm_paths: list[str | None],
                        build: bool = True) -> None:
    """The resolved generator's (if given) and rewards' weights checked against their
    configs (models/weights_check.py)."""
    g = spec.generator
    if gen_path is not None:
        check_weights(gen_path, "generator.model", g.model,
                      trust_remote_code=g.trust_remote_code, build=build)
    for r, key, path in zip(spec.reward, reward_keys(spec), rm_paths, strict=False):
        if path is not None:
            check_weights(path, key, r.model, classifier=r.type == "classifier",
                          trust_remote_code=r.trust_remote_code, build=build)


def describe_models(spec: JobSpec, gen_path: str, rm_paths: list[str | None]) -> dict:
    """run.json's `models`: which weights the generator and each reward were (revision or
    weight hash)."""
    hashed: dict[str | None, dict] = {}  # a generator that is also the reward: hashed once

    def describe(name: str, path: str | None, revision: str | None) -> dict:
        if path not in hashed:
            hashed[path] = describe_model(name, path, revision)
        return {**hashed[path], "model": name}

    g = spec.generator
    return {"generator": describe(g.model, gen_path, g.revision),
            "rewards": [describe(r.model or r.function or r.type, path, r.revision)
                        for r, path in zip(spec.reward, rm_paths, strict=True)]}


def context_length(path: str, spec: JobSpec) -> int:
    """The generator's context from its config alone (no weights are read), or vLLM's
    max_model_len where the generator may run in vLLM and it is set lower."""
    from transformers import AutoConfig

    name, extra = pretrained_args(path)
    try:
        cfg = AutoConfig.from_pretrained(
            name, trust_remote_code=spec.generator.trust_remote_code,
            revision=spec.generator.revision, **extra,
        )
    except Exception as e:  # transformers raises many types for a broken config
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelError(f"generator.model: cannot read the config of "
                         f"'{spec.generator.model}': {first}") from None
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    context = int(getattr(cfg, "max_position_embeddings", None) or 1 << 30)
    g = spec.generator
    if g.engine != "hf" and g.vllm.max_model_len is not None:
        context = min(context, g.vllm.max_model_len)
    return context


def check_room(spec: JobSpec, context: int) -> None:
    """generator.sampling.max_new_tokens leaves room for a prompt in the context."""
    max_new = spec.generator.sampling.max_new_tokens
    if max_new >= context:
        raise ModelError(
            f"generator.sampling.max_new_tokens: {max_new} leaves no room for a prompt in "
            f"the generator's context of {context} tokens; lower it"
        )


def prompt_rows(spec: JobSpec) -> Iterator[Prompt | RowProblem]:
    """The spec's prompts and row problems in row order, streamed: what the checks before
    Ray (check_prompt_source) and the preparation (Prepared) both read. A check of a row
    against the rest of the spec goes here, once, and both see it: the columns its rewards
    read, and whether they can score it (job.local_rewards)."""
    for got in iter_prompts(spec.prompts, row_fields(spec)):
        if isinstance(got, Prompt) and (why := row_problem(spec, got)):
            got = RowProblem(got.row, got.id, why)
        yield got


# Unusable rows read before the whole file is searched for the prompt field's name.
QUICK_ROWS = 1000


def check_prompt_source(spec: JobSpec) -> None:
    """PromptError, one line, unless the prompt source reads and holds a usable row: read up
    to the first one, nothing tokenized, nothing heavy imported. A JSON Lines file whose
    first rows are all unusable is searched whole for the prompt field's name first
    (data/prompt_scan.py): where it appears nowhere, no row is read further."""
    rows = prompt_rows(spec)
    first: RowProblem | None = None
    count = 0
    try:
        for got in rows:
            if isinstance(got, Prompt):
                return
            first, count = first or got, count + 1
            if count == QUICK_ROWS and not _may_hold_prompts(spec):
                raise PromptError(f"prompts.path: no row of '{spec.prompts.path}' is a line "
                                  f"of UTF-8 with a '{spec.prompts.prompt_field}' field "
                                  f"(first: row {first.row}: {first.reason}); fix the file, "
                                  "or set prompts.prompt_field to the field that holds the "
                                  "prompt")
    finally:
        rows.close()
    raise PromptError(_nothing_to_run(spec.prompts.path, count, first, listed=False))


def _may_hold_prompts(spec: JobSpec) -> bool:
    path = Path(spec.prompts.path).expanduser()
    if (spec.prompts.format or infer_format(path)) != "jsonl":
        return True  # read row by row: a .json list is parsed whole first
    return may_hold(path, spec.prompts.prompt_field)


def prepare_prompts(spec: JobSpec, gen_path: str, allow_empty: bool = False,
                    context: int | None = None):
    """Load, render and tokenize prompts; problems are returned, never dropped silently.

    Returns (prompts, tasks, problems, source). Unless `allow_empty`, a source that leaves
    no prompt to run is a PromptError: a run of nothing is not a successful run.
    """
    prepared = Prepared(spec, gen_path, context)
    prompts: list[Prompt] = []
    tasks: list[PromptTask] = []
    for ps, ts in prepared.chunks():
        prompts += ps
        tasks += ts
    prepared.check(len(prompts), allow_empty)
    return prompts, tasks, prepared.problems, prepared.source


class Prepared:
    """A spec's prompts rendered and tokenized a chunk at a time (chunks()), so a job of
    millions of prompts never holds them all; `problems` are the rows skipped (in the
    source, then too long), complete once chunks() is exhausted."""

    CHUNK = 4096

    def __init__(self, spec: JobSpec, gen_path: str, context: int | None = None) -> None:
        """`context`: the generator's, if known (context_length)."""
        context = context_length(gen_path, spec) if context is None else context
        check_room(spec, context)
        self.spec, self.context, self.source = spec, context, spec.prompts.path
        self.gen_path = gen_path
        self.scored = any(self_likelihood(spec))  # the engine may score its own likelihood
        self.read_problems: list[RowProblem] = []
        self.too_long: list[RowProblem] = []

    @property
    def problems(self) -> list[RowProblem]:
        return self.read_problems + self.too_long

    @functools.cached_property
    def tokenizer(self):
        """Loaded once the prompt source has given a prompt: its errors come first."""
        g = self.spec.generator
        return load_tokenizer(self.gen_path, g.trust_remote_code, g.revision, "generator.model",
                              g.model)

    def chunks(self) -> Iterator[tuple[list[Prompt], list[PromptTask]]]:
        chunk: list[Prompt] = []
        for got in prompt_rows(self.spec):
            if isinstance(got, RowProblem):
                self.read_problems.append(got)
                continue
            chunk.append(got)
            if len(chunk) == self.CHUNK:
                yield self._prepare(chunk)
                chunk = []
        if chunk:
            yield self._prepare(chunk)

    def _prepare(self, chunk: list[Prompt]) -> tuple[list[Prompt], list[PromptTask]]:
        g, tok = self.spec.generator, self.tokenizer
        rendered = [render_prompt(tok, p, g.chat_template) for p in chunk]
        # Chat templates write their own special tokens; plain text gets the tokenizer's (BOS).
        ids = [tok(r, add_special_tokens=not g.chat_template).input_ids for r in rendered]
        kept, too_long = check_lengths(chunk, [len(x) for x in ids],
                                       g.sampling.max_new_tokens, self.context)
        self.too_long += too_long
        tasks = [PromptTask(chunk[i].id, chunk[i].text, ids[i],
                            self.scored and _reward_context(tok, chunk[i].text,
                                                       g.chat_template) == ids[i],
                            chunk[i].extra)
                 for i in kept]
        return [chunk[i] for i in kept], tasks

    def check(self, count: int, allow_empty: bool) -> None:
        """A source that leaves no prompt to run is a PromptError (unless `allow_empty`)."""
        if not count and not allow_empty:
            problems = self.problems
            raise PromptError(_nothing_to_run(self.source, len(problems),
                                              problems[0] if problems else None))


def _reward_context(tokenizer, text: str, chat_template: bool) -> list[int]:
    """The ids an LM-likelihood reward conditions a response on (reward.likelihood)."""
    from specrej_ray.reward.base import encode, format_for_scoring, uses_template

    context, _ = format_for_scoring(tokenizer, text, "", chat_template)
    return encode(tokenizer, context, uses_template(tokenizer, chat_template))


def _nothing_to_run(source: str, skipped: int, first: RowProblem | None,
                    listed: bool = True) -> str:
    """`listed`: `validate` lists the skipped rows (those it finds with every row read)."""
    if first is None:
        return f"prompts.path: '{source}' holds no prompts; add some rows"
    hint = "run `specrej-ray validate` to list them" if listed else "fix them"
    return (f"prompts.path: all {skipped} row(s) of '{source}' were skipped (first: row "
            f"{first.row}: {first.reason}); {hint}")
