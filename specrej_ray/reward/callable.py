"""A user's Python function as the reward: `module:function(prompts, responses)`."""

from __future__ import annotations

import importlib
import numbers
import os
import sys
from collections.abc import Callable
from typing import Any

from specrej_ray.reward.base import RewardError, check_pairs


def import_function(ref: str) -> Callable[..., Any]:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise RewardError(f"reward.function {ref!r} must be 'module:function'")
    module = _import_module(ref, module_name)
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise RewardError(
                f"reward.function {ref!r}: module {module_name} has no attribute {attr!r}; "
                "check the function name"
            )
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardError(
            f"reward.function {ref!r}: {attr} is a {type(fn).__name__}, not a function; "
            "point it at a function(prompts, responses)"
        )
    return fn


def _import_module(ref: str, module_name: str) -> Any:
    for attempt in range(2):
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            missing_self = e.name is not None and (module_name + ".").startswith(e.name + ".")
            cwd = os.getcwd()
            # A reward file next to the job is the common case; `python -m` would find it.
            if attempt == 0 and missing_self and cwd not in sys.path:
                sys.path.append(cwd)
                importlib.invalidate_caches()
                continue
            if missing_self:
                raise RewardError(
                    f"reward.function {ref!r}: module {module_name} not found; put "
                    f"{module_name.replace('.', '/')}.py in the current directory or install it"
                ) from None
            raise RewardError(
                f"reward.function {ref!r}: importing {module_name} failed: module {e.name} "
                "not found; install it"
            ) from None
        except Exception as e:
            raise RewardError(
                f"reward.function {ref!r}: importing {module_name} failed "
                f"({type(e).__name__}: {_first_line(e)}); fix the module"
            ) from None
    raise AssertionError("unreachable")


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else ""


class CallableReward:
    def __init__(self, ref: str) -> None:
        self.ref, self.name = ref, f"callable({ref})"
        self.fn = import_function(ref)

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        check_pairs(self.name, prompts, responses)
        out = self.fn(list(prompts), list(responses))
        return to_floats(self.ref, out, len(prompts))


def to_floats(ref: str, out: Any, n: int) -> list[float]:
    """Check the function's result is n numbers; numpy / torch arrays are accepted."""
    if hasattr(out, "tolist"):
        out = out.tolist()
    if isinstance(out, str | bytes) or not hasattr(out, "__len__"):
        raise RewardError(
            f"reward.function {ref!r} returned {type(out).__name__}; "
            f"return a list of {n} numbers, one per response"
        )
    if len(out) != n:
        raise RewardError(
            f"reward.function {ref!r} returned {len(out)} scores for {n} responses; "
            "return one number per response"
        )
    scores = []
    for i, x in enumerate(out):
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise RewardError(
                f"reward.function {ref!r} returned {type(x).__name__} {x!r:.40} at index {i}; "
                "return numbers"
            )
        scores.append(float(x))
    return scores
