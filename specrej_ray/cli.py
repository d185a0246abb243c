"""specrej-ray command line: validate, run, submit, bench, tune, evaluate; report on runs.

User errors print one line each (prefixed with the file or field) and exit 2, never a
traceback (a reward that raises while the job runs is one too); a job that ran but could not
finish every shard exits 1, as does an installed library that lacks a part specrej-ray
reaches (errors.LibraryChanged, one line). SIGTERM / SIGINT stop `run` cleanly, keeping what
is finished: exit 143 / 130. `submit` exits with the submitted job's status (0 SUCCEEDED,
1 FAILED or STOPPED, 3 still running at --timeout).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from specrej_ray.data.prompts import PromptError
from specrej_ray.distributed.submit import SubmitError
from specrej_ray.errors import LibraryChanged, ModelError, OutputError, RewardError, TrainError
from specrej_ray.spec import JobSpec, SpecError, load_spec

USER_ERRORS = (SpecError, PromptError, ModelError, RewardError, OutputError, SubmitError,
               TrainError)
EXIT_USER, EXIT_FAILED = 2, 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specrej-ray", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_text in (("validate", "check a job spec, its prompts and model sources"),
                            ("run", "run a job spec and write the dataset"),
                            ("submit", "submit a job spec to a Ray cluster's job server"),
                            ("iterate", "expert iteration: rounds of generate, train on the "
                             "best, generate with the trained policy (the spec's iterate:)")):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("job", type=Path, help="job spec YAML")
        cmd.add_argument("--set", dest="overrides", action="append", default=[],
                         metavar="KEY=VALUE", help="override a spec field, e.g. search.alpha=0.7")
        if name == "run":
            cmd.add_argument("--overwrite", action="store_true",
                             help="discard existing results at output.path")
        if name == "submit":
            _submit_args(cmd)
    tune = sub.add_parser("tune", help="counterfactual analysis: token rate and score for "
                          "alpha x decision lengths on N candidates per prompt (paper 6.2)")
    tune.add_argument("job", type=Path, help="job spec YAML")
    tune.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="KEY=VALUE", help="override a spec field, e.g. search.n=32")
    tune.add_argument("--prompts", type=int, metavar="K",
                      help="use the first K prompts (default 8; with --from, all it holds)")
    tune.add_argument("--alphas", metavar="A,B,...", help="rejection rates to try "
                      "(default 0.5,0.7,0.8,0.9)")
    tune.add_argument("--decisions", metavar="T1,T2,...", help="decision lengths to score; "
                      "schedules are each one and each pair (default 8,16,32,64,128 below "
                      "max_new_tokens)")
    tune.add_argument("--target", type=float, default=99.0,
                      help="normalized score to keep, on resampled candidates (default 99)")
    tune.add_argument("--from", dest="from_json", metavar="TUNE.JSON",
                      help="replay the candidates an earlier tune wrote instead of generating")
    tune.add_argument("--out", metavar="DIR", help="where tune.json and tune.png go "
                      "(default: OUTPUT.PATH/tune)")
    bench = sub.add_parser("bench", help="measure SBoN against Best-of-N on this machine "
                           "(same engine, prompts and seed); writes bench.json, .md, .png")
    bench.add_argument("job", type=Path, help="job spec YAML")
    bench.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override a spec field, e.g. search.n=64")
    bench.add_argument("--n-list", default="8,16,32,64,128", metavar="N,N,...",
                       help="Best-of-N arms (default 8,16,32,64,128; the spec's n is added)")
    bench.add_argument("--prompts", type=int, metavar="K",
                       help="use the first K prompts (default: all after prompts.limit)")
    bench.add_argument("--batch", default="16,64", metavar="B,B,...",
                       help="batch sizes of the throughput and roofline figures "
                       "(default 16,64)")
    bench.add_argument("--out", type=Path, metavar="DIR",
                       help="where the report goes (default: bench/results/<spec name>)")
    bench.add_argument("--skip-throughput", action="store_true",
                       help="skip the engine vs model.generate comparison")
    bench.add_argument("--skip-roofline", action="store_true",
                       help="skip measuring this machine's FLOP/s and bandwidth")
    bench.add_argument("--calibration", type=Path, metavar="FILE",
                       help="schedule auto: calibrate on the first calibration_prompts prompts "
                       "of FILE (held out from the bench, e.g. the tune split; their cost is "
                       "reported apart) instead of the bench's own first prompts")
    bench.add_argument("--engines", default="hf", metavar="hf[,vllm]",
                       help="generator backends whose arms run side by side: hf,vllm adds "
                       "SBoN and Best-of-N on vLLM and Best-of-N as vLLM users run it "
                       "(n=N, then the reward pass); default hf")
    _evaluate_args(sub)
    rep = sub.add_parser("report", help="write report.html for a finished run, print a summary")
    rep.add_argument("output", help="the run's output.path (a directory or fsspec URL)")
    rep.add_argument("--out", dest="out_file", metavar="FILE",
                     help="where to write the page (default: OUTPUT/report.html)")
    return p


def _evaluate_args(sub) -> None:
    ev = sub.add_parser("evaluate", help="how well models follow verifiable instructions: "
                        "IFEval's accuracies of a greedy and a sampled response per prompt, "
                        "each model against the first (paired bootstrap); writes eval.json, "
                        ".md, .png")
    ev.add_argument("job", type=Path, help="job spec YAML (its generator, sampling, seed and "
                    "instructions reward)")
    ev.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="override a spec field, e.g. "
                    "generator.sampling.max_new_tokens=128")
    ev.add_argument("--model", dest="models", action="append", default=[], metavar="PATH",
                    help="a model to evaluate (a directory, a .gguf, the packaged alias or a "
                    "hub id); repeat it: the first is the reference (default: generator.model)")
    ev.add_argument("--prompts", metavar="FILE", help="prompts with verifiable instructions, "
                    "IFEval's format (default: prompts.path of the spec)")
    ev.add_argument("--limit", type=int, metavar="K", help="the first K prompts only")
    ev.add_argument("--out", metavar="DIR", help="where eval.json, eval.md and eval.png go "
                    "(default: OUTPUT.PATH/eval)")


def _submit_args(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS")
                     or os.environ.get("RAY_ADDRESS") or "http://127.0.0.1:8265",
                     help="the cluster's job server (default: $RAY_API_SERVER_ADDRESS, "
                     "$RAY_ADDRESS, else http://127.0.0.1:8265)")
    cmd.add_argument("--working-dir", type=Path, default=Path.cwd(),
                     help="directory uploaded as the job's working dir; holds the spec "
                     "(default: the current directory)")
    cmd.add_argument("--runtime-env", type=Path, metavar="FILE",
                     help="runtime env YAML (default: jobs/runtime_env.yaml if present)")
    cmd.add_argument("--no-wait", action="store_true",
                     help="return once submitted instead of following the logs")
    cmd.add_argument("--timeout", type=float, metavar="SECONDS",
                     help="stop following after this long (the job goes on; exit 3)")
    cmd.add_argument("--iterate", action="store_true",
                     help="submit `specrej-ray iterate SPEC` (the spec's iterate: rounds) "
                     "instead of `run`")


def submit(spec: JobSpec, args: argparse.Namespace) -> int:
    from specrej_ray.distributed.submit import submit as submit_job

    if args.iterate:
        _check_iterate(spec)
    validate(spec, echo=print)  # bad prompt rows are listed; `run` skips them
    return submit_job(spec, args.job, args.overrides, args.address,
                      working_dir=args.working_dir, runtime_env_file=args.runtime_env,
                      wait=not args.no_wait, timeout_s=args.timeout,
                      command="iterate" if args.iterate else "run")


def validate(spec: JobSpec, echo=print) -> int:
    """Every check `run` makes before Ray starts (job/preflight.py), then every prompt
    rendered and tokenized (config and tokenizer only, no weights), so that each row `run`
    would skip is listed, too-long ones included."""
    from specrej_ray.job.preflight import preflight
    from specrej_ray.job.prepare import prepare_prompts

    checked = preflight(spec)
    prompts, _tasks, problems, source = prepare_prompts(spec, checked.gen_path,
                                                        allow_empty=True,
                                                        context=checked.context)
    for problem in problems:
        echo(problem.line(source), file=sys.stderr)
    if problems:
        echo(f"specrej-ray: {len(problems)} bad prompt row(s); `run` skips them and "
             "lists them in errors.jsonl", file=sys.stderr)
        return EXIT_USER
    if not prompts:
        echo(f"specrej-ray: error: prompts.path: '{source}' holds no prompts; add some rows",
             file=sys.stderr)
        return EXIT_USER
    echo(f"ok: {len(prompts)} prompts, mode {spec.search.mode}, N={spec.search.n}, "
         f"output {spec.output.path}")
    if spec.iterate is not None:  # `iterate` reads it; a bad trainer argument shows here too
        _check_iterate(spec)
        it = spec.iterate
        echo(f"ok: iterate: {it.rounds} round(s), {it.trainer.type} on {it.train_on}, "
             f"training from the {it.train_from} policy, prompts {it.prompts.mode}")
        if it.evaluate is not None:
            return _validate_evaluation(spec, checked, echo)
    return 0


def _validate_evaluation(spec: JobSpec, checked, echo) -> int:
    """iterate.evaluate's prompts load, carry instructions the checkers take, and fit the
    generator's context."""
    from specrej_ray.evaluate import EvalError
    from specrej_ray.evaluate.responses import eval_spec, read_prompts
    from specrej_ray.job.prepare import prepare_prompts

    ev = spec.iterate.evaluate  # type: ignore[union-attr]
    try:
        espec = eval_spec(spec, None, ev.prompts, ev.limit)
        read_prompts(espec, "iterate.evaluate.prompts")
    except EvalError as e:
        echo(f"specrej-ray: error: {e}", file=sys.stderr)
        return EXIT_USER
    prompts, _tasks, problems, source = prepare_prompts(espec, checked.gen_path,
                                                        allow_empty=True,
                                                        context=checked.context)
    for problem in problems:  # too long for the generator
        echo(f"iterate.evaluate.prompts: {problem.line(source)}", file=sys.stderr)
    if problems:
        echo(f"specrej-ray: {len(problems)} evaluation prompt(s) the generator cannot "
             "answer; an evaluation runs on every row: fix or remove them", file=sys.stderr)
        return EXIT_USER
    echo(f"ok: iterate.evaluate: {len(prompts)} prompts with instructions ({ev.prompts})")
    return 0


def run(spec: JobSpec, command: str | None = None) -> int:
    from specrej_ray.data.output import OutputDir
    from specrej_ray.job.interrupt import Interrupted, exit_code, handling_signals
    from specrej_ray.job.preflight import preflight

    outdir = None
    try:
        # Signals first: one during the checks or while the driver's modules load is a clean
        # stop too. The checks are validate's (a second run is refused among the first of
        # them, in about a second); then the output is taken, before the driver loads.
        with handling_signals() as stop:
            checked = preflight(spec, between=stop.check)
            with OutputDir.for_spec(spec) as outdir:
                # A signal only sets the flag, which the shard loop polls; the start-up's
                # slow steps (imports, models, prompts, Ray's start) stop at once (at_once),
                # and check the flag after, as an Interrupted raised in an import may be
                # swallowed.
                stop.defer()
                return _run(spec, stop, outdir, command, checked)
    except Interrupted as e:
        if outdir is None or outdir.holds_nothing:  # the folder the run made is gone again
            kept = "no prompt had finished, and nothing was written"
        else:
            kept = f"finished shards are kept in {spec.output.path}"
        print(f"specrej-ray: stopped by {e}; {kept}: run the same command again to resume",
              file=sys.stderr)
        return exit_code(e.signum)


def _run(spec: JobSpec, stop, outdir, command: str | None, checked) -> int:
    with stop.at_once():  # seconds of imports (Ray, torch): a stop in them need not wait
        from specrej_ray.distributed.driver import JobError, run_job
        from specrej_ray.quality.summary import print_summary

    try:
        info = run_job(spec, stop=stop, outdir=outdir, about={"command": command},
                       checked=checked)
    except JobError as e:
        return _failed(e, "job", "finished shards")
    print_summary(spec.output.path, info)  # a URL must not go through Path
    return 0


def _check_iterate(spec: JobSpec) -> None:
    """The iterate section is there, and a TRL trainer's arguments are TRL's."""
    if spec.iterate is None:
        raise SpecError("iterate: the spec has no iterate: section; add one (rounds, "
                        "train_on, trainer; see docs/expert-iteration.md)")
    from specrej_ray.iterate.loop import check_trainer

    check_trainer(spec.iterate.trainer, spec.iterate.train_on)


def iterate(spec: JobSpec, command: str) -> int:
    from specrej_ray.job.interrupt import Interrupted, exit_code, handling_signals

    _check_iterate(spec)
    from specrej_ray.iterate.rounds import round_spec
    from specrej_ray.job.preflight import preflight

    # Round 0's checks before the loop connects to Ray; the loop's root is no output (its
    # rounds are, and each round's run checks its own before it starts).
    preflight(round_spec(spec, 0, None), output=False)
    from specrej_ray.distributed.driver import JobError
    from specrej_ray.evaluate import EvalError
    from specrej_ray.iterate.loop import run_iterate

    try:
        with handling_signals() as stop:
            stop.defer()
            run_iterate(spec, stop, command=command)
    except EvalError as e:
        print(f"specrej-ray: error: {e} (finished rounds are kept: run again to resume)",
              file=sys.stderr)
        return EXIT_USER
    except Interrupted as e:
        print(f"specrej-ray: stopped by {e}; finished rounds, shards and checkpoints are kept "
              f"in {spec.output.path}: run the same command again to resume", file=sys.stderr)
        return exit_code(e.signum)
    except JobError as e:
        return _failed(e, "iterate", "finished rounds")
    return 0


def _failed(e: Exception, what: str, kept: str) -> int:
    """A job's failure in one line: the user's reward (exit 2, theirs to fix) or the
    infrastructure (exit 1)."""
    from specrej_ray.errors import ModelFailed, RewardFailed

    if isinstance(e, RewardFailed | ModelFailed):
        print(f"specrej-ray: error: {e} ({kept} are kept: run again to resume)",
              file=sys.stderr)
        return EXIT_USER
    print(f"specrej-ray: {what} failed: {e}", file=sys.stderr)
    return EXIT_FAILED


def report(output: str, out_file: str | None = None) -> int:
    # Imported here: matplotlib is only needed by this command.
    from specrej_ray.report import ReportError, build_analysis, text_summary, write_report

    try:
        analysis = build_analysis(output)
        where = write_report(analysis, out_file)
    except ReportError as e:
        print(f"specrej-ray: error: {e}", file=sys.stderr)
        return EXIT_USER
    print(text_summary(analysis))
    print(f"report: {where}")
    return 0


def tune(spec: JobSpec, args: argparse.Namespace) -> int:
    # Imported here: matplotlib and the models are only needed by this command.
    from specrej_ray.tune import TuneError, TuneOptions, run_tune

    try:
        opts = TuneOptions.parse(args.prompts, args.alphas, args.decisions, args.target,
                                 args.out, args.from_json)
        run_tune(spec, opts, str(args.job), args.overrides)
    except TuneError as e:
        print(f"specrej-ray: error: {e}", file=sys.stderr)
        return EXIT_USER
    return 0


def bench(spec: JobSpec, args: argparse.Namespace, argv: list[str]) -> int:
    # Imported here: torch, the models and matplotlib are only needed by this command.
    from specrej_ray.benchmark import BenchError, BenchOptions, parse_n_list

    try:
        batches = parse_n_list(args.batch, "--batch", "16,64")
        opts = BenchOptions(parse_n_list(args.n_list), args.prompts, batches, args.out,
                            not args.skip_throughput, not args.skip_roofline,
                            "specrej-ray " + shlex.join(argv), args.calibration,
                            tuple(e.strip() for e in args.engines.split(",")))
        from specrej_ray.benchmark.run import run_bench  # after the options: fail fast

        paths = run_bench(spec, opts)
    except BenchError as e:
        print(f"specrej-ray: error: {e}", file=sys.stderr)
        return EXIT_USER
    for path in paths:
        print(f"wrote {path}")
    return 0


def evaluate(spec: JobSpec, args: argparse.Namespace, command: str) -> int:
    # Imported here: torch, the checkers and matplotlib are only needed by this command.
    from specrej_ray.evaluate import EvalError, EvalOptions, run_evaluate

    try:
        run_evaluate(spec, EvalOptions(tuple(args.models), args.prompts, args.limit,
                                       args.out, command))
    except EvalError as e:
        print(f"specrej-ray: error: {e}", file=sys.stderr)
        return EXIT_USER
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[specrej] %(levelname)s %(message)s")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if args.command == "report":
        return report(args.output, args.out_file)
    try:
        spec = load_spec(args.job, args.overrides)
        if getattr(args, "overwrite", False):
            spec.output.if_exists = "overwrite"
        if args.command == "submit":
            return submit(spec, args)
        if args.command == "bench":
            return bench(spec, args, sys.argv[1:] if argv is None else argv)
        if args.command == "tune":
            return tune(spec, args)
        command = "specrej-ray " + shlex.join(sys.argv[1:] if argv is None else argv)
        if args.command == "evaluate":
            return evaluate(spec, args, command)
        if args.command == "iterate":
            return iterate(spec, command)
        return validate(spec) if args.command == "validate" else run(spec, command)
    except USER_ERRORS as e:
        for line in str(e).splitlines():
            print(f"specrej-ray: error: {line}", file=sys.stderr)
        return EXIT_USER
    except LibraryChanged as e:  # an installed library moved a part a seam module reaches
        print(f"specrej-ray: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("specrej-ray: interrupted; finished shards are kept (run again to resume)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
