"""Where and how a job runs and what it writes: the cluster and output sections."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from specrej_ray.spec.base import _Strict


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
        description="While the reward actors score a decision, its prompt's live candidates "
        "decode on past it (on, at most overlap_max_tokens) or wait at it (off); every other "
        "prompt decodes on either way, and the generator waits only when no row can move. "
        "auto: on when the generator runs on a GPU; off on CPU (on was 1.75x slower on 2 "
        "cores, when the generator and the rewards each took every core: BENCHMARKS.md). "
        "Results are the same either way.",
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
    lease_ttl_s: float = Field(
        60.0, ge=2, le=3600, description="Object stores (s3://, gs://): a run's lease on "
        "output.path is renewed every quarter of this; a lease not renewed for this long is "
        "stale, and the next run takes it over. Local paths use an OS lock instead.")

    @field_validator("path")
    @classmethod
    def _named(cls, v: str) -> str:
        if not v.strip():  # "" is the current directory to fsspec: never a run's output
            raise ValueError("names no folder; give one (e.g. out/my-run) or a URL")
        return v

    @field_validator("formats")
    @classmethod
    def _unique_formats(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _pairs_k_needs_each(self) -> OutputSpec:
        if self.pairs_k is not None and self.pairs != "best_vs_each":
            raise ValueError("output.pairs_k is only used when output.pairs is best_vs_each")
        return self
