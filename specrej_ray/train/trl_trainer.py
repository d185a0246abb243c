"""The built-in trainer: TRL's SFTTrainer on the round's SFT file or DPOTrainer on its
preference pairs, resumed from its last checkpoint (TRL's resume_from_checkpoint)."""

from __future__ import annotations

import dataclasses
import difflib
import tempfile
import types
import typing
import warnings
from pathlib import Path
from typing import Any

from specrej_ray.errors import TrainError, first_line
from specrej_ray.spec.base import fits

# Ours unless the spec's args say otherwise: checkpoints often enough to resume a killed
# round, no logging service, the spec's seed.
DEFAULTS: dict[str, Any] = {"report_to": [], "save_strategy": "steps", "save_steps": 25,
                            "save_total_limit": 2, "logging_steps": 10}


def trainer_classes(train_on: str) -> tuple[type, type]:
    """(trainer, config) for the file that trains."""
    if train_on == "preference":
        from trl import DPOConfig, DPOTrainer

        return DPOTrainer, DPOConfig
    from trl import SFTConfig, SFTTrainer

    return SFTTrainer, SFTConfig


def check_args(args: dict[str, Any], train_on: str) -> None:
    """Every key a field of the TRL config, every value one it takes: one line otherwise."""
    _, config_cls = trainer_classes(train_on)
    known = {f.name for f in dataclasses.fields(config_cls)}
    for key in args:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise TrainError(f"iterate.trainer.args.{key}: not a field of TRL's "
                             f"{config_cls.__name__}{hint}")
        _check_type(config_cls, key, args[key])
    # Checked as on a CPU (the driver may have no GPU where the training task will); TRL's
    # and torch's notices wait for the training, where they are said once. The config only
    # names its output_dir; a removed temporary one keeps `validate` from writing anything.
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        config = make_config(config_cls, args, str(Path(tmp) / "checked-only"), 0, cuda=False)
        _check_training_start(config, args)


# Values TRL's config takes but torch refuses when the trainer builds its data loader and
# optimizer, after a round's generation: torch's own constructors check them now (in
# milliseconds, nothing started). Each check names the keys it covers that the spec set.
_LOADER_KEYS = ("dataloader_num_workers", "dataloader_persistent_workers",
                "dataloader_prefetch_factor", "dataloader_multiprocessing_context")
_OPTIMIZER_KEYS = ("learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "optim",
                   "optim_args")


def _check_training_start(config, args: dict[str, Any]) -> None:
    from torch.utils.data import DataLoader

    checks = {
        ("per_device_train_batch_size",): lambda: DataLoader(
            range(1), batch_size=config.per_device_train_batch_size),
        _LOADER_KEYS: lambda: DataLoader(
            range(1), num_workers=config.dataloader_num_workers,
            persistent_workers=config.dataloader_persistent_workers,
            prefetch_factor=config.dataloader_prefetch_factor,
            multiprocessing_context=config.dataloader_multiprocessing_context),
        _OPTIMIZER_KEYS: lambda: _optimizer(config),
    }
    for keys, check in checks.items():
        try:
            check()
        except ValueError as e:
            named = [k for k in keys if k in args] or list(keys[:1])
            raise TrainError(f"iterate.trainer.args.{'/'.join(named)}: {first_line(e)} "
                             "(torch refuses it when training starts)") from None


def _optimizer(config) -> None:
    """The optimizer TRL's trainer would build, on one parameter: torch's value checks (lr,
    betas, eps). One from outside torch (bitsandbytes, GaLore...) is left to the training
    node, which may have what this machine lacks."""
    import torch
    from transformers import Trainer

    try:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(config)
    except Exception:  # a package missing here, or an optimizer that needs the model
        return
    if not cls.__module__.startswith("torch.optim"):
        return
    # fused / foreach pick kernels for the training's device, not values; the checks come first.
    kwargs = {k: v for k, v in kwargs.items() if k not in ("fused", "foreach")}
    cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)


_SIMPLE = (int, float, bool, str, type(None))


def _check_type(config_cls: type, key: str, value: Any) -> None:
    """Plain fields (int, float, bool, str, or None where optional) get a value of their
    type: TRL's configs take anything and fail only mid-training, after a round's
    generation."""
    hint = typing.get_type_hints(config_cls).get(key)
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union,
                                                                   types.UnionType) else (hint,)
    if not all(o in _SIMPLE for o in options):
        return  # lists, dicts, enums, literals: TRL's own checks
    if not fits(value, options):
        names = " or ".join("null" if o is type(None) else o.__name__ for o in options)
        raise TrainError(f"iterate.trainer.args.{key}: must be {names}, not {value!r}")


def make_config(config_cls: type, args: dict[str, Any], output_dir: str, seed: int,
                cuda: bool):
    # Without a GPU: the CPU, in float32 (TRL's bf16 default is for GPUs).
    device = {} if cuda else {"use_cpu": True, "bf16": False}
    try:
        return config_cls(output_dir=output_dir,
                          **{"seed": seed, **DEFAULTS, **device, **args})
    except (TypeError, ValueError) as e:
        reason = first_line(e)
        # The key TRL's message names, of those the spec set (the longest first: `eval_steps`
        # before `steps`), else the arguments as a whole.
        named = next((k for k in sorted(args, key=len, reverse=True) if k in reason), None)
        where, what = (f"iterate.trainer.args.{named}", "it") if named \
            else ("iterate.trainer.args", "them")
        raise TrainError(f"{where}: TRL's {config_cls.__name__} refuses {what}: {reason}"
                         ) from None


def run_trl(job, out: Path, echo) -> dict[str, Any]:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_utils import get_last_checkpoint

    torch.set_num_threads(max(1, job.threads))
    trainer_cls, config_cls = trainer_classes(job.train_on)
    config = make_config(config_cls, job.args, job.checkpoints, job.seed,
                         torch.cuda.is_available())
    data = load_dataset("parquet", data_files=job.data, split="train")
    if len(data) == 0:
        raise TrainError(f"round {job.round}: {job.data} has no rows to train on (every "
                         "prompt filtered out?); loosen output.filters or add prompts")
    # float32 on CPU (bf16 there is slow and lossy); the checkpoint's own dtype on a GPU.
    dtype = "auto" if torch.cuda.is_available() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(job.start, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(job.start)
    last = get_last_checkpoint(job.checkpoints)
    try:
        trainer = trainer_cls(model=model, args=config, train_dataset=data,
                              processing_class=tokenizer)
        echo(f"[specrej] round {job.round}: "
             + (f"resuming training from {Path(last).name}" if last else
                f"training {trainer_cls.__name__} on {len(data)} rows from the start"))
        result = trainer.train(resume_from_checkpoint=last)
    except ValueError as e:
        # TRL, transformers and torch check values as they meet them (an eval_strategy with
        # no eval set, a max_length that leaves no rows): the user's to fix, not to retry.
        raise TrainError(f"iterate.trainer: round {job.round}: TRL's {trainer_cls.__name__} "
                         f"refused to train: {first_line(e)}") from None
    # TRL turns the KV cache off to train (gradient checkpointing) and saves that: the
    # published model generates next, so it is saved ready to.
    trainer.model.config.use_cache = True
    trainer.save_model(str(out))
    trainer.processing_class.save_pretrained(str(out))
    return {"resumed_from": Path(last).name if last else None,
            "steps": trainer.state.global_step, "loss": result.training_loss}
