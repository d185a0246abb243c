"""Compare an SBoN run with a Best-of-N run of the same spec and seed (paired by candidate).

    python bench/compare_runs.py out/demo out/demo-bon [--json bench/results/demo-compare.json]

Prints tokens generated (and discarded past decisions), the token rate, mean best rewards, the
paper's normalized score (eq. 6, per prompt, against Best-of-N's range on the same candidates),
each run's wall-clock from its run.json, and checks candidate identity: every finished SBoN
candidate must have exactly the text of BoN's candidate with the same index, and every
rejected one must be a prefix of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from statistics import mean, median

import pyarrow.parquet as pq

from specrej_ray.search.metrics import normalized_score, token_rate

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # bench/ importable; the package stays the environment's

from bench.results_io import save  # noqa: E402


def load(out: str) -> tuple[dict[str, dict[int, dict]], dict[str, dict], dict]:
    by_prompt: dict[str, dict[int, dict]] = defaultdict(dict)
    for c in pq.read_table(f"{out}/candidates.parquet").to_pylist():
        by_prompt[c["prompt_id"]][c["candidate"]] = c
    best = {r["id"]: r for r in pq.read_table(f"{out}/best.parquet").to_pylist()}
    return by_prompt, best, json.loads(Path(out, "run.json").read_text())


def compare(sbon_dir: str, bon_dir: str) -> dict:
    sbon, sbon_best, sbon_info = load(sbon_dir)
    bon, bon_best, bon_info = load(bon_dir)
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
    discarded = sum(r.get("tokens_discarded") or 0 for r in sbon_best.values())
    tokens_b = sum(c["num_tokens"] for cands in bon.values() for c in cands.values())
    scores = [normalized_score([c["final_score"] for c in bon[pid].values() if c["status"]
                                == "finished"], sbon_best[pid]["reward"])
              for pid in sbon_best]
    return {
        "prompts": len(sbon_best),
        "tokens": {"sbon": tokens_s, "sbon_discarded": discarded, "bon": tokens_b},
        "token_rate": token_rate(tokens_s + discarded, tokens_b),
        "mean_best_reward": {"sbon": mean(r["reward"] for r in sbon_best.values()),
                             "bon": mean(r["reward"] for r in bon_best.values())},
        "normalized_score_eq6": {"mean": mean(scores), "median": median(scores),
                                 "min": min(scores), "per_prompt": dict(zip(sbon_best, scores,
                                                                             strict=True))},
        "identity": {"finished_identical": identical, "rejected_prefixes": prefixes,
                     "mismatches": broken},
        "seconds": {"sbon": sbon_info["seconds"], "bon": bon_info["seconds"]},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sbon")
    ap.add_argument("bon")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    r = compare(args.sbon, args.bon)
    t, s, ns = r["tokens"], r["seconds"], r["normalized_score_eq6"]
    print(f"prompts: {r['prompts']}")
    print(f"tokens generated: SBoN {t['sbon']} (+{t['sbon_discarded']} discarded), "
          f"BoN {t['bon']}, token rate {r['token_rate']:.3f}")
    print(f"mean best reward: SBoN {r['mean_best_reward']['sbon']:.4f}, "
          f"BoN {r['mean_best_reward']['bon']:.4f}")
    print(f"normalized score (eq. 6): mean {ns['mean']:.1f}, median {ns['median']:.1f}, "
          f"min {ns['min']:.1f}")
    print(f"candidate identity: {r['identity']['finished_identical']} finished identical, "
          f"{r['identity']['rejected_prefixes']} rejected are prefixes, "
          f"{r['identity']['mismatches']} mismatches")
    print(f"wall-clock: SBoN {s['sbon']['total']:.1f} s (shards {s['sbon'].get('shards', 0):.1f}),"
          f" BoN {s['bon']['total']:.1f} s (shards {s['bon'].get('shards', 0):.1f})")
    save(args.json, r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
