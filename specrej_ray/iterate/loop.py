"""The expert-iteration loop: generate with the policy, train on the round's best, repeat.

Resumable at every point, from what is on disk: a round whose dataset is complete for its
policy is not generated again (a cut-short one resumes its shards), a published model is not
trained again (a cut-short training resumes from its last checkpoint), and iterate.json
records each step as it finishes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq

from specrej_ray.data.dataset import locate, read_run_info, write_atomic
from specrej_ray.data.output_guard import LOCKS, is_temp
from specrej_ray.data.output_lock import take_lock
from specrej_ray.errors import OutputError, TrainError
from specrej_ray.iterate.evaluation import Evaluations, summary_lines
from specrej_ray.iterate.rounds import (
    STATE,
    checkpoint_dir,
    loop_fingerprint,
    model_dir,
    round_spec,
    train_file,
)
from specrej_ray.job.interrupt import Interrupt
from specrej_ray.models.identity import describe_model, weights_sha256
from specrej_ray.spec import JobSpec
from specrej_ray.spec.iterate import TrainerSpec
from specrej_ray.train import TrainJob, read_stamp, remove_leftovers

FORMAT = "specrej-ray-iterate"


def run_iterate(spec: JobSpec, stop: Interrupt | None = None, echo=print,
                command: str | None = None) -> dict[str, Any]:
    """Every round of spec.iterate; returns iterate.json's record."""
    stop = stop or Interrupt()
    root = _local_root(spec.output.path)
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    try:
        lock = take_lock(locate(str(root)), spec.name, echo)
    except BaseException:
        if created:
            root.rmdir()
        raise
    with lock:
        return Loop(spec, root, stop, echo, command).run()


class Loop:
    def __init__(self, spec: JobSpec, root: Path, stop: Interrupt, echo, command: str | None):
        assert spec.iterate is not None
        self.spec, self.it, self.root, self.stop, self.echo = spec, spec.iterate, root, stop, echo
        self.record = _open_record(root, loop_fingerprint(spec))
        self.record["command"] = command or self.record.get("command")

    def run(self) -> dict[str, Any]:
        from specrej_ray.job.prepare import resolve_generator

        check_trainer(self.it.trainer, self.it.train_on)
        base_path = resolve_generator(self.spec)
        base = {**describe_model(self.spec.generator.model, base_path,
                                 self.spec.generator.revision), "path": base_path}
        base["sha256"] = base["sha256"] or weights_sha256(base_path)
        self.record["base"] = base
        # Written before round 0 starts: a loop cut short is then resumed, not refused.
        _write_json(self.root / STATE, self.record)
        evaluations = self._evaluations()  # its prompts are read now: a bad file fails first
        self._remove_leftovers()
        self._connect()
        if evaluations is not None:
            self._evaluate(evaluations, 0, base["path"], base["sha256"])
        for r in range(self.it.rounds):
            self.stop.check()
            policy = self._policy(r, base)
            gen = self._generate(r, policy)
            trained = self._train(r, policy, base)
            self._save_round(r, policy, gen, trained)
            if evaluations is not None:
                self._evaluate(evaluations, r + 1, model_dir(str(self.root), r),
                               trained["sha256"])
        self._remove_leftovers()  # a training task restarted in this run left its own
        self.echo(summary_table(self.record))
        return self.record

    def _remove_leftovers(self) -> None:
        """The temporary model folders of trainings cut short (a killed worker never renames
        or removes its own). Safe here: the output lock keeps out any other loop, and no
        training task of this one is running before the rounds or after them."""
        left = [p for r in range(self.it.rounds)
                for p in remove_leftovers(model_dir(str(self.root), r))]
        if left:
            self.echo(f"[specrej] removed {len(left)} temporary model folder(s) left by "
                      f"trainings cut short: {', '.join(str(p) for p in left)}")

    # --- the steps ---

    def _evaluations(self) -> Evaluations | None:
        if self.it.evaluate is None:
            return None
        return Evaluations(self.spec, self.root, self.record, self.echo)

    def _evaluate(self, evaluations: Evaluations, r: int, path: str, sha256: str) -> None:
        """Round r's policy evaluated (iterate.evaluate), recorded as soon as it is."""
        self.stop.check()
        evaluations.policy(r, path, sha256)
        _write_json(self.root / STATE, self.record)

    def _connect(self) -> None:
        """Ray up, and a trainer that the cluster can never place refused before a round is
        generated for it."""
        from specrej_ray.distributed.cluster import connect_ray
        from specrej_ray.distributed.training import check_fits

        connect_ray(self.spec, self.stop)
        check_fits(self.it.trainer, self._may_grow(), self.echo)

    def _may_grow(self) -> bool:
        """A remote cluster may grow (an autoscaler); a local one never does."""
        return bool(self.spec.cluster.address or os.environ.get("RAY_ADDRESS"))

    def _policy(self, r: int, base: dict[str, Any]) -> dict[str, Any]:
        """Who generates round r: the base model, or round r-1's published model."""
        if r == 0:
            return {"round": 0, "path": base["path"], "sha256": base["sha256"],
                    "from_round": None, "model": self.spec.generator.model}
        path = model_dir(str(self.root), r - 1)
        stamp = read_stamp(path)
        if stamp is None:
            raise OutputError(f"round {r}: {path} is not a model this loop trained (no "
                              "specrej-train.json); remove it to train round "
                              f"{r - 1} again")
        return {"round": r, "path": path, "sha256": stamp["sha256"], "from_round": r - 1,
                "model": path}

    def _generate(self, r: int, policy: dict[str, Any]) -> dict[str, Any]:
        from specrej_ray.distributed.driver import run_job

        rspec = round_spec(self.spec, r, None if r == 0 else policy["path"])
        info = _run_info(rspec.output.path)
        if info is not None and (info.get("policy") or {}).get("sha256") != policy["sha256"]:
            raise OutputError(f"round {r}: {rspec.output.path} was generated by another "
                              "policy than the one this loop has now; remove it to "
                              "generate the round again")
        if _complete(info, rspec):
            self.echo(f"[specrej] round {r}: generation already complete")
        else:
            self.echo(f"[specrej] round {r}: generating with {policy['model']} "
                      f"(weights {policy['sha256'][:12]}) into {rspec.output.path}")
            info = run_job(rspec, echo=self.echo, stop=self.stop,
                           about={"policy": policy, "command": self.record.get("command")})
        return _generation_figures(rspec.output.path, info or {})

    def _train(self, r: int, policy: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        from specrej_ray.distributed.training import train_on_ray

        target = model_dir(str(self.root), r)
        if Path(target).exists():
            stamp = read_stamp(target)
            if stamp is None:
                raise OutputError(f"round {r}: {target} is not a model this loop trained; "
                                  "move it away")
            self.echo(f"[specrej] round {r}: model already trained ({target})")
            return stamp
        start = policy if self.it.train_from == "previous" else base
        trainer = self.it.trainer
        job = TrainJob(round=r, data=train_file(self.spec, r), start=start["path"],
                       model=target, checkpoints=checkpoint_dir(str(self.root), r),
                       train_on=self.it.train_on, kind=trainer.type, seed=self.spec.seed,
                       args=trainer.args, command=trainer.command,
                       threads=max(1, int(trainer.num_cpus)))
        self.echo(f"[specrej] round {r}: training ({self.it.train_on}, {trainer.type}) from "
                  f"{start['path']} into {target}")
        stamp = train_on_ray(job, trainer, self.stop, self.echo)
        stamp["from"] = {"path": start["path"], "sha256": start["sha256"]}
        return stamp

    def _save_round(self, r: int, policy: dict, gen: dict, trained: dict) -> None:
        rounds = [x for x in self.record["rounds"] if x["round"] != r]
        rounds.append({"round": r, "policy": policy, "generation": gen,
                       "model": {"path": model_dir(str(self.root), r),
                                 "sha256": trained["sha256"]},
                       "training": {k: trained.get(k) for k in
                                    ("seconds", "steps", "loss", "resumed_from", "trainer",
                                     "args", "command", "train_on", "data_sha256", "data_rows",
                                     "from")}})
        self.record["rounds"] = sorted(rounds, key=lambda x: x["round"])
        _write_json(self.root / STATE, self.record)


def check_trainer(trainer: TrainerSpec, train_on: str) -> None:
    """A bad trainer argument fails now, not after a round of generation."""
    if trainer.type == "trl":
        from specrej_ray.train.trl_trainer import check_args

        try:
            check_args(trainer.args, train_on)
        except ImportError as e:  # trl is imported only here
            raise TrainError(f"iterate.trainer.type trl needs TRL ({e.name} is missing): "
                             "pip install 'specrej-ray[train]'") from None


# --- what is on disk ---


def _local_root(url: str) -> Path:
    if "://" in url and not url.startswith("file://"):
        raise OutputError(f"output.path: iterate trains models into it, so it must be a "
                          f"directory every node can read and write (a shared or mounted "
                          f"file system), not {url.split('://')[0]}://; see "
                          "docs/expert-iteration.md")
    return Path(url.removeprefix("file://")).expanduser()


def _open_record(root: Path, fingerprint: str) -> dict[str, Any]:
    """iterate.json, or a new record for an empty directory; anything else is refused."""
    path = root / STATE
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except ValueError:
            raise OutputError(f"output.path: {path} is unreadable; move it away or use "
                              "another output.path") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise OutputError(f"output.path: {path} is not specrej-ray's; use another "
                              "output.path")
        if data.get("fingerprint") != fingerprint:
            raise OutputError(f"output.path: {root} holds rounds of a different spec or "
                              "iterate section (only iterate.rounds and iterate.trainer may "
                              "change between runs); use another output.path")
        return data
    names = {p.name for p in root.iterdir()} - LOCKS
    if {n for n in names if not is_temp(n)}:
        raise OutputError(f"output.path: {root} is a non-empty directory that is not an "
                          "iterate output (no iterate.json); choose a new or empty path")
    return {"format": FORMAT, "fingerprint": fingerprint, "rounds": []}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_atomic(locate(str(path.parent)), path.name, json.dumps(data, indent=2).encode())


def _run_info(out: str) -> dict[str, Any] | None:
    try:
        return read_run_info(locate(out))
    except ValueError:  # not one of ours: the round's run refuses it with the reason
        return None


def _complete(info: dict[str, Any] | None, rspec: JobSpec) -> bool:
    """run.json of this round's spec, whose last invocation completed every shard."""
    if not info or info.get("fingerprint") != rspec.fingerprint():
        return False
    last = (info.get("invocations") or [{}])[-1]
    return last.get("status") == "completed"


def _generation_figures(out: str, info: dict[str, Any]) -> dict[str, Any]:
    rewards = pq.read_table(Path(out) / "best.parquet", columns=["reward"]).column("reward")
    mean = pc.mean(rewards).as_py() if len(rewards) else None
    return {"path": out, "prompts": info.get("counts", {}).get("prompts"),
            "mean_best_reward": mean, "seconds": info.get("seconds_all_invocations"),
            "fingerprint": info.get("fingerprint")}


def summary_table(record: dict[str, Any]) -> str:
    lines = ["", "round  generator                    prompts  mean best reward  "
             "generate s  train s"]
    for x in record["rounds"]:
        g, t = x["generation"], x["training"]
        came = x["policy"]["from_round"]
        who = "base" if came is None else f"round-{came} model"
        best = g.get("mean_best_reward")
        lines.append(f"{x['round']:>5}  {who + ' ' + x['policy']['sha256'][:10]:<28} "
                     f"{g.get('prompts') or 0:>7}  {'-' if best is None else f'{best:.4f}':>16}  "
                     f"{g.get('seconds') or 0:>10.0f}  {t.get('seconds') or 0:>7.0f}")
    final = record["rounds"][-1]["model"]["path"] if record["rounds"] else None
    lines.append(f"final policy: {final}")
    return "\n".join(lines + summary_lines(record))
