"""`specrej-ray bench`: SBoN against Best-of-N on one machine, same engine, prompts and seeds.

Modules, one idea each: run (the command), options (its settings), arms (timed runs of
each arm), scores (per-prompt rewards and the paired normalized score), matched (speedup
at matched reward), throughput (engine vs `model.generate`), roofline (this machine's
limits), timing, machine (what ran it), targets, markdown, plot and report (the files).
Nothing here imports torch at import time, so the CLI stays fast.
"""

from specrej_ray.benchmark.options import BenchError, BenchOptions, parse_n_list

__all__ = ["BenchError", "BenchOptions", "parse_n_list"]
