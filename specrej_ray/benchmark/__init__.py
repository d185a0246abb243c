"""`specrej-ray bench`: SBoN against Best-of-N on one machine, same engine, prompts and seeds.

Modules, one idea each: run (the command), options (its settings and user errors), arms (the
timed runs of each arm), quality (per-prompt scores, identity, speedups, matched reward: pure),
hardware (this machine, its roofline, the engine against model.generate), report (the figures
and targets as one dict) and render (markdown and plot). Nothing here imports torch at import
time, so the CLI stays fast.
"""

from specrej_ray.benchmark.options import BenchError, BenchOptions, parse_n_list

__all__ = ["BenchError", "BenchOptions", "parse_n_list"]
