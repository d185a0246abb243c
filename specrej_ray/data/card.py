"""The dataset card: README.md at output.path, so the output is a Hugging Face dataset.

Its front matter lists one `configs:` entry per parquet file the run wrote (`datasets`
reads them on a local directory and on the Hub: `load_dataset(out, "preference")`); its body
says what made the data, from run.json's facts. Pure: run.json's dict in, text out.
"""

from __future__ import annotations

from typing import Any

import yaml

CARD = "README.md"
# Where the card goes while README.md is not as we wrote it (the user's, or edited): theirs
# stays, ours is beside it (docs/outputs.md, "Your own README.md").
CARD_ASIDE = "README.specrej.md"
DEFAULT_CONFIG = "best"
# Config order: the main file first (datasets infers the builder from the first config's
# files), the training files, then every candidate.
_ORDER = ["best", "sft_messages", "sft_prompt_completion", "preference", "top_k", "candidates"]
_ABOUT = {
    "best": "the highest-reward response of every prompt",
    "sft_messages": "TRL SFT, conversational `messages`",
    "sft_prompt_completion": "TRL SFT, `prompt` / `completion` (loss on the completion)",
    "preference": "TRL DPO, `prompt` / `chosen` / `rejected`",
    "top_k": "the k best responses of every prompt, ranked",
    "candidates": "every candidate, finished or rejected, with its scores",
}


def configs(files: list[str], tables: dict[str, dict[str, Any]] | None = None
            ) -> list[dict[str, Any]]:
    """One `configs:` entry per parquet file written (jsonl copies are not configs: one
    builder for all), the main one marked default. With `tables`, each entry's description
    names its file's content digest: `datasets` caches a local directory under a hash of
    its card (the configs included), not of its files, so a card that stayed the same over
    changed files would load the rows it cached before (two runs of one shape in
    directories of one name did: same row counts, same byte sizes). A file `tables` counts
    no rows of is no config: `datasets` cannot load an empty Parquet split."""
    tables = tables or {}
    none = empty(tables)
    stems = [stem for stem in _stems(files) if stem not in none]
    ordered = [s for s in _ORDER if s in stems] + sorted(s for s in stems if s not in _ORDER)
    out = []
    for stem in ordered:
        entry: dict[str, Any] = {"config_name": stem,
                                 "data_files": [{"split": "train", "path": f"{stem}.parquet"}]}
        if stem == DEFAULT_CONFIG:
            entry["default"] = True
        if stem in tables:
            entry["description"] = f"{_ABOUT.get(stem, stem)}; content {tables[stem]['digest']}"
        out.append(entry)
    return out


def dataset_info(tables: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The card's `dataset_info:`, each config's rows and bytes (`datasets` checks the row
    counts as it reads, and the Hub shows the sizes)."""
    return [{"config_name": stem, "splits": [{"name": "train", "num_bytes": t["bytes"],
                                              "num_examples": t["rows"]}],
             "download_size": t["file_bytes"], "dataset_size": t["bytes"]}
            for stem, t in sorted(tables.items()) if t["rows"]]


def empty(tables: dict[str, dict[str, Any]] | None) -> list[str]:
    """The parquet files (stems) without a row, left off the configs: `datasets` 5 fails on
    them ("Instruction "train" corresponds to no data!"), so a card that listed one would
    promise a config that does not load (a run stopped early, no preference pair yet)."""
    return sorted(stem for stem, t in (tables or {}).items() if not t["rows"])


def _stems(files: list[str]) -> list[str]:
    return [f.removesuffix(".parquet") for f in files if f.endswith(".parquet")]


def card_text(info: dict[str, Any], tables: dict[str, dict[str, Any]] | None = None) -> str:
    """README.md for a run whose run.json is `info`; `tables`: each parquet file's stem to
    its rows, bytes (uncompressed), file_bytes and digest, as `OutputDir.table_stats` reads
    them."""
    sizes = dataset_info(tables or {})
    front = {
        "configs": configs(info.get("files", []), tables),
        **({"dataset_info": sizes} if sizes else {}),
        "tags": ["specrej-ray", "best-of-n", "speculative-rejection", "synthetic"],
        "task_categories": ["text-generation"],
        "pretty_name": info.get("name", "specrej-ray run"),
    }
    head = "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n"
    return head + "\n".join(_body(info, tables)) + "\n"


def _body(info: dict[str, Any], tables: dict[str, dict[str, Any]] | None) -> list[str]:
    spec = info.get("spec", {})
    search = spec.get("search", {})
    listed = [c["config_name"] for c in configs(info.get("files", []), tables)]
    lines = [f"# {info.get('name', 'specrej-ray run')}", "",
             f"Best-of-{search.get('n')} data made by specrej-ray ({_method(search)}). "
             f"Spec fingerprint `{info.get('fingerprint')}`; the whole spec and every figure "
             "are in `run.json`.", "", "## Load it", ""] + _load_it(listed)
    lines += ["| config | holds |", "| --- | --- |"]
    lines += [f"| `{name}` | {_ABOUT.get(name, '')} |" for name in listed]
    if none := empty(tables):
        lines += ["", "No rows, so not a config (`datasets` cannot load an empty split): "
                  + ", ".join(f"`{stem}.parquet`" for stem in none) + "."]
    lines += ["", "## What made it", ""]
    lines += _models(info)
    lines += _search(info)
    lines += ["", "## The run", ""] + _counts(info) + _audit(info)
    lines += ["", "## Reproduce", "", "```sh", info.get("command")
              or "specrej-ray run SPEC.yaml  # the spec is run.json's `spec`", "```"]
    return lines


def _load_it(listed: list[str]) -> list[str]:
    """The loading example, naming only configs the card lists (each one loads)."""
    if not listed:
        return ["No file has rows yet: there is nothing to load.", ""]
    example = {"best": 'best = load_dataset("path/to/this/dir")  # the default config: best',
               "preference": 'pairs = load_dataset("path/to/this/dir", "preference")'}
    shown = [example[name] for name in example if name in listed]
    return ["```python", "from datasets import load_dataset", "", *shown, "```", ""]


def _method(search: dict[str, Any]) -> str:
    if search.get("mode") == "bon":
        return "plain Best-of-N"
    return "Speculative Rejection: partial responses scored, the lowest stopped early"


def _model_line(role: str, m: dict[str, Any]) -> str:
    ident = (f"revision `{m['revision']}`" if m.get("revision") else
             f"weights sha256 `{m['sha256'][:16]}`" if m.get("sha256") else "not hashed")
    return f"- {role}: `{m.get('model')}` ({ident})"


def _models(info: dict[str, Any]) -> list[str]:
    models = info.get("models") or {}
    lines = []
    if models.get("generator"):
        lines.append(_model_line("generator", models["generator"]))
    for i, m in enumerate(models.get("rewards", [])):
        lines.append(_model_line(f"reward {i}" if len(models["rewards"]) > 1 else "reward", m))
    policy = info.get("policy")
    if policy:
        came = ("the base model" if policy.get("from_round") is None
                else f"the model trained in round {policy['from_round']}")
        lines.append(f"- expert iteration round {policy.get('round')}: the generator is "
                     f"{came}, `{policy.get('path')}`")
    return lines


def _search(info: dict[str, Any]) -> list[str]:
    s = info.get("spec", {}).get("search", {})
    sampling = info.get("spec", {}).get("generator", {}).get("sampling", {})
    lines = [f"- N = {s.get('n')}, mode {s.get('mode')}, alpha {s.get('alpha')}, "
             f"schedule {_schedule(s.get('schedule'))}",
             f"- sampling: temperature {sampling.get('temperature')}, top_p "
             f"{sampling.get('top_p')}, at most {sampling.get('max_new_tokens')} new tokens"]
    cal = info.get("calibration")
    if cal and cal.get("run_with"):
        lines.append(f"- schedule auto chose {_schedule(cal['run_with'])} on "
                     f"{len(cal.get('prompts', []))} calibration prompts ({cal.get('reason')})")
    return lines


def _schedule(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


def _counts(info: dict[str, Any]) -> list[str]:
    counts = info.get("counts", {})
    failed = sum(len(f.get("prompt_ids") or []) for f in info.get("failed_shards", []))
    tokens = (counts.get("tokens_generated") or 0) + (counts.get("tokens_discarded") or 0)
    seconds = info.get("seconds", {})
    busy = seconds.get("shards") or seconds.get("generate") or 0.0
    rate = f"{tokens / busy:.0f} tokens/s while generating" if busy else "no generation timed"
    return [f"- prompts: {counts.get('prompts', 0)} done, {failed} failed, "
            f"{info.get('skipped', 0)} skipped (see `errors.jsonl`)",
            f"- tokens decoded: {tokens} ({counts.get('tokens_discarded') or 0} by rejected "
            f"candidates after their rejection), {rate}",
            f"- wall-clock: {seconds.get('total', 0.0):.0f} s this invocation, "
            f"{info.get('seconds_all_invocations', 0.0):.0f} s over "
            f"{len(info.get('invocations', []))} invocation(s)"]


def _audit(info: dict[str, Any]) -> list[str]:
    audit = info.get("audit") or {}
    if audit.get("off") is not None:
        return [f"- quality audit: off ({audit['off']})"]
    if not audit.get("prompts"):
        return ["- quality audit: none ran (no prompt drawn; search.audit_fraction)"]
    if audit.get("score") is None:
        return [f"- quality audit: {audit['prompts']} prompt(s) audited, too few for a score"]
    return [f"- quality audit (eq. 6 normalized score against Best-of-N on "
            f"{audit.get('scored')} shadow-run prompts): {audit['score']:.1f} "
            f"[{audit.get('low'):.1f}, {audit.get('high'):.1f}] at "
            f"{audit.get('confidence', 0.95):.0%}, target {audit.get('target')}: "
            f"{audit.get('verdict')}"]
