"""The YAML job spec: typed, validated, with one clear line per error."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)


class SpecError(Exception):
    """A user error in a job spec; str() is one or more lines, each naming file and key."""


def _mentions(tp: Any, kinds: tuple[type, ...]) -> bool:
    """Whether an annotation (through unions and lists) takes one of `kinds`."""
    if tp in kinds:
        return True
    if get_origin(tp) in (Union, types.UnionType, list):
        return any(_mentions(arg, kinds) for arg in get_args(tp))
    return False


def _has_bool(value: Any) -> bool:
    return isinstance(value, bool) or (
        isinstance(value, list) and any(isinstance(v, bool) for v in value)
    )


class _Strict(BaseModel):
    # allow_inf_nan=False: `.inf`/`.nan` (or "inf") is never a meaningful setting here.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # Pydantic's lax mode reads `n: true` as 1; a boolean is only taken by bool fields.
        field = cls.model_fields.get(info.field_name or "")
        if (field is not None and _has_bool(v) and _mentions(field.annotation, (int, float))
                and not _mentions(field.annotation, (bool,))):
            raise ValueError("expected a number, not true/false")
        return v


class PromptsSpec(_Strict):
    path: str = Field(description="Prompt file or `datasets.save_to_disk` directory.")
    format: Literal["jsonl", "json", "parquet", "csv", "hf"] | None = Field(
        None, description="File format; inferred from the extension (a directory is `hf`)."
    )
    prompt_field: str = Field("prompt", description="Column holding the prompt text.")
    id_field: str | None = Field(
        None, description="Column holding a unique prompt id; default: a hash of the prompt."
    )
    system_field: str | None = Field(None, description="Column holding a per-row system prompt.")
    system: str | None = Field(
        None, description="System prompt for every row (overridden by system_field)."
    )
    limit: int | None = Field(None, ge=1, description="Use only the first `limit` prompts.")


class SamplingSpec(_Strict):
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 disables it.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables it.")
    max_new_tokens: int = Field(256, ge=1, description="Longest response, in generated tokens.")
    stop: list[str] = Field(
        default_factory=list, description="Stop strings; the response is cut before the first one."
    )

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v


class GeneratorSpec(_Strict):
    model: str = Field(
        description="`smollm2-135m-instruct` (packaged), a local model dir, a .gguf file "
        "or a hub id."
    )
    revision: str | None = Field(None, description="Hub revision (hub ids only).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and KV dtype; auto = bfloat16 on CUDA, float32 on CPU."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = CUDA when the actor has a GPU, else CPU."
    )
    chat_template: bool = Field(
        True, description="Wrap prompts in the generator tokenizer's chat template."
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the model repo.")
    threads: int | None = Field(
        None, ge=1, description="Torch CPU threads per generator actor; default: all cores."
    )
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)


class RewardSpec(_Strict):
    type: Literal["classifier", "lm_likelihood", "callable"] = Field(
        description="classifier: sequence-classification RM; lm_likelihood: mean log-prob "
        "of the response under `model`; callable: `function` scores text."
    )
    model: str | None = Field(None, description="Model source, as for generator.model.")
    function: str | None = Field(
        None, description="`module:function(prompts, responses) -> list[float]` (type callable)."
    )
    revision: str | None = Field(None, description="Hub revision (hub ids only).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="As generator."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="As generator.")
    chat_template: bool = Field(
        True, description="Format (prompt, response) with the reward tokenizer's chat template."
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the model repo.")
    name: str | None = Field(
        None, description="Name in outputs (default: type(model)); unique within an ensemble."
    )
    weight: float = Field(1.0, gt=0, description="Weight in an ensemble of several rewards.")
    label_index: int = Field(0, ge=0, description="Classifier logit used as the score.")
    max_length: int | None = Field(
        None, ge=8, description="Truncate scored text to this many tokens (from the left)."
    )
    batch_size: int = Field(16, ge=1, description="Texts per reward forward pass.")
    incremental: bool = Field(
        True,
        description="Keep each live candidate's reward-model KV cache between decisions "
        "(lm_likelihood, and classifiers that pool a causal model's last token): the prompt is "
        "prefilled once and each decision feeds only the new tokens. Scores equal full "
        "re-scoring within float tolerance; other models and callables are scored in full "
        "(docs/rewards.md).",
    )
    cache_gb: float = Field(
        1.0, gt=0,
        description="With `incremental`: the most GiB of reward-model KV cache an actor keeps; "
        "beyond it the least recently used prompts are forgotten (scored in full next time).",
    )
    pool_size: int = Field(1, ge=1, description="Number of reward actors.")
    num_cpus: float = Field(1.0, gt=0, description="Ray CPUs per reward actor.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per reward actor (fractions share).")
    placement: Literal["own", "with_generator"] = Field(
        "own",
        description="own: `pool_size` actors shared by every generator; with_generator: each "
        "generator gets `pool_size` actors of its own in one placement group with it (PACK: "
        "same node; a fractional `num_gpus` shares the generator's GPU).",
    )
    threads: int | None = Field(
        None, ge=1, description="Torch CPU threads per reward actor; default: all cores."
    )

    @property
    def label(self) -> str:
        return self.name or f"{self.type}({self.model or self.function})"

    @model_validator(mode="after")
    def _source_for_type(self) -> RewardSpec:
        if self.type in ("classifier", "lm_likelihood") and not self.model:
            raise ValueError(f"reward.model is required when reward.type is {self.type}")
        if self.type == "callable" and (not self.function or ":" not in self.function):
            raise ValueError(
                "reward.function must be 'module:function' when reward.type is callable"
            )
        return self


class TokensSchedule(_Strict):
    tokens: list[int] = Field(
        min_length=1, description="Generated lengths at which to score and reject (Algorithm 1)."
    )

    @field_validator("tokens")
    @classmethod
    def _increasing(cls, v: list[int]) -> list[int]:
        if any(t < 1 for t in v) or any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError(
                "decision tokens must be positive and strictly increasing, e.g. [32, 64]"
            )
        return v


class SearchSpec(_Strict):
    mode: Literal["sbon", "bon"] = Field(
        "sbon", description="sbon: speculative rejection; bon: plain Best-of-N (alpha ignored)."
    )
    n: int | Literal["auto"] = Field(
        16,
        description="Candidates per prompt (the N of Best-of-N), or `auto`: as many as the KV "
        "budget holds up to the first decision (t1 of a tokens schedule, `min_decision_tokens` "
        "of the memory schedule, max_new_tokens with mode bon), as the NeurIPS paper sizes "
        "its batch. With "
        "`auto` N depends on the device, so a job resumed on another device may mix Ns.",
    )
    alpha: float = Field(
        0.5, ge=0.0, lt=1.0, description="Fraction of in-play candidates rejected per decision."
    )
    schedule: Literal["memory", "auto"] | TokensSchedule = Field(
        "memory",
        description="`memory` (NeurIPS version): decide at `min_decision_tokens`, then whenever "
        "the live candidates' KV cache would outgrow the prompt's share of the budget; or "
        "`{tokens: [t1, t2, ...]}` (workshop Algorithm 1): decide at fixed generated lengths; "
        "or `auto`: the first `calibration_prompts` prompts run as Best-of-N (their answers "
        "are exact and kept), their candidates choose the cheapest alpha and tokens schedule "
        "whose normalized score keeps its 95% lower bound at `target_score`, and the rest of "
        "the job runs with it (docs/calibration.md). Either way all live candidates of a "
        "prompt meet at a decision and one cut-off ranks them all.",
    )
    target_score: float = Field(
        99.0, ge=0, le=100,
        description="The normalized score (paper eq. 6, against Best-of-N on the same "
        "candidates, mean over prompts) the run aims at: with schedule auto, a chosen "
        "setting's 95% bootstrap lower bound must reach it; the audit (`audit_fraction`) "
        "warns when its interval lies below it. 0 takes the cheapest setting calibrated.",
    )
    calibration_prompts: int = Field(
        8, ge=1,
        description="schedule auto: how many of the job's first prompts calibrate (run as "
        "Best-of-N, their prefixes scored at 8, 16, 32, 64 and 128 tokens). More prompts give a "
        "tighter bound, so a cheaper setting can qualify.",
    )
    calibration_fallback: Literal["bon", "closest"] = Field(
        "bon",
        description="schedule auto, when no setting reaches the target: `bon` runs the rest as "
        "Best-of-N (the target is then met by construction); `closest` runs the setting with "
        "the highest lower bound, and says so.",
    )
    audit_fraction: float = Field(
        0.02, ge=0, le=1,
        description="Share of prompts (chosen by a hash of `seed` and the prompt id) that also "
        "run a shadow Best-of-N: the same N candidates decoded to the end, by candidate "
        "identity, so the run measures its own normalized score (paper eq. 6) on real "
        "prompts. The answers stay the run's; the shadow's tokens are counted apart "
        "(run.json `audit`). The summary warns when the score's 95% interval lies below "
        "`target_score`; with `schedule: auto` the job then recalibrates on the audited "
        "prompts. 0 turns it off; mode bon and `n: auto` are never audited "
        "(docs/calibration.md).",
    )
    min_decision_tokens: int = Field(
        16,
        ge=1,
        description="Memory schedule: the first decision's length. With a fixed N a prompt's "
        "share is what its N candidates hold at this length (capped by the device budget), "
        "so later decisions fall where the survivors have grown back into it (about every "
        "doubling at alpha 0.5) and a large device holds several prompts; with `n: auto` "
        "the share is the whole budget, as in the paper.",
    )
    kv_budget_gb: float = Field(
        2.0,
        gt=0,
        description="KV-cache budget in GiB on CPU (CUDA sizes it from free memory); it bounds "
        "the rows the running batch holds.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of free CUDA memory given to the KV cache."
    )
    refill: bool = Field(
        True,
        description="Admit the next prompt's candidates into the running batch as soon as "
        "rejected and finished ones leave room (cross-prompt refill); results are the same "
        "either way.",
    )
    reward_combine: Literal["zscore", "rank"] = Field(
        "zscore",
        description="With several rewards: weighted sum of per-prompt z-scores, or weighted "
        "average of per-prompt ranks.",
    )

    @field_validator("n", mode="before")
    @classmethod
    def _n_count_or_auto(cls, v: Any) -> Any:
        # One line for a bad value, instead of one per arm of the union.
        if isinstance(v, bool):
            raise ValueError("expected a number, not true/false")
        if v == "auto" or (isinstance(v, int) and v >= 1):
            return v
        raise ValueError("must be a positive integer or auto")

    @property
    def n_or_none(self) -> int | None:
        """N for the engine: None for `auto` (sized from the KV budget per prompt)."""
        return None if self.n == "auto" else self.n

    @property
    def effective_alpha(self) -> float:
        return 0.0 if self.mode == "bon" else self.alpha

    @property
    def decision_tokens(self) -> list[int] | None:
        return None if isinstance(self.schedule, str) else list(self.schedule.tokens)

    @property
    def calibrates(self) -> bool:
        """schedule auto: the job chooses its alpha and schedule from calibration prompts."""
        return self.schedule == "auto"


class ClusterSpec(_Strict):
    address: str | None = Field(
        None, description="Ray address; default: $RAY_ADDRESS, else a new local cluster."
    )
    generators: int | Literal["auto"] = Field(
        1,
        description="Number of generator actors (>= 1), or `auto`: start one, ask the "
        "autoscaler for `max_generators` and add actors as resources appear; idle actors are "
        "released once no shard is left to start.",
    )
    max_generators: int = Field(
        4, ge=1, description="With `generators: auto`: the most generator actors to run."
    )
    overlap_scoring: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Keep decoding while reward actors score a decision (on), or wait for the "
        "scores (off). auto: on when the generator runs on a GPU; off on CPU, where the "
        "generator and the rewards would fight over the same cores (measured 1.75x slower "
        "on 2 cores, see BENCHMARKS.md). Results are the same either way.",
    )
    overlap_max_tokens: int = Field(
        16, ge=0,
        description="With overlapped scoring: how many tokens live candidates may decode past an "
        "open decision before they wait for its scores. The tokens of candidates it then "
        "rejects are discarded (counted in run.json and the summary); KV reservations include "
        "them. 0 waits at once.",
    )
    gpus_per_generator: float = Field(0.0, ge=0, description="Ray GPUs per generator actor.")
    cpus_per_generator: float = Field(1.0, gt=0, description="Ray CPUs per generator actor.")
    shard_size: int = Field(4, ge=1, description="Prompts per shard (the unit of work and resume).")
    shards_in_flight: int = Field(
        2, ge=1,
        description="Shards each generator holds at once. With 2, the next shard's prompts join "
        "the running batch as the current shard's finish, so a generator never drains between "
        "shards; results are still written per shard. 1: one shard at a time.",
    )
    call_timeout_s: float = Field(
        1800.0, gt=0, description="Longest wait for one shard or scoring call before retrying."
    )
    max_shard_retries: int = Field(
        2, ge=0, description="Retries of a failed shard before giving up."
    )
    startup_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for the actors to load their models."
    )

    @field_validator("generators", mode="before")
    @classmethod
    def _count_or_auto(cls, v: Any) -> Any:
        # One line for a bad value, instead of one per arm of the union.
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError("must be a positive integer or auto")

    @model_validator(mode="after")
    def _max_only_with_auto(self) -> ClusterSpec:
        # A cap that silently does nothing would mislead: say where it applies.
        if "max_generators" in self.model_fields_set and self.generators != "auto":
            raise ValueError("max_generators applies only with generators: auto; remove it "
                             "or set generators: auto")
        return self


class FiltersSpec(_Strict):
    """Applied to each prompt's finished candidates before the formats pick from them, in this
    order: drop_truncated, min_reward, dedupe; then min_margin on the pairs. `best.parquet` and
    `candidates.parquet` are never filtered. What each filter removed is counted in `run.json`."""

    min_reward: float | None = Field(None, description="Drop candidates scoring below this.")
    min_margin: float | None = Field(
        None, ge=0, description="Drop preference pairs whose reward margin is below this."
    )
    drop_truncated: bool = Field(
        False, description="Drop candidates that hit max_new_tokens (finish_reason `length`)."
    )
    dedupe: bool = Field(
        True, description="Keep one of identical response texts within a prompt (lowest index)."
    )


class OutputSpec(_Strict):
    path: str = Field(
        description="Output directory: a local path or an fsspec URL (`s3://`, `gs://`, "
        "`file://`, `memory://`)."
    )
    if_exists: Literal["resume", "overwrite", "refuse"] = Field(
        "resume",
        description="resume: keep finished shards of the same spec; overwrite: start over, "
        "removing only the files the earlier runs listed in manifest.json, and only once every "
        "input has passed its checks; refuse: stop if the directory has results. A directory "
        "that is neither empty nor a specrej-ray output is always refused.",
    )
    formats: list[Literal["sft", "preference", "top_k"]] = Field(
        default_factory=lambda: ["sft", "preference", "top_k"],
        description="Training files to derive (`best` and `candidates` are always written): "
        "sft: `sft_messages` and `sft_prompt_completion`; preference: `preference`; "
        "top_k: `top_k`. Re-derived on every run, so changing it needs no regeneration.",
    )
    jsonl: bool = Field(False, description="Also write a `.jsonl` twin of each format file.")
    pairs: Literal["best_vs_worst", "best_vs_each"] = Field(
        "best_vs_worst",
        description="Preference pairs per prompt: the best finished candidate vs the worst, "
        "or vs each of up to `pairs_k` others, lowest rewards first.",
    )
    pairs_k: int | None = Field(
        None, ge=1, description="best_vs_each: pairs per prompt at most; default: every other."
    )
    top_k: int = Field(4, ge=1, description="Best finished responses per prompt in `top_k`.")
    filters: FiltersSpec = Field(default_factory=FiltersSpec)

    @field_validator("formats")
    @classmethod
    def _unique_formats(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _pairs_k_needs_each(self) -> OutputSpec:
        if self.pairs_k is not None and self.pairs != "best_vs_each":
            raise ValueError("output.pairs_k is only used when output.pairs is best_vs_each")
        return self


class JobSpec(_Strict):
    name: str = Field("specrej", description="Job name (logs, run.json).")
    seed: int = Field(0, ge=0, description="Seed of every candidate's random stream.")
    prompts: PromptsSpec
    generator: GeneratorSpec
    reward: list[RewardSpec] = Field(
        description="One reward (a mapping) or several (a list, each with a weight)."
    )
    search: SearchSpec = Field(default_factory=SearchSpec)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    output: OutputSpec

    @field_validator("reward", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, dict) else v

    @field_validator("reward")
    @classmethod
    def _unique_names(cls, v: list[RewardSpec]) -> list[RewardSpec]:
        if not v:
            raise ValueError("list at least one reward")
        labels = [r.label for r in v]
        for label in labels:
            if labels.count(label) > 1:
                raise ValueError(f"two rewards are named {label!r}; give them distinct `name`s")
        return v

    @model_validator(mode="after")
    def _shared_gpu_fits(self) -> JobSpec:
        """A generator and the reward actors placed with it share one GPU by fractions, and
        Ray cannot split a fraction across GPUs: the fractions must add up to at most 1."""
        g = self.cluster.gpus_per_generator
        with_gen = [r for r in self.reward if r.placement == "with_generator"]
        parts = [x for x in [g] + [r.num_gpus for r in with_gen for _ in range(r.pool_size)]
                 if 0 < x < 1]
        if sum(parts) > 1 + 1e-9:
            raise ValueError(
                f"cluster.gpus_per_generator and the num_gpus of rewards with placement "
                f"with_generator share one GPU, but their fractions add up to {sum(parts):g}; "
                "lower them (or pool_size) to at most 1 together"
            )
        return self

    @model_validator(mode="after")
    def _auto_calibrates_sbon(self) -> JobSpec:
        if self.search.calibrates and self.search.mode == "bon":
            raise ValueError("search.schedule: auto chooses how SBoN rejects, and search.mode "
                             "is bon; use mode sbon or a fixed schedule")
        return self

    @model_validator(mode="after")
    def _decisions_within_response(self) -> JobSpec:
        tokens, most = self.search.decision_tokens, self.generator.sampling.max_new_tokens
        if tokens and tokens[-1] > most:
            raise ValueError(
                f"search.schedule.tokens: decision at {tokens[-1]} tokens is past "
                f"generator.sampling.max_new_tokens ({most}); drop it or raise max_new_tokens"
            )
        return self

    @property
    def reward_label(self) -> str:
        """One string naming the reward (or the weighted ensemble) for outputs."""
        if len(self.reward) == 1:
            return self.reward[0].label
        parts = " + ".join(f"{r.weight:g}*{r.label}" for r in self.reward)
        return f"{self.search.reward_combine}({parts})"

    def fingerprint(self) -> str:
        """Hash of every field that changes results (not where or how fast they are made)."""
        data = self.model_dump(mode="json", exclude=_NOT_IN_FINGERPRINT)
        blob = json.dumps(data, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# Settings that change how fast or where results are made, never what they are.
_NOT_IN_FINGERPRINT: dict[str, Any] = {
    "name": True,
    "cluster": True,
    "output": True,
    "generator": {"threads"},
    "reward": {"__all__": {"batch_size", "pool_size", "num_cpus", "num_gpus", "threads", "cache_gb",
                           "placement"}},
    "search": {"kv_budget_gb", "gpu_memory_utilization", "refill"},
}


def _format_error(source: str, err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    loc = loc.replace(".literal['memory','auto']", "").replace(".TokensSchedule", "")
    if err["type"] == "extra_forbidden":
        return f"{source}: {loc}: unknown key; check the spelling (see docs/spec.md)"
    if err["type"] == "missing":
        return f"{source}: {loc}: required field is missing"
    if err["type"] == "finite_number":
        return f"{source}: {loc}: must be a finite number, not .inf or .nan"
    msg = err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
    prefix = f"{loc}: " if loc else ""
    return f"{source}: {prefix}{msg}{shown}"


def _dedupe_schedule_errors(errors: list[dict[str, Any]], data: Any) -> list[dict[str, Any]]:
    """A bad schedule fails both union arms; report only the arm the user was writing."""
    schedule = (
        data.get("search", {}).get("schedule") if isinstance(data.get("search"), dict) else None
    )
    wrote_literal = isinstance(schedule, str)

    def wrong_arm(e: dict[str, Any]) -> bool:
        loc = [str(p) for p in e["loc"]]
        if "schedule" not in loc:
            return False
        is_literal_arm = any(p.startswith("literal") for p in loc)
        return is_literal_arm != wrote_literal

    return [e for e in errors if not wrong_arm(e)]


# A spec is a few KB of YAML: past these it is a mistake (or an attack), refused in one line
# before it costs minutes and gigabytes.
MAX_SPEC_BYTES = 1 << 20
MAX_SPEC_NODES = 100_000  # after aliases are expanded: a billion-laughs spec has 10^9


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges may be overridden on purpose
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # unhashable: the base class reports it
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first}); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, source: str) -> Any:
    """The YAML document, refused if its aliases expand past MAX_SPEC_NODES (the expanded
    size is what validation, fingerprints and run.json would walk)."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {}, set())
        if size > MAX_SPEC_NODES:
            raise SpecError(f"{source}: its aliases expand to over {MAX_SPEC_NODES:,} values; "
                            "a job spec is small: write the values out")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, memo: dict[int, int], open_: set[int]) -> int:
    """Nodes in the document once every alias is replaced by what it names (capped just
    past the limit, so a bomb is not counted to the end)."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in open_:
        raise SpecError("a YAML alias refers to itself; write the values out")
    open_.add(key)
    size = 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    for child in children:
        size += _expanded_size(child, memo, open_)
        if size > MAX_SPEC_NODES:
            break
    open_.discard(key)
    memo[key] = size
    return size


def _read_spec_text(path: Path) -> str:
    """The spec file's text: a regular file of at most MAX_SPEC_BYTES (a device or a FIFO
    would be read forever)."""
    try:
        # Asked before opening: opening a FIFO blocks until something writes to it.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise SpecError(f"{path}: not a regular file; give a YAML job spec")
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError(f"{path}: cannot read job spec ({e.strerror})") from None
    if len(raw) > MAX_SPEC_BYTES:
        size = os.path.getsize(path)
        raise SpecError(f"{path}: job spec is {size:,} bytes, over the {MAX_SPEC_BYTES >> 20} "
                        "MiB limit; a spec is a small YAML file (prompts go in prompts.path)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(
            f"{path}: not a text file (byte {e.start} is not UTF-8); give a YAML job spec"
        ) from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line for any PyYAML error: its problem (or reason) and line, never its excerpt."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}" if mark else ""
    what = getattr(e, "problem", None) or getattr(e, "reason", None) or type(e).__name__
    return f"{where}: {' '.join(str(what).split())}"


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set data['a']['b'] = value for 'a.b', creating sections as needed."""
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        if not isinstance(child, dict):
            raise SpecError(f"--set {dotted}: {k} is not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'search.alpha=0.7' -> ('search.alpha', 0.7); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise SpecError(f"--set {text!r}: expected KEY=VALUE, e.g. search.alpha=0.7")
    try:
        value = _load_yaml(raw, f"--set {key}") if raw.strip() else ""
    except yaml.YAMLError as e:
        raise SpecError(f"--set {key}: value is not valid YAML{_yaml_problem(e)}") from None
    return key.strip(), value


def validate_spec(data: Any, source: str = "<spec>") -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(
            f"{source}: a job spec must be a YAML mapping with sections prompts, generator, ..."
        )
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        errors = _dedupe_schedule_errors(e.errors(), data)
        if isinstance(data.get("reward"), dict):  # written as one mapping: no list index
            for err in errors:
                if err["loc"][:2] == ("reward", 0):
                    err["loc"] = ("reward", *err["loc"][2:])
        raise SpecError("\n".join(_format_error(source, err) for err in errors)) from None


def load_spec(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Read, override and validate a job spec; relative paths resolve from the spec's folder."""
    path = Path(path)
    text = _read_spec_text(path)
    try:
        data = _load_yaml(text, str(path))
    except RecursionError:
        raise SpecError(f"{path}: nested too deeply; a job spec is a few levels deep") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML{_yaml_problem(e)}") from None
    data = {} if data is None else data
    if isinstance(data, dict):
        try:
            for item in overrides or []:
                set_dotted(data, *parse_override(item))
        except SpecError as e:  # every line names the spec file, as validation errors do
            raise SpecError(f"{path}: {e}") from None
    spec = validate_spec(data, str(path))
    return _resolve_relative_paths(spec, path.parent)


def _resolve_relative_paths(spec: JobSpec, base: Path) -> JobSpec:
    """Prompt and output paths are relative to the current directory, as users expect from CLIs;
    a prompt path that only exists relative to the spec file is taken from there."""
    p = Path(spec.prompts.path).expanduser()
    if not p.is_absolute() and not _exists(p) and _exists(base / p):
        spec.prompts.path = str(base / p)
    return spec


def _exists(path: Path) -> bool:
    # An over-long name raises instead of answering; prompts.py reports the path.
    try:
        return path.exists()
    except (OSError, ValueError):
        return False
