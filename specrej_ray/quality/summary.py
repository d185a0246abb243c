"""The short report printed at the end of a run."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from specrej_ray.data.dataset import locate, read_table
from specrej_ray.quality.audit import line as audit_line


def estimate_bon_tokens(candidates: list[dict]) -> int:
    """Tokens Best-of-N would have generated on the same candidates.

    Finished candidates count as they are. A rejected candidate would have run on; its
    length is estimated as the mean length of the same prompt's finished candidates that
    outlived its rejection point (at least its length so far). With candidate identity this
    is an estimate of a paired BoN run; `--set search.mode=bon` measures it exactly.
    """
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for c in candidates:
        by_prompt[c["prompt_id"]].append(c)
    total = 0
    for cands in by_prompt.values():
        finished = [c["num_tokens"] for c in cands if c["status"] == "finished"]
        for c in cands:
            n = c["num_tokens"]
            longer = [f for f in finished if f > n]
            total += n if c["status"] == "finished" or not longer else sum(longer) / len(longer)
    return round(total)


def print_summary(out: str | Path, info: dict, echo=print) -> None:
    """`out` is output.path as written (a local path or an fsspec URL)."""
    where = locate(out)
    best = read_table(where, "best.parquet").to_pylist()
    cands = read_table(where, "candidates.parquet").to_pylist()
    rewards = [r["reward"] for r in best if r["reward"] is not None]
    generated = sum(c["num_tokens"] for c in cands)
    discarded = sum(r.get("tokens_discarded") or 0 for r in best)
    spec = info["spec"]["search"]
    others = [f for f in info.get("files", []) if f != "best.parquet"]
    echo(f"\ndataset: {where.url_of('best.parquet')} (also {', '.join(others)}, run.json; "
         f"the card README.md: load_dataset({out!r}, 'preference'), docs/outputs.md)")
    echo(f"prompts: {len(best)} done, {info['skipped']} skipped (see errors.jsonl)")
    if rewards:
        echo(f"mean best reward: {sum(rewards) / len(rewards):.4f}")
    if spec["mode"] == "sbon" and cands:
        bon = estimate_bon_tokens(cands)
        echo(f"tokens generated: {decoded_line(generated, discarded)} vs ~{bon} for "
             f"Best-of-{spec['n']} on the same candidates (estimated; "
             f"{(generated + discarded) / max(bon, 1):.2f}x)")
    else:
        echo(f"tokens generated: {generated}")
    calibration = info.get("calibration")
    if calibration:
        echo(f"schedule auto, on {len(calibration['prompts'])} calibration prompts: "
             f"{calibration['reason']}; the other prompts ran with "
             f"{setting_line(calibration['run_with'])} ({calibration['how']})")
    line = reward_tokens_line(info.get("rewards") or [], generated + discarded)
    if line:
        echo(line)
    audit = info.get("audit") or {}
    if audit.get("off") is None and "verdict" in audit:
        echo(audit_line(audit, generated + discarded))
        if audit["verdict"] == "missed":
            echo(f"WARNING: the audited prompts' normalized score is below the target "
                 f"{audit['target']:g} with {audit['confidence']:.0%} confidence: rejection "
                 "is costing quality here; use schedule: auto, a later first decision or a "
                 "lower alpha (docs/calibration.md)")
    removed = _filter_line(info.get("filters", {}))
    if removed:
        echo(f"filters removed: {removed}")
    echo(f"wall-clock: {info['seconds']['total']:.1f}s")


def reward_tokens_line(rewards: list[dict], decoded: int) -> str:
    """'reward-model tokens: ll 0.41 per generated token (full re-scoring: 2.9)', for the
    model rewards that counted theirs."""
    parts = [f"{r['name']} {r['tokens'] / decoded:.2f} per generated token (full re-scoring: "
             f"{r['full_tokens'] / decoded:.2f}{'' if r['incremental'] else ', as run'})"
             for r in rewards if r.get("full_tokens") and decoded]
    return "reward-model tokens: " + "; ".join(parts) if parts else ""


def setting_line(run: dict) -> str:
    """'alpha 0.5 at [16, 32]', or 'Best-of-N' (alpha 0)."""
    return f"alpha {run['alpha']:g} at {run['schedule']}" if run["alpha"] else "Best-of-N"


def decoded_line(generated: int, discarded: int) -> str:
    """'1200', or '1200 + 40 decoded past decisions and discarded'."""
    if not discarded:
        return str(generated)
    return f"{generated} + {discarded} decoded past decisions and discarded"


def _filter_line(filters: dict) -> str:
    """'drop_truncated 3 candidates, min_margin 2 pairs', naming only filters that removed any."""
    parts = []
    for name, counts in filters.items():
        for key, unit in (("candidates_removed", "candidates"), ("pairs_removed", "pairs")):
            if counts.get(key):
                parts.append(f"{name} {counts[key]} {unit}")
    return ", ".join(parts)
