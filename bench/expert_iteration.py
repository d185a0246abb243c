"""Expert iteration, measured: `specrej-ray iterate` for R rounds with SmolLM2-135M-Instruct as
the policy and the LM-likelihood reward under the fixed original model, then every round's
policy evaluated with plain Best-of-N on prompts it never trained on.

Per policy it reports the mean reward of all candidates, of the best, the mean response
length and distinct-2 (so a rise bought by short or repetitive text shows), next to the
round's generation and training wall-clock, and the paired bootstrap CI (over the evaluation
prompts) of the rise in mean candidate reward from round 0's policy.

    .venv/bin/python bench/expert_iteration.py --out /tmp/ei \\
        --json bench/results/expert-iteration/expert-iteration.json

Resumable: run it again with the same --out and finished rounds and evaluations are kept (the
iterate loop and each evaluation run resume from disk).

Prompts: training takes the 88 HH-RLHF prompts of bench/data that are not evaluated on plus
112 instruction prompts this script writes from templates (HH-RLHF has 100 in all); the
evaluation takes the first 12 of bench/data/hh_rlhf_bench.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from specrej_ray.quality.stats import bootstrap

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # bench/ importable; the package stays the environment's

from bench.results_io import save  # noqa: E402

DATA = REPO / "bench" / "data"
TOPICS = [
    "bake bread at home", "learn to play the guitar", "save money on groceries",
    "start running", "improve my sleep", "write a cover letter", "care for a houseplant",
    "prepare for a job interview", "clean a cast iron pan", "train a puppy",
    "plan a road trip", "learn a new language", "reduce stress at work", "make a budget",
    "grow tomatoes", "fix a flat bicycle tire", "make friends in a new city",
    "study for an exam", "start a vegetable garden", "make cold brew coffee",
    "organize my closet", "write a short story", "keep my phone battery healthy",
    "cook rice on the stove", "choose a laptop", "stay focused while working from home",
    "teach a child to ride a bike", "prepare for a marathon",
]
TEMPLATES = ["How do I {}?", "What are some tips to {}?",
             "Can you explain the first steps to {}?",
             "What mistakes should I avoid when I try to {}?"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompt_files(out: Path, n_eval: int, n_train: int) -> tuple[Path, Path]:
    bench = read_jsonl(DATA / "hh_rlhf_bench.jsonl")
    evaluate, rest = bench[:n_eval], bench[n_eval:] + read_jsonl(DATA / "hh_rlhf_tune.jsonl")
    made = [{"id": f"tpl-{i:03d}", "prompt": t.format(topic)}
            for i, (t, topic) in enumerate((t, x) for x in TOPICS for t in TEMPLATES)]
    train = (rest + made)[:n_train]
    if len(train) < n_train:
        raise SystemExit(f"only {len(train)} training prompts to be had; lower --train-prompts")
    return write_jsonl(out / "train.jsonl", train), write_jsonl(out / "eval.jsonl", evaluate)


def iterate_spec(args, train: Path) -> dict:
    return {
        "name": "expert-iteration", "seed": 0,
        "prompts": {"path": str(train), "id_field": "id"},
        "generator": {"model": args.model,
                      "sampling": {"temperature": 0.8, "top_p": 0.95,
                                   "max_new_tokens": args.max_new_tokens}},
        "reward": {"type": "lm_likelihood", "model": args.model, "batch_size": 32},
        "search": {"mode": "sbon", "n": args.n_train, "alpha": 0.5,
                   "schedule": {"tokens": [args.max_new_tokens // 4, args.max_new_tokens // 2]}},
        "cluster": {"shard_size": 20},
        "output": {"path": str(args.out / "iterate"), "formats": ["sft"]},
        "iterate": {"rounds": args.rounds, "train_on": "sft", "train_from": "previous",
                    "trainer": {"type": "trl", "num_cpus": os.cpu_count() or 1,
                                "args": {"num_train_epochs": 1, "learning_rate": args.lr,
                                         "per_device_train_batch_size": 8,
                                         "max_length": 256, "save_steps": 10}}},
    }


def eval_spec(args, evaluate: Path, policy: str, out: Path) -> dict:
    """Plain Best-of-N with the policy: every candidate finishes and is scored by the fixed
    original model, so the mean over all candidates is the policy's own reward."""
    return {
        "name": f"ei-eval-{out.name}", "seed": 1,
        "prompts": {"path": str(evaluate), "id_field": "id"},
        "generator": {"model": policy,
                      "sampling": {"temperature": 0.8, "top_p": 0.95,
                                   "max_new_tokens": args.max_new_tokens}},
        "reward": {"type": "lm_likelihood", "model": args.model, "batch_size": 32},
        "search": {"mode": "bon", "n": args.n_eval},
        "cluster": {"shard_size": 4},
        "output": {"path": str(out), "if_exists": "resume"},
    }


def run_cli(command: str, spec: dict, path: Path, log: Path) -> float:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    t0 = time.time()
    with log.open("ab") as fh:
        rc = subprocess.run([str(REPO / ".venv/bin/specrej-ray"), command, str(path)],
                            stdout=fh, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if rc != 0:
        raise SystemExit(f"specrej-ray {command} {path} exited {rc}; see {log}")
    return time.time() - t0


def distinct_2(texts: list[str]) -> float:
    """Distinct bigrams over all bigrams of the texts (whitespace words)."""
    grams = [tuple(w[i:i + 2]) for w in (t.split() for t in texts) for i in range(len(w) - 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def evaluate(out: Path) -> dict:
    cands = pq.read_table(out / "candidates.parquet",
                          columns=["prompt_id", "text", "final_score", "num_tokens",
                                   "finish_reason"]).to_pylist()
    by_prompt: dict[str, list[dict]] = {}
    for c in cands:
        by_prompt.setdefault(c["prompt_id"], []).append(c)
    per_prompt = {pid: {"mean": sum(c["final_score"] for c in cs) / len(cs),
                        "best": max(c["final_score"] for c in cs),
                        "tokens": sum(c["num_tokens"] for c in cs) / len(cs),
                        "distinct_2": distinct_2([c["text"] for c in cs])}
                  for pid, cs in sorted(by_prompt.items())}
    avg = {k: sum(p[k] for p in per_prompt.values()) / len(per_prompt)
           for k in ("mean", "best", "tokens", "distinct_2")}
    # At one length: candidates that ran to max_new_tokens, so a rise here is not shortness.
    capped = [c["final_score"] for c in cands if c["finish_reason"] == "length"]
    return {"prompts": len(per_prompt), "candidates": len(cands),
            "length_capped_share": len(capped) / len(cands),
            "mean_length_capped_reward": sum(capped) / len(capped) if capped else None,
            "mean_candidate_reward": avg["mean"], "mean_best_reward": avg["best"],
            "mean_response_tokens": avg["tokens"], "distinct_2": avg["distinct_2"],
            "per_prompt": per_prompt}


def rise(base: dict, other: dict, key: str) -> dict:
    """Paired bootstrap over prompts of other - base."""
    diffs = [other["per_prompt"][p][key] - base["per_prompt"][p][key] for p in base["per_prompt"]]
    return bootstrap(diffs).as_dict()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="work directory (resumable)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--train-prompts", type=int, default=200)
    ap.add_argument("--eval-prompts", type=int, default=12)
    ap.add_argument("--n-train", type=int, default=8, help="N of the training rounds (SBoN)")
    ap.add_argument("--n-eval", type=int, default=16, help="N of the evaluation (Best-of-N)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-5)
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "bench.log"
    train, evaluate_file = prompt_files(args.out, args.eval_prompts, args.train_prompts)

    t_iterate = run_cli("iterate", iterate_spec(args, train), args.out / "iterate.yaml", log)
    record = json.loads((args.out / "iterate" / "iterate.json").read_text())
    policies = [("round 0 (base)", record["base"]["path"], None)]
    policies += [(f"round {x['round'] + 1} (trained in round {x['round']})",
                  x["model"]["path"], x) for x in record["rounds"]]
    rows = []
    for k, (label, path, made) in enumerate(policies):
        out = args.out / f"eval-{k}"
        secs = run_cli("run", eval_spec(args, evaluate_file, path, out),
                       args.out / f"eval-{k}.yaml", log)
        # Round k generated with this policy and trained the next one.
        this = record["rounds"][k] if k < len(record["rounds"]) else None
        rows.append({"policy": label, "path": path, "eval_seconds": secs,
                     "weights_sha256": (made or {}).get("model", {}).get("sha256")
                     or record["base"]["sha256"],
                     "round_generation_seconds": this and this["generation"]["seconds"],
                     "round_mean_best_reward": this and this["generation"]["mean_best_reward"],
                     "round_training_seconds": this and this["training"]["seconds"],
                     "round_training_loss": this and this["training"]["loss"],
                     **evaluate(out)})
    base = rows[0]
    for r in rows[1:]:
        r["rise_mean_candidate_reward"] = rise(base, r, "mean")
        r["rise_mean_best_reward"] = rise(base, r, "best")
    report = {"args": {k: str(v) for k, v in vars(args).items()},
              "iterate_seconds": t_iterate, "policies": rows}
    print_table(rows)
    save(args.json, report)
    return 0


def print_table(rows: list[dict]) -> None:
    print("policy                           cand reward  best reward  tokens  distinct-2  "
          "capped: share reward  rise of cand reward vs round 0 [95% CI]   "
          "round's gen s  train s")
    for r in rows:
        ci = r.get("rise_mean_candidate_reward")
        rise_s = f"{ci['value']:+.4f} [{ci['low']:+.4f}, {ci['high']:+.4f}]" if ci else "-"
        gen = r["round_generation_seconds"]
        train = r["round_training_seconds"]
        print(f"{r['policy']:<32} {r['mean_candidate_reward']:>11.4f}  "
              f"{r['mean_best_reward']:>11.4f}  {r['mean_response_tokens']:>6.1f}  "
              f"{r['distinct_2']:>10.3f}  {r['length_capped_share']:>13.2f} "
              f"{r['mean_length_capped_reward']:>7.4f}  {rise_s:<39}  "
              f"{'-' if gen is None else f'{gen:.0f}':>13}  "
              f"{'-' if train is None else f'{train:.0f}':>7}")


if __name__ == "__main__":
    sys.exit(main())
