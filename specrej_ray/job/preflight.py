"""The checks before Ray, in one pass: what `validate` checks is what `run` checks before its
driver starts Ray, because both call `preflight` (cli.py, distributed/driver.run_job, and
`iterate` before its loop connects).

Each check refuses in one line naming the key, file or row (a PromptError, ModelError or
OutputError). The pass walks the spec down the layers a job meets them in, twice: first the
checks that import nothing heavy, so that a user's first mistakes are refused in about a
second, then those that need torch, transformers, vLLM or the user's own code.

  quick   1. prompts  the source reads and holds a usable row (read up to the first one)
          2. models   each source resolved; its safetensors headers and embedding against
                      its config.json
          3. engine   vLLM's quick checks: tensor parallelism on this machine's GPUs,
                      max_model_len against config.json, engine_kwargs' plain types
          4. output   output.path: a place a run could create or use, not inside or around
                      another output, held by no other run, its results ones this spec may
                      use (output.if_exists), the prompts not inside it
  deep    5. rewards  a callable reward's function imports
          6. models   a GGUF converted (once, cached: the run loads the converted copy) and
                      each model built on the meta device against its weights
          7. engine   vLLM's own config objects, built from the spec
          8. context  max_new_tokens leaves room in the generator's context

A check of each prompt row against the spec goes in job.prepare.prompt_rows, which step 1
and the preparation of every prompt both read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specrej_ray.data.output import check_output
from specrej_ray.engine.vllm.preflight import (
    check_vllm_config,
    check_vllm_quick,
    local_gpus,
    uses_vllm,
)
from specrej_ray.job.prepare import (
    check_prompt_source,
    check_room,
    context_length,
    resolve_generator,
    resolve_rewards,
)
from specrej_ray.spec import JobSpec


@dataclass(frozen=True)
class Checked:
    """What the checks resolved, for the job to go on with."""

    gen_path: str  # the generator's model, resolved (a GGUF converted)
    rm_paths: list[str | None]  # each reward's (None: a callable), in spec order
    context: int  # the generator's context in tokens (job.prepare.context_length)


def preflight(spec: JobSpec, output: bool = True, here: bool = True,
              between: Callable[[], None] = lambda: None) -> Checked:
    """Every check before Ray, in the order of the module doc. `output`: check output.path
    (False where the caller holds it already, or where it is no output: `iterate`'s root).
    `here`: the generators run on this machine if the run starts its own Ray (False: Ray
    is already up, and its nodes may be other machines). `between`: called between the
    steps that take seconds (a stop's check)."""
    check_prompt_source(spec)
    quick_gen = resolve_generator(spec, convert=False, build=False)
    resolve_rewards(spec, convert=False, build=False)
    gpus = local_gpus(spec) if here and uses_vllm(spec) else None
    check_vllm_quick(spec, quick_gen, gpus)
    if output:
        check_output(spec.output.path, spec)
    between()
    check_reward_functions(spec)
    gen_path = resolve_generator(spec)
    between()
    rm_paths = resolve_rewards(spec)
    between()
    check_vllm_config(spec, gen_path, gpus)
    context = context_length(gen_path, spec)
    check_room(spec, context)
    return Checked(gen_path, rm_paths, context)


def check_reward_functions(spec: JobSpec) -> None:
    """Each callable reward's function imports (the user's module is imported here)."""
    from specrej_ray.reward.callable import import_function

    for reward in spec.reward:
        if reward.type == "callable":
            import_function(reward.function or "")
