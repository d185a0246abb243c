"""Training files derived from a run's records: SFT, preference pairs and top-k, after filters.

Pure: rows in (the `best` rows for prompts, the `candidates` rows), rows out. The formats are
TRL's conversational ones: `messages` for SFTTrainer's language-modeling type, `prompt` /
`completion` for its prompt-completion type, `prompt` / `chosen` / `rejected` for DPOTrainer.
Each SFT type gets its own file because TRL picks the dataset type from the columns present.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from specrej_ray.search.bounds import Keep
from specrej_ray.spec import FiltersSpec, JobSpec, OutputSpec

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
# Every row of every file says what produced it: generator, reward and the spec's fingerprint.
# (`reward_model`, since `reward` is already the score column of best.parquet.)
PROVENANCE = [
    ("generator", pa.string()),
    ("reward_model", pa.string()),
    ("fingerprint", pa.string()),
]

SCHEMAS: dict[str, pa.Schema] = {
    "sft_messages": pa.schema(
        [
            ("id", pa.string()),
            ("messages", MESSAGES),
            ("reward", pa.float64()),
            ("candidate", pa.int64()),
            *PROVENANCE,
        ]
    ),
    "sft_prompt_completion": pa.schema(
        [
            ("id", pa.string()),
            ("prompt", MESSAGES),
            ("completion", MESSAGES),
            ("reward", pa.float64()),
            ("candidate", pa.int64()),
            *PROVENANCE,
        ]
    ),
    "preference": pa.schema(
        [
            ("id", pa.string()),
            ("prompt", MESSAGES),
            ("chosen", MESSAGES),
            ("rejected", MESSAGES),
            ("chosen_reward", pa.float64()),
            ("rejected_reward", pa.float64()),
            ("margin", pa.float64()),
            ("chosen_candidate", pa.int64()),
            ("rejected_candidate", pa.int64()),
            *PROVENANCE,
        ]
    ),
    "top_k": pa.schema(
        [
            ("id", pa.string()),
            ("rank", pa.int64()),
            ("candidate", pa.int64()),
            ("system", pa.string()),
            ("prompt", pa.string()),
            ("response", pa.string()),
            ("reward", pa.float64()),
            ("finish_reason", pa.string()),
            ("num_tokens", pa.int64()),
            *PROVENANCE,
        ]
    ),
}
# The files each `output.formats` entry writes.
FILES: dict[str, list[str]] = {
    "sft": ["sft_messages", "sft_prompt_completion"],
    "preference": ["preference"],
    "top_k": ["top_k"],
}
# Candidates a prompt needs for a row: one for SFT and top-k, two for a pair.
_NEEDS = {"sft": 1, "preference": 2, "top_k": 1}
CANDIDATE_FILTERS = ("drop_truncated", "min_reward", "dedupe")
# The candidate columns derive reads (callers may pass rows of these alone).
CANDIDATE_FIELDS = ["prompt_id", "candidate", "status", "finish_reason", "text", "num_tokens",
                    "final_score"]


@dataclass
class Derived:
    files: dict[str, list[dict[str, Any]]]  # file stem -> rows, for the formats asked for
    filters: dict[str, Any] = field(default_factory=dict)  # what each filter removed


def provenance(spec: JobSpec) -> dict[str, str]:
    """Columns every output row carries: which generator, reward and spec produced it."""
    return {
        "generator": spec.generator.model,
        "reward_model": spec.reward_label,
        "fingerprint": spec.fingerprint(),
    }


def prompt_turns(row: dict[str, Any]) -> list[dict[str, str]]:
    """[system], user: the conversational prompt of a `best` row."""
    turns = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return turns + [{"role": "user", "content": row["prompt"]}]


def assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def ranked(cands: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Best first; ties go to the lower candidate index, as the engine's choice of best does."""
    return sorted(cands, key=lambda c: (-c["final_score"], c["candidate"]))


def kept_by(output: OutputSpec) -> Keep:
    """What the files keep of a prompt's candidates, for pruning from bounds: the best (the
    SFT files, best.parquet, a pair's chosen side), or the `top_k` best, after the filters.
    A pair's rejected side is not kept from pruning: it is the worst that finished."""
    f = output.filters
    top = output.top_k if "top_k" in output.formats else 1
    return Keep(top, f.drop_truncated, f.min_reward, f.dedupe)


def filter_candidates(
    cands: list[dict[str, Any]], f: FiltersSpec
) -> tuple[list[dict[str, Any]], list[int]]:
    """One prompt's finished candidates after the filters, and how many were left after each
    filter (in CANDIDATE_FILTERS order), so a caller can tell which filter emptied a prompt.

    drop_truncated comes before dedupe so that a text that both hit the length limit and
    ended properly is kept in its proper form.
    """
    kept = [c for c in cands if c["status"] == "finished" and c["final_score"] is not None]
    left = []
    if f.drop_truncated:
        kept = [c for c in kept if c["finish_reason"] != "length"]
    left.append(len(kept))
    if f.min_reward is not None:
        kept = [c for c in kept if c["final_score"] >= f.min_reward]
    left.append(len(kept))
    if f.dedupe:
        first: dict[str, dict[str, Any]] = {}
        for c in sorted(kept, key=lambda c: c["candidate"]):
            first.setdefault(c["text"], c)
        kept = list(first.values())
    left.append(len(kept))
    return kept, left


def pairs(
    kept: list[dict[str, Any]], mode: str, k: int | None
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(chosen, rejected) pairs: the best vs the worst, or vs each of up to k others taken
    lowest reward first (so the widest margins come first; k = None takes every other)."""
    if len(kept) < 2:
        return []
    order = ranked(kept)
    best, others = order[0], order[:0:-1]  # others: worst first
    if mode == "best_vs_worst":
        return [(best, others[0])]
    return [(best, o) for o in (others if k is None else others[:k])]


def sft_rows(p: dict[str, Any], best: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    common = {"id": p["id"], "reward": best["final_score"], "candidate": best["candidate"]}
    return {
        "sft_messages": [{**common, "messages": prompt_turns(p) + assistant(best["text"])}],
        "sft_prompt_completion": [
            {**common, "prompt": prompt_turns(p), "completion": assistant(best["text"])}
        ],
    }


def pair_row(p: dict[str, Any], chosen: dict[str, Any], rejected: dict[str, Any]) -> dict:
    return {
        "id": p["id"],
        "prompt": prompt_turns(p),
        "chosen": assistant(chosen["text"]),
        "rejected": assistant(rejected["text"]),
        "chosen_reward": chosen["final_score"],
        "rejected_reward": rejected["final_score"],
        "margin": chosen["final_score"] - rejected["final_score"],
        "chosen_candidate": chosen["candidate"],
        "rejected_candidate": rejected["candidate"],
    }


def top_k_rows(p: dict[str, Any], kept: list[dict[str, Any]], k: int) -> list[dict]:
    return [
        {
            "id": p["id"],
            "rank": rank,
            "candidate": c["candidate"],
            "system": p.get("system"),
            "prompt": p["prompt"],
            "response": c["text"],
            "reward": c["final_score"],
            "finish_reason": c["finish_reason"],
            "num_tokens": c["num_tokens"],
        }
        for rank, c in enumerate(ranked(kept)[:k], start=1)
    ]


def derive(
    prompts: list[dict[str, Any]],
    candidates: list[dict[str, Any]],
    output: OutputSpec,
    prov: dict[str, str],
) -> Derived:
    """Rows of every file `output.formats` asks for, in prompt order, and the filter counts."""
    by_prompt: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in candidates:
        by_prompt[c["prompt_id"]].append(c)
    formats = list(output.formats)
    files: dict[str, list[dict[str, Any]]] = {name: [] for f in formats for name in FILES[f]}
    counts = _empty_counts(formats)
    with_row = dict.fromkeys(formats, 0)
    for p in prompts:
        finished = [c for c in by_prompt[p["id"]] if c["status"] == "finished"]
        kept, left = filter_candidates(finished, output.filters)
        _count_candidate_filters(counts, formats, len(finished), left)
        if "sft" in formats and kept:
            for name, rows in sft_rows(p, ranked(kept)[0]).items():
                files[name] += rows
            with_row["sft"] += 1
        if "top_k" in formats and kept:
            files["top_k"] += top_k_rows(p, kept, output.top_k)
            with_row["top_k"] += 1
        if "preference" in formats:
            rows = [pair_row(p, a, b) for a, b in pairs(kept, output.pairs, output.pairs_k)]
            margin = output.filters.min_margin
            good = rows if margin is None else [r for r in rows if r["margin"] >= margin]
            counts["min_margin"]["pairs_removed"] += len(rows) - len(good)
            counts["min_margin"]["prompts_without_row"]["preference"] += bool(rows) and not good
            files["preference"] += good
            with_row["preference"] += bool(good)
    for f in formats:
        counts["prompts_without_row"][f] = len(prompts) - with_row[f]
    for name, rows in files.items():
        files[name] = [{**r, **prov} for r in rows]
    return Derived(files, counts)


def _empty_counts(formats: list[str]) -> dict[str, Any]:
    counts: dict[str, Any] = {
        name: {"candidates_removed": 0, "prompts_without_row": dict.fromkeys(formats, 0)}
        for name in CANDIDATE_FILTERS
    }
    counts["min_margin"] = {
        "pairs_removed": 0,
        "prompts_without_row": {"preference": 0} if "preference" in formats else {},
    }
    counts["prompts_without_row"] = dict.fromkeys(formats, 0)
    return counts


def _count_candidate_filters(
    counts: dict[str, Any], formats: list[str], before: int, left: list[int]
) -> None:
    """Charge each filter with the candidates it removed and the rows it cost: a prompt loses
    a format's row to the filter that took it below what the format needs."""
    for name, after in zip(CANDIDATE_FILTERS, left, strict=True):
        counts[name]["candidates_removed"] += before - after
        for f in formats:
            counts[name]["prompts_without_row"][f] += before >= _NEEDS[f] > after
        before = after
