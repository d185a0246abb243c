"""Our training files drop into TRL unchanged: one optimizer step of SFTTrainer on each SFT
file and of DPOTrainer on the preference file of a finished tiny run, loaded as a user would
(`datasets.load_dataset("parquet", ...)`), on the tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from specrej_ray.distributed.driver import run_job
from specrej_ray.errors import TrainError
from specrej_ray.spec import validate_spec
from specrej_ray.train import TrainJob, train
from tests.conftest import tiny_job, write_jsonl

pytestmark = pytest.mark.ray

STEP = dict(max_steps=1, per_device_train_batch_size=2, learning_rate=1e-2, report_to=[],
            use_cpu=True, save_strategy="no", logging_steps=1, max_length=128)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_lm_dir, ray_cluster) -> Path:
    tmp = tmp_path_factory.mktemp("trl-run")
    prompts = write_jsonl(tmp / "p.jsonl", [{"id": f"q{i}", "prompt": f"Tell me about {i}."}
                                            for i in range(4)])
    job = tiny_job(tmp, tiny_lm_dir, prompts,
                   output={"path": str(tmp / "out"), "formats": ["sft", "preference"]})
    run_job(validate_spec(job), echo=lambda *a, **k: None)
    return tmp / "out"


def one_step(trainer_cls, config_cls, tiny_lm_dir, data: Path, tmp_path: Path) -> None:
    """Train one step on `data` and check a step happened, with a finite loss, that moved
    the weights."""
    dataset = load_dataset("parquet", data_files=str(data), split="train")
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = trainer_cls(model=model, args=config_cls(output_dir=str(tmp_path), **STEP),
                          train_dataset=dataset, processing_class=tokenizer)
    result = trainer.train()
    assert trainer.state.global_step == 1
    assert math.isfinite(result.training_loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# TRL is imported in the tests, not at collection: every pytest worker collects this module
# and importing TRL costs each half a second.
@pytest.mark.parametrize("name", ["sft_messages", "sft_prompt_completion"])
def test_sft_trainer_trains_on_our_sft_files(run_dir, tiny_lm_dir, tmp_path, name):
    from trl import SFTConfig, SFTTrainer

    one_step(SFTTrainer, SFTConfig, tiny_lm_dir, run_dir / f"{name}.parquet", tmp_path)


def test_dpo_trainer_trains_on_our_preference_file(run_dir, tiny_lm_dir, tmp_path):
    from trl import DPOConfig, DPOTrainer

    one_step(DPOTrainer, DPOConfig, tiny_lm_dir, run_dir / "preference.parquet", tmp_path)


def test_a_value_trl_refuses_only_once_training_starts_is_the_users_to_fix(run_dir, tiny_lm_dir,
                                                                           tmp_path):
    """TRL's config takes eval_strategy steps; its trainer refuses it (no eval set). A
    TrainError, one line: `iterate` exits 2 and does not retry; nothing is published."""
    round_dir = tmp_path / "round-0"
    job = TrainJob(round=0, data=str(run_dir / "sft_prompt_completion.parquet"),
                   start=str(tiny_lm_dir), model=str(round_dir / "model"),
                   checkpoints=str(round_dir / "train"), train_on="sft", kind="trl",
                   args={"max_steps": 1, "eval_strategy": "steps"})
    with pytest.raises(TrainError) as e:
        train(job, echo=lambda *a, **k: None)
    assert str(e.value).startswith("iterate.trainer: round 0: TRL's SFTTrainer refused to "
                                   "train: You have set `args.eval_strategy`"), str(e.value)
    assert "\n" not in str(e.value)
    assert [p.name for p in round_dir.iterdir()] == ["train"]
