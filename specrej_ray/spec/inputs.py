"""The spec's inputs: prompts, the generator (and its sampling) and the rewards."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from specrej_ray.spec.base import _Strict


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
    offset: int = Field(0, ge=0, description="Skip the first `offset` valid prompts (with "
                        "`limit`: a slice of the file).")
    limit: int | None = Field(None, ge=1, description="Use only the first `limit` prompts "
                              "(after `offset`).")


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


class VllmSpec(_Strict):
    """vLLM engine options (generator.engine: vllm); the rest of vLLM's EngineArgs go in
    engine_kwargs."""

    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Share of the GPU's memory vLLM may take (weights, "
        "activations, KV cache); default: search.gpu_memory_utilization. On CPU the KV cache "
        "is search.kv_budget_gb instead.")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt plus response vLLM plans for; default: the "
        "model's context length. Lower it to fit a long-context model's KV cache; unless "
        "engine is hf, a prompt whose tokens plus max_new_tokens exceed it is refused as a row "
        "(errors file).")
    enforce_eager: bool = Field(
        False, description="Skip torch.compile and CUDA graphs: starts in seconds instead of "
        "a minute, decodes slower.")
    quantization: str | None = Field(
        None, description="vLLM quantization method (awq, gptq, fp8, ...); default: what the "
        "checkpoint says.")
    kv_cache_dtype: str = Field(
        "auto", description="KV cache dtype (auto = the model's; fp8 halves the cache).")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Any other vllm.EngineArgs field, as is (e.g. "
        "max_num_seqs, block_size); checked against EngineArgs where vLLM is installed.")


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
        None, ge=1, description="Torch CPU threads per generator actor; default: the node's "
        "cores, less the threads of reward actors that score with a model on the CPU beside it "
        "(they run at once: job/threads.py)."
    )
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    engine: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="The backend: hf, our engine (exact and seeded, the CPU default; "
        "it refuses softcapped, sliding-window and attention-sink models); vllm, the algorithm "
        "inside vLLM's continuous batch (the `vllm` extra; every family vLLM serves, tensor "
        "parallel). auto = vllm when it is installed and the generator has a GPU, else hf.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs per generator (engine vllm): each generator actor reserves "
        "a placement group of this many {GPU: 1, CPU: 1} bundles on one node.")
    vllm: VllmSpec = Field(default_factory=VllmSpec)

    @model_validator(mode="after")
    def _vllm_options(self) -> GeneratorSpec:
        if self.tensor_parallel_size > 1 and self.engine == "hf":
            raise ValueError("tensor_parallel_size > 1 needs engine: vllm (or auto on GPUs)")
        from specrej_ray.spec.vllm_kwargs import check_engine_kwargs

        check_engine_kwargs(self.vllm.engine_kwargs)
        return self


# Fields of a reward that runs as reward actors on a model or function, and fields of the
# instructions reward alone.
_MODEL_REWARD_ONLY = {
    "model", "function", "revision", "dtype", "device", "chat_template", "trust_remote_code",
    "label_index", "max_length", "batch_size", "incremental", "cache_gb", "pool_size",
    "num_cpus", "num_gpus", "placement", "threads",
}
_INSTRUCTIONS_ONLY = {"loose", "instructions_field", "kwargs_field"}


# reward.type instructions: the share of a row's instructions followed; all of them is 1.0.
INSTRUCTIONS_CEILING = 1.0


class RewardSpec(_Strict):
    type: Literal["classifier", "lm_likelihood", "callable", "instructions"] = Field(
        description="classifier: sequence-classification RM; lm_likelihood: mean log-prob "
        "of the response under `model`; callable: `function` scores text; instructions: the "
        "share of the row's verifiable instructions (IFEval's checkers, each row's "
        "`instruction_id_list` and `kwargs`) the response follows, scored in the generator's "
        "process, with bounds that let `search.bounds` stop hopeless candidates early "
        "(docs/rewards.md)."
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
    loose: bool = Field(
        False, description="instructions: IFEval's loose check (an instruction also counts as "
        "followed if the response with its first or last line, or its `*`s, removed follows "
        "it) instead of the strict one. Loose scores give fewer bounds.")
    instructions_field: str = Field(
        "instruction_id_list", description="instructions: the prompt column listing each row's "
        "instruction ids (IFEval's own field).")
    kwargs_field: str = Field(
        "kwargs", description="instructions: the prompt column holding each instruction's "
        "arguments, a list aligned with the ids (IFEval's own field).")
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
        None, ge=1, description="Torch CPU threads per reward actor; default: its num_cpus "
        "(rounded up)."
    )
    ceiling: float | None = Field(
        None,
        description="type callable: the highest score the function gives (every check passed, "
        "say), which search.draws stops a prompt at. instructions has its own (1.0: every "
        "instruction followed); classifier and lm_likelihood have none.",
    )

    @property
    def reward_ceiling(self) -> float | None:
        """The highest score the reward gives, where it has one."""
        return INSTRUCTIONS_CEILING if self.type == "instructions" else self.ceiling

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.type == "instructions":
            return f"instructions({'loose' if self.loose else 'strict'})"
        return f"{self.type}({self.model or self.function})"

    @property
    def local(self) -> bool:
        """Scored in the generator's own process (no reward actors): cheap checks of text."""
        return self.type == "instructions"

    @property
    def row_fields(self) -> tuple[str, ...]:
        """Prompt columns this reward reads from each row."""
        return (self.instructions_field, self.kwargs_field) if self.type == "instructions" \
            else ()

    @model_validator(mode="after")
    def _source_for_type(self) -> RewardSpec:
        # A knob that silently does nothing would mislead: say which apply.
        if self.type == "instructions":
            unused = sorted(self.model_fields_set & _MODEL_REWARD_ONLY)
            if unused:
                raise ValueError(
                    f"reward.type instructions is scored in the generator's process from each "
                    f"row's instructions: {', '.join(unused)} do(es) not apply; remove them "
                    "(a reward model goes in a second entry of a reward list)")
        else:
            unused = sorted(self.model_fields_set & _INSTRUCTIONS_ONLY)
            if unused:
                raise ValueError(f"{', '.join(unused)} only apply to reward.type instructions; "
                                 "remove them")
        if self.type in ("classifier", "lm_likelihood") and not self.model:
            raise ValueError(f"reward.model is required when reward.type is {self.type}")
        if self.type == "callable" and (not self.function or ":" not in self.function):
            raise ValueError(
                "reward.function must be 'module:function' when reward.type is callable"
            )
        if self.ceiling is not None and self.type in ("classifier", "lm_likelihood"):
            raise ValueError(f"reward.ceiling: a {self.type} reward has no highest score to "
                             "stop at; remove it (search.draws until: rule stops without one)")
        if self.ceiling is not None and self.type == "instructions" and \
                self.ceiling != INSTRUCTIONS_CEILING:
            raise ValueError(f"reward.ceiling: instructions scores the share of instructions "
                             f"followed, whose highest is {INSTRUCTIONS_CEILING:g}, not "
                             f"{self.ceiling:g}; remove it")
        return self
