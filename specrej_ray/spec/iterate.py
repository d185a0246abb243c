"""The `iterate:` section: expert iteration's rounds, what trains and on which prompts."""

from __future__ import annotations

import string
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from specrej_ray.spec.base import _Strict

# What a `command` trainer's template may name (each is filled in, shell-quoted).
COMMAND_FIELDS = {
    "data": "the round's training file (parquet)",
    "model": "the model directory to train from",
    "output": "the directory the trained model must be saved to (save_pretrained)",
    "checkpoints": "a directory kept across restarts, for the trainer's checkpoints",
    "round": "the round number (0, 1, ...)",
    "seed": "the spec's seed",
}


class TrainerSpec(_Strict):
    type: Literal["trl", "command"] = Field(
        "trl", description="trl: TRL's SFTTrainer (train_on sft) or DPOTrainer (train_on "
        "preference), in process; command: your own trainer, run from `command`.")
    args: dict[str, Any] = Field(
        default_factory=dict, description="type trl: SFTConfig / DPOConfig fields, e.g. "
        "learning_rate, num_train_epochs, per_device_train_batch_size (output_dir is ours).")
    command: str | None = Field(
        None, description="type command: a command line with {data}, {model}, {output}, "
        "{checkpoints}, {round}, {seed}; it must save a model to {output} and exit 0. Run "
        "without a shell (wrap in `bash -c '...'` for one).")
    num_cpus: float = Field(1.0, gt=0, description="CPUs the training task reserves (Ray).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs the training task reserves (Ray).")
    max_restarts: int = Field(
        1, ge=0, description="Times a training task whose worker or node died is started "
        "again (from its last checkpoint) before the round fails.")

    @field_validator("command")
    @classmethod
    def _known_fields(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(v) if name is not None}
        except ValueError as e:
            raise ValueError(f"not a valid template ({e}); write braces as {{{{ and }}}}"
                             ) from None
        unknown = sorted(names - set(COMMAND_FIELDS))
        if unknown:
            raise ValueError(f"unknown field {{{unknown[0]}}}; use "
                             + ", ".join(f"{{{n}}}" for n in COMMAND_FIELDS))
        if "output" not in names:
            raise ValueError("the command must save the model to {output}; name it")
        return v

    @model_validator(mode="after")
    def _command_or_args(self) -> TrainerSpec:
        if self.type == "command" and not self.command:
            raise ValueError("type command needs `command`, a command line with {output}")
        if self.type == "trl" and self.command:
            raise ValueError("`command` is for type command; set type: command or drop it")
        if self.type == "command" and self.args:
            raise ValueError("`args` are TRL config fields (type trl); put a command "
                             "trainer's options in its command line")
        if "output_dir" in self.args:
            raise ValueError("args.output_dir is chosen by specrej-ray (OUT/round-R/train); "
                             "drop it")
        return self


class RoundPromptsSpec(_Strict):
    mode: Literal["same", "slice", "files"] = Field(
        "same", description="same: prompts.path every round; slice: round r takes prompts "
        "[r*per_round, (r+1)*per_round) of prompts.path (OpenRLHF's loop); files: round r "
        "reads paths[r].")
    per_round: int | None = Field(None, ge=1, description="mode slice: prompts per round.")
    paths: list[str] = Field(default_factory=list,
                             description="mode files: one prompt file per round.")

    @model_validator(mode="after")
    def _mode_fields(self) -> RoundPromptsSpec:
        if self.mode == "slice" and self.per_round is None:
            raise ValueError("mode slice needs per_round, the prompts of each round")
        if self.mode == "files" and not self.paths:
            raise ValueError("mode files needs paths, one prompt file per round")
        if self.mode != "slice" and self.per_round is not None:
            raise ValueError("per_round is for mode slice")
        if self.mode != "files" and self.paths:
            raise ValueError("paths are for mode files")
        return self


class EvaluateSpec(_Strict):
    prompts: str = Field(
        description="Prompt file of the held-out evaluation: rows with verifiable "
        "instructions in the columns the spec's instructions reward names (IFEval's format), "
        "read with the spec's prompt_field and id_field. Keep it apart from the training "
        "prompts.")
    limit: int | None = Field(None, ge=1, description="Evaluate on the first `limit` prompts "
                              "of the file only; default: all.")


class IterateSpec(_Strict):
    rounds: int = Field(2, ge=1, le=1000, description="Rounds of generate-then-train.")
    train_on: Literal["sft", "preference"] = Field(
        "sft", description="sft: the best response of each prompt "
        "(sft_prompt_completion.parquet, SFT); preference: chosen/rejected pairs "
        "(preference.parquet, DPO). output.formats must include it.")
    train_from: Literal["previous", "base"] = Field(
        "previous", description="previous: round r trains the policy that generated it; "
        "base: every round trains generator.model again on its own data (ReST-EM).")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    prompts: RoundPromptsSpec = Field(default_factory=RoundPromptsSpec)
    reward: Literal["fixed", "policy"] = Field(
        "fixed", description="fixed: every round scores with the spec's reward models; "
        "policy: an lm_likelihood reward whose model is generator.model scores with the "
        "round's policy instead (the likelihood under the current model).")
    evaluate: EvaluateSpec | None = Field(
        None, description="Evaluate every policy (generator.model before round 0, each "
        "round's trained model once published) as `specrej-ray evaluate` does: IFEval's "
        "prompt- and instruction-level accuracy of a greedy and a sampled response per prompt, "
        "response length and distinct-2, each against the base with a paired bootstrap "
        "interval; recorded in iterate.json and OUT/eval/. Needs a reward of type "
        "instructions (docs/expert-iteration.md).")

    @model_validator(mode="after")
    def _files_cover_rounds(self) -> IterateSpec:
        if self.prompts.mode == "files" and len(self.prompts.paths) < self.rounds:
            raise ValueError(f"prompts.paths lists {len(self.prompts.paths)} file(s) for "
                             f"{self.rounds} rounds; give one per round")
        return self
