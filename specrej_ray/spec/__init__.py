"""The YAML job spec: typed, validated, with one clear line per error.

By section: inputs (prompts, generator, reward), search, running (cluster, output); the
whole JobSpec and its fingerprint in job.py; reading a file in load.py; docs.py renders
docs/spec.md from these models.
"""

from specrej_ray.spec.base import SpecError
from specrej_ray.spec.inputs import GeneratorSpec, PromptsSpec, RewardSpec, SamplingSpec
from specrej_ray.spec.job import JobSpec
from specrej_ray.spec.load import (
    MAX_SPEC_BYTES,
    MAX_SPEC_NODES,
    load_spec,
    parse_override,
    set_dotted,
    validate_spec,
)
from specrej_ray.spec.running import ClusterSpec, FiltersSpec, OutputSpec
from specrej_ray.spec.search import SearchSpec, TokensSchedule

__all__ = ["MAX_SPEC_BYTES", "MAX_SPEC_NODES", "ClusterSpec", "FiltersSpec", "GeneratorSpec",
           "JobSpec", "OutputSpec", "PromptsSpec", "RewardSpec", "SamplingSpec", "SearchSpec",
           "SpecError", "TokensSchedule", "load_spec", "parse_override", "set_dotted",
           "validate_spec"]
