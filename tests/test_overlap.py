"""cluster.overlap_scoring: when the generator actor decodes while rewards score."""

from __future__ import annotations

import pytest
import torch

from specrej_ray.job.engines import overlaps_scoring
from specrej_ray.spec import JobSpec


@pytest.mark.parametrize(
    ("setting", "device", "expected"),
    [("auto", "cpu", False), ("auto", "cuda", True), ("on", "cpu", True),
     ("off", "cuda", False)],
)
def test_overlap_follows_the_setting_and_the_device(setting, device, expected):
    assert overlaps_scoring(setting, torch.device(device)) is expected


def test_overlap_does_not_change_the_fingerprint(tiny_lm_dir, tmp_path):
    from tests.conftest import tiny_job, write_jsonl

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    job = tiny_job(tmp_path, tiny_lm_dir, prompts)
    base = JobSpec.model_validate(job)
    job["cluster"] = {**job["cluster"], "overlap_scoring": "on"}
    assert JobSpec.model_validate(job).fingerprint() == base.fingerprint()
    job["cluster"]["overlap_scoring"] = "sometimes"
    with pytest.raises(ValueError, match="overlap_scoring"):
        JobSpec.model_validate(job)
