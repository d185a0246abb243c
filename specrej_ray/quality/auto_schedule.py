"""schedule: auto within a run (Calibration): the calibration shards choose the setting the
other shards run with, written to calibration.json, and audited prompts keep checking it.
Ray-free: the driver's shard loop calls it between shards."""

from __future__ import annotations

from specrej_ray.data.output import OutputDir
from specrej_ray.engine.task import Choice
from specrej_ray.errors import JobError
from specrej_ray.quality.audit import line as audit_line
from specrej_ray.quality.audit import summarize
from specrej_ray.quality.calibrate import choice_from, decide_setting, grid_for, table_from_json
from specrej_ray.quality.summary import setting_line
from specrej_ray.spec import JobSpec


class Calibration:
    """schedule: auto in a run: the calibration shards come first (`count` of `todo`); once
    they are done, their data (and that of calibration prompts done earlier, kept in their
    shard records) chooses what the other shards run with, written to calibration.json so a
    resume reuses it. Audited prompts keep checking the choice: when those run with it miss
    the target with confidence, their data joins the calibration prompts' and the choice is
    made again for the shards not yet sent. Without schedule auto, nothing calibrates and no
    choice is passed."""

    def __init__(self, spec: JobSpec, outdir: OutputDir, prompt_ids: list[str], count: int,
                 echo) -> None:
        self.spec, self.outdir, self.ids, self.count, self.echo = (spec, outdir, prompt_ids,
                                                                   count, echo)
        self.data: dict | None = None  # calibration.json's content, once chosen
        self.tables: dict[str, dict] = {}  # prompt id -> data the choice may be made on
        self.audits: list[dict] = []  # audit records since the last choice

    @property
    def grid(self) -> tuple[int, ...]:
        return grid_for(self.spec.generator.sampling.max_new_tokens)

    def choice(self, tables: dict[str, dict]) -> Choice | None:
        if not self.spec.search.calibrates:
            return None
        self.data = self.outdir.calibration()
        judged = {pid for h in (self.data or {}).get("recalibrations", [])
                  for pid in h["audited"]}  # audits a recalibration has already acted on
        for record in self.outdir.records.values():
            for pid, table in (record.get("calibration") or {}).items():
                tables.setdefault(pid, table)
            self.audits += [a for a in record.get("audit") or [] if a["prompt_id"] not in judged]
        self.tables = tables
        if self.data is None:
            found = {pid: tables[pid] for pid in self.ids if pid in tables}
            if not found:
                raise JobError("schedule auto: no calibration prompt finished (see "
                               "errors.jsonl); fix what failed and run again")
            self._decide(found, {})
        run = self.data["run_with"]
        self.echo(f"[specrej] schedule auto: {self.data['reason']}; the other prompts run "
                  f"with {setting_line(run)} ({self.data['how']})")
        return choice_from(run)

    def audited(self, audits: list[dict], tables: dict[str, dict]) -> Choice | None:
        """New audit records (and their prompts' data): a new choice when the audits of the
        current one miss the target with confidence, else None."""
        self.audits += audits
        self.tables.update(tables)
        if self.data is None:
            return None
        run = self.data["run_with"]
        mine = [a for a in self.audits if a.get("setting") == _setting(run)]
        verdict = summarize(mine, self.spec.search.target_score)
        if verdict["verdict"] != "missed":
            return None
        self.echo(f"[specrej] schedule auto: {audit_line(verdict)}; recalibrating on "
                  f"{len(self.tables)} prompts (calibration and audited)")
        history = [*self.data.get("recalibrations", []),
                   {"was": run, "audit": verdict, "prompts": len(self.tables),
                    "audited": [a["prompt_id"] for a in mine]}]
        self._decide(dict(self.tables), {"recalibrations": history})
        self.audits = []  # the new choice is judged on its own audits
        run = self.data["run_with"]
        self.echo(f"[specrej] schedule auto: {self.data['reason']}; the prompts not yet "
                  f"sent run with {setting_line(run)} ({self.data['how']})")
        return choice_from(run)

    def _decide(self, tables: dict[str, dict], extra: dict) -> None:
        s = self.spec.search
        found = {pid: table_from_json(t) for pid, t in tables.items()}
        self.data = {**decide_setting(found, s.target_score, s.calibration_fallback,
                                      self.spec.generator.sampling.max_new_tokens), **extra}
        self.outdir.write_calibration(self.data)


def _setting(run: dict) -> dict:
    """calibration.json's run_with as an audit record names a setting."""
    return {"alpha": run["alpha"], "schedule": run["schedule"] or "memory"}
