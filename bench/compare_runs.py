"""Compare an SBoN run with a Best-of-N run of the same spec and seed (paired by candidate).

    python bench/compare_runs.py out/demo out/demo-bon

Prints tokens generated, the token rate, mean best rewards, the paper's normalized score
(eq. 5, per prompt, against BoN's own reward range) and checks candidate identity: every
finished SBoN candidate must have exactly the text of BoN's candidate with the same index,
and every rejected one must be a prefix of it.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from statistics import mean, median

import pyarrow.parquet as pq

from specrej_ray.search.metrics import normalized_score, token_rate


def load(out: str) -> tuple[dict[str, dict[int, dict]], dict[str, float]]:
    by_prompt: dict[str, dict[int, dict]] = defaultdict(dict)
    for c in pq.read_table(f"{out}/candidates.parquet").to_pylist():
        by_prompt[c["prompt_id"]][c["candidate"]] = c
    best = {r["id"]: r["reward"] for r in pq.read_table(f"{out}/best.parquet").to_pylist()}
    return by_prompt, best


def main(sbon_dir: str, bon_dir: str) -> None:
    sbon, sbon_best = load(sbon_dir)
    bon, bon_best = load(bon_dir)
    identical = prefixes = broken = 0
    for pid, cands in sbon.items():
        for k, c in cands.items():
            ref = bon[pid][k]["text"]
            if c["status"] == "finished":
                ok = c["text"] == ref
                identical += ok
            else:  # a cut-off text may end inside a multi-byte character: compare all but it
                ok = ref.startswith(c["text"][:-1])
                prefixes += ok
            broken += not ok
    tokens_s = sum(c["num_tokens"] for cands in sbon.values() for c in cands.values())
    tokens_b = sum(c["num_tokens"] for cands in bon.values() for c in cands.values())
    scores = [normalized_score([c["final_score"] for c in bon[pid].values()], sbon_best[pid])
              for pid in sbon_best]
    print(f"prompts: {len(sbon_best)}")
    print(f"tokens generated: SBoN {tokens_s}, BoN {tokens_b}, "
          f"token rate {token_rate(tokens_s, tokens_b):.3f}")
    print(f"mean best reward: SBoN {mean(sbon_best.values()):.4f}, "
          f"BoN {mean(bon_best.values()):.4f}")
    print(f"normalized score (eq. 5): mean {mean(scores):.1f}, median {median(scores):.1f}, "
          f"min {min(scores):.1f}")
    print(f"candidate identity: {identical} finished identical, {prefixes} rejected are prefixes, "
          f"{broken} mismatches")


if __name__ == "__main__":
    main(*sys.argv[1:3])
