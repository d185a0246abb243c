"""The bench command's settings and its user errors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_N_LIST = (8, 16, 32, 64, 128)
DEFAULT_BATCHES = (16, 64)


class BenchError(Exception):
    """A user error in the bench command's options; str() is one line."""


@dataclass(frozen=True)
class BenchOptions:
    n_list: tuple[int, ...] = DEFAULT_N_LIST  # Best-of-N arms (the spec's n is added)
    prompts: int | None = None  # first K prompts; None = all after prompts.limit
    batches: tuple[int, ...] = DEFAULT_BATCHES  # of the throughput comparison and roofline
    out: Path | None = None  # None = bench/results/<spec name>
    throughput: bool = True
    roofline: bool = True
    command: str = "specrej-ray bench"  # as typed, for the report
    # schedule auto: calibrate on these prompts (held out from the bench) instead of the
    # bench's first calibration_prompts
    calibration: Path | None = None
    # generator backends whose arms run side by side (hf always: the main report is its)
    engines: tuple[str, ...] = ("hf",)

    def __post_init__(self) -> None:
        if self.prompts is not None and self.prompts < 1:
            raise BenchError(f"--prompts {self.prompts}: give a positive number of prompts")
        if not self.batches or min(self.batches) < 1:
            raise BenchError(f"--batch {self.batches}: give positive batch sizes, e.g. 16,64")
        unknown = [e for e in self.engines if e not in ("hf", "vllm")]
        if unknown or "hf" not in self.engines:
            raise BenchError(f"--engines {','.join(self.engines)}: give hf or hf,vllm (the hf "
                             "arms are the report's reference)")
        if "vllm" in self.engines:
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                raise BenchError("--engines vllm: vLLM is not installed here; pip install "
                                 "'specrej-ray[vllm]' (make setup installs it)")

    def out_dir(self, spec_name: str) -> Path:
        return self.out or Path("bench") / "results" / spec_name

    def bon_ns(self, spec_n: int) -> list[int]:
        """The Best-of-N arms: the list plus the spec's n, so SBoN has a paired BoN."""
        return sorted({*self.n_list, spec_n})


def parse_n_list(text: str, option: str = "--n-list", example: str = "8,16,32") -> tuple[int, ...]:
    """'8,16,32' -> (8, 16, 32); anything else is a one-line BenchError."""
    parts = [p.strip() for p in text.split(",")]
    try:
        ns = tuple(int(p) for p in parts)
    except ValueError:
        ns = ()
    if not ns or any(n < 1 for n in ns):
        raise BenchError(
            f"{option} {text!r}: expected comma-separated positive integers, e.g. {example}"
        )
    return ns
