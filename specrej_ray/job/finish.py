"""The end of a run: its final files written as one set, or its failure recorded.

The driver calls these once its shards are done (or a write failed). What a reader finds
at each moment is data/final_set.py's; here is what goes into the set and into run.json.
"""

from __future__ import annotations

from typing import Any

from specrej_ray.data import formats
from specrej_ray.data.card import card_text
from specrej_ray.data.final_set import PUBLISHING, SET
from specrej_ray.data.output import Keys, OutputDir, Resume
from specrej_ray.data.prompts import RowProblem
from specrej_ray.job.interrupt import Interrupt
from specrej_ray.job.run_record import RunState, run_info
from specrej_ray.quality.audit import audit_summary
from specrej_ray.spec import JobSpec


def write_final_set(spec: JobSpec, outdir: OutputDir, keys: Keys, found: Resume,
                    rows: tuple[str, list[RowProblem]], state: RunState, stop: Interrupt,
                    facts: dict[str, Any], times: tuple[float, float], echo=print
                    ) -> dict[str, Any]:
    """The final files staged (datasets, errors.jsonl, the card), then made visible as one
    set with run.json last; returns that run.json. `rows`: the prompt source and its
    skipped rows; `facts`: what else run.json says (models, the command); `times`: when the
    run and its generation started."""
    source, problems = rows
    with outdir.staging() as final:
        made = outdir.assemble(keys, spec.output, formats.provenance(spec), into=final)
        outdir.write_errors(source, problems, state.failures, into=final)
        # The first ids only: a job whose every prompt was edited must not bloat run.json.
        facts = {"files": made.files, "filters": made.filters,
                 "shards_dropped": found.dropped,
                 "regenerated": {"prompts": len(found.changed), "ids": found.changed[:100]},
                 **({"calibration": outdir.calibration()} if spec.search.calibrates else {}),
                 "audit": audit_summary(spec, outdir.audits(keys)), **facts}

        def info_now() -> dict[str, Any]:
            info = {**run_info(spec, made.counts, problems, state, *times), **facts}
            if (lease := outdir.lock.report()) is not None:
                info["lease"] = lease
            return info

        def record(listing: dict[str, Any]) -> dict[str, Any]:
            state.interrupted = stop.requested  # a signal during the writing counts too
            info = {**info_now(), SET: listing}
            if listing["state"] == PUBLISHING:  # its status once its files are in place
                info["invocations"][-1]["status"] = PUBLISHING
            return info

        tables = outdir.table_stats(made.files, final)
        outdir.write_card(card_text(info_now(), tables), echo, into=final)
        return outdir.publish(final, record)


def record_failure(spec: JobSpec, outdir: OutputDir, state: RunState,
                   problems: list[RowProblem], times: tuple[float, float],
                   error: Exception) -> None:
    """A write failed (a full disk, access lost): run.json says so, this invocation
    `failed` with the error's line, and what the final files are now: the earlier set, or
    none (OutputDir.record_failure)."""
    state.error = str(error)
    outdir.record_failure(run_info(spec, {}, problems, state, *times))
