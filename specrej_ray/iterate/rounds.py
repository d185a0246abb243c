"""Each round's job spec, derived from the iterate spec (pure): its output directory, its
generator (the current policy) and its prompts."""

from __future__ import annotations

import posixpath
from typing import Any

from specrej_ray.spec import JobSpec, validate_spec

# The file each `train_on` trains on (prompt-completion: TRL's loss on the completion only).
TRAIN_FILES = {"sft": "sft_prompt_completion.parquet", "preference": "preference.parquet"}
STATE = "iterate.json"


def round_dir(root: str, r: int) -> str:
    return posixpath.join(root, f"round-{r}")


def model_dir(root: str, r: int) -> str:
    """Where round r's trained model is published (the generator of round r + 1)."""
    return posixpath.join(round_dir(root, r), "model")


def checkpoint_dir(root: str, r: int) -> str:
    return posixpath.join(round_dir(root, r), "train")


def round_spec(spec: JobSpec, r: int, policy: str | None) -> JobSpec:
    """Round r's job: the spec's, generating with `policy` (None: generator.model, round 0)
    into OUT/round-r, on the round's prompts. Its fingerprint is a plain run's: the round
    directory is a dataset like any other."""
    it = spec.iterate
    assert it is not None
    # Only what the spec set: defaults are filled in again, as for any spec.
    data: dict[str, Any] = spec.model_dump(mode="json", exclude={"iterate"}, exclude_unset=True)
    data["name"] = f"{spec.name}-round-{r}"
    data["output"]["path"] = round_dir(spec.output.path, r)
    data["output"]["if_exists"] = "resume"
    data["output"].pop("formats", None)
    data["output"]["formats"] = list(spec.output.formats)
    if policy is not None:
        data["generator"]["model"] = policy
        data["generator"]["revision"] = None  # a local directory has none
        if it.reward == "policy":
            for reward in data["reward"] if isinstance(data["reward"], list) else [data["reward"]]:
                if (reward.get("type") == "lm_likelihood"
                        and reward.get("model") == spec.generator.model):
                    reward["model"], reward["revision"] = policy, None
    prompts = data["prompts"]
    if it.prompts.mode == "slice":
        size = it.prompts.per_round or 0
        prompts["offset"] = spec.prompts.offset + r * size  # the spec's offset starts slice 0
        prompts["limit"] = size
    elif it.prompts.mode == "files":
        prompts["path"] = it.prompts.paths[r]
    return validate_spec(data)


def train_file(spec: JobSpec, r: int) -> str:
    assert spec.iterate is not None
    return posixpath.join(round_dir(spec.output.path, r), TRAIN_FILES[spec.iterate.train_on])


def loop_fingerprint(spec: JobSpec) -> str:
    """What a resumed loop must share with the one that started: the job's fingerprint and
    the iterate section, bar the round count (raise it to go on), the trainer (fix a
    failing one and go on; each round's record names the trainer that made its model) and
    the evaluation (it reads the policies and changes none)."""
    import hashlib
    import json

    assert spec.iterate is not None
    # Defaults left out: a key a later version adds (at its default) keeps old loops resumable.
    it = spec.iterate.model_dump(mode="json", exclude={"rounds", "trainer", "evaluate"},
                                 exclude_defaults=True)
    blob = json.dumps({"job": spec.fingerprint(), "iterate": it}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
