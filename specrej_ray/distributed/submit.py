"""`specrej-ray submit`: run a job spec on a Ray cluster through its job server.

The working directory (with the spec in it) is packaged and uploaded as the job's
`runtime_env.working_dir`; the entrypoint is `specrej-ray run SPEC --set ...` (`iterate` with
--iterate). The submission id
is derived from the spec, so submitting the same job twice follows the first submission
instead of starting a second one. Ray is imported only when a client is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from specrej_ray.spec import JobSpec

# Never uploaded: environments, outputs, VCS data and caches (Ray also skips .gitignore'd files).
DEFAULT_EXCLUDES = [
    ".venv", "venv", ".env", "out", "runs", ".git", "__pycache__", "*.pyc", ".pytest_cache",
    ".ruff_cache", ".mypy_cache", "*.egg-info", "build", "dist",
]
DEFAULT_RUNTIME_ENV = Path("jobs") / "runtime_env.yaml"
EXIT_OK, EXIT_FAILED, EXIT_USER, EXIT_STILL_RUNNING = 0, 1, 2, 3
# How long one request to the job server may take before we call it unreachable.
CONNECT_TIMEOUT_S = 10.0
# Longest quiet spell in the log stream before the job's status is checked again.
POLL_S = 5.0
# Ray's job server answers 500 "No available agent to submit job, please try again later" until
# the head's dashboard agent has registered: seconds after `ray start`, more on a busy head. It
# has submitted nothing then, so the same submission is sent again, for at most AGENT_WAIT_S.
NO_AGENT = "No available agent to submit job"
AGENT_WAIT_S = 120.0
AGENT_RETRY_S = 2.0


class SubmitError(Exception):
    """A user error (bad address, runtime env, paths); str() is one line."""


def submission_id(spec: JobSpec, command: str = "run") -> str:
    """`specrej-<name>-<hash>`: the same spec (and output.path, and command: `run` or
    `iterate`) always gives the same id."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", spec.name).strip("-")[:40] or "job"
    key = f"{spec.fingerprint()}\x00{spec.output.path}"
    if command != "run":  # a run's id is unchanged; an iterate loop's also names its section
        section = spec.iterate.model_dump_json() if spec.iterate is not None else ""
        key += f"\x00{command}\x00{section}"
    return f"specrej-{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def entrypoint(spec_path: str, overrides: list[str], command: str = "run") -> str:
    """The shell command the job server runs; every argument is quoted."""
    argv = ["specrej-ray", command, spec_path]
    for item in overrides:
        argv += ["--set", item]
    return shlex.join(argv)


def spec_in_working_dir(job: Path, working_dir: Path) -> str:
    """The spec's path relative to the uploaded directory, as the job will see it."""
    try:
        return job.resolve().relative_to(working_dir.resolve()).as_posix()
    except ValueError:
        raise SubmitError(
            f"{job}: the job spec is outside the working directory {working_dir} that is "
            "uploaded; move it there or pass --working-dir"
        ) from None


def load_runtime_env(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SubmitError(f"{path}: cannot read runtime env ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise SubmitError(f"{path}: not valid YAML: {getattr(e, 'problem', e)}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise SubmitError(f"{path}: a runtime env must be a YAML mapping (env_vars, pip, ...)")
    return data


def build_runtime_env(working_dir: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """`extra` (from a runtime env file) wins, except that working_dir is always the package
    and excludes are added to ours."""
    env = dict(extra or {})
    if "working_dir" in env:
        raise SubmitError("runtime env: working_dir is set by `submit` (use --working-dir)")
    excludes = list(DEFAULT_EXCLUDES)
    excludes += [x for x in env.pop("excludes", None) or [] if x not in excludes]
    return {**env, "working_dir": str(working_dir), "excludes": excludes}


def connect(address: str):
    """A JobSubmissionClient, or a one-line SubmitError when the job server can't be used."""
    import requests

    url = address if "://" in address else f"http://{address}"
    if not url.startswith(("http://", "https://")):
        raise SubmitError(f"--address {address}: expected the job server's http:// address, "
                          "e.g. http://127.0.0.1:8265")
    try:  # bounded: the client's own requests have no timeout
        requests.get(f"{url.rstrip('/')}/api/version", timeout=CONNECT_TIMEOUT_S)
    except requests.RequestException as e:
        raise SubmitError(f"cannot reach the Ray job server at {url} "
                          f"({type(e).__name__}); is the cluster running?") from None
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(url)
    except AuthenticationError:
        raise SubmitError(_auth_hint(url)) from None
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SubmitError(f"Ray job server at {url}: {_first_line(e)}") from None


def _auth_hint(url: str) -> str:
    return (f"the Ray cluster at {url} rejected the request (token authentication): set "
            "RAY_AUTH_MODE the same for the cluster and this command (token, with the token in "
            "RAY_AUTH_TOKEN or ~/.ray/auth_token; or disabled on both)")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _statuses(client) -> dict[str, str]:
    return {j.submission_id: str(j.status.value) for j in client.list_jobs() if j.submission_id}


def choose_id(base: str, existing: dict[str, str]) -> tuple[str, str | None]:
    """(id, status of that existing job or None to submit it). A job that is pending, running
    or succeeded is reused; after FAILED/STOPPED the next free `-rN` id is submitted."""
    sid, attempt = base, 0
    while sid in existing:
        if existing[sid] not in ("FAILED", "STOPPED"):
            return sid, existing[sid]
        attempt += 1
        sid = f"{base}-r{attempt}"
    return sid, None


def submit(
    spec: JobSpec, job: Path, overrides: list[str], address: str, *, working_dir: Path,
    runtime_env_file: Path | None = None, wait: bool = True, timeout_s: float | None = None,
    echo=print, command: str = "run",
) -> int:
    def err(line: str) -> None:
        echo(f"specrej-ray: {line}", file=sys.stderr)

    rel = spec_in_working_dir(job, working_dir)
    env_file = runtime_env_file
    if env_file is None and (working_dir / DEFAULT_RUNTIME_ENV).is_file():
        env_file = working_dir / DEFAULT_RUNTIME_ENV
    runtime_env = build_runtime_env(working_dir, load_runtime_env(env_file) if env_file else None)
    out = spec.output.path
    if "://" not in out and not Path(out).expanduser().is_absolute():
        err(f"warning: output.path {out!r} is relative: the job writes it inside its copy of "
            "the working dir on the cluster; use an absolute path or a URL (--set output.path=)")

    client = connect(address)
    from ray.exceptions import AuthenticationError

    logging.getLogger("ray").setLevel(logging.WARNING)  # not every file packaged, please

    try:
        sid, status = choose_id(submission_id(spec, command), _statuses(client))
        if status is not None:
            echo(f"[specrej] job {sid} was already submitted and is {status}; "
                 + ("following it" if status in ("PENDING", "RUNNING") and wait
                    else "not submitting it again"))
            if status == "SUCCEEDED":
                echo(f"[specrej] to run it again: ray job delete --address {address} {sid}")
                return EXIT_OK
        else:
            submit_when_agent_up(
                client, echo, entrypoint=entrypoint(rel, overrides, command), submission_id=sid,
                runtime_env=runtime_env,
                metadata={"specrej_fingerprint": spec.fingerprint(), "spec": rel},
            )
            echo(f"[specrej] submitted {sid} to {address} (logs: ray job logs -f {sid})")
        if not wait:
            return EXIT_OK
        final = asyncio.run(follow(client, sid, timeout_s, echo))
    except AuthenticationError:
        raise SubmitError(_auth_hint(address)) from None
    except (OSError, RuntimeError, ValueError) as e:  # requests' errors are OSErrors
        raise SubmitError(f"Ray job server at {address}: {_first_line(e)}") from None
    if final is None:
        err(f"job {sid} has not finished yet; it goes on (ray job logs -f {sid})")
        return EXIT_STILL_RUNNING
    message = None
    with contextlib.suppress(OSError, RuntimeError):
        message = client.get_job_info(sid).message
    echo(f"[specrej] job {sid}: {final}" + (f" ({message})" if message else ""))
    return EXIT_OK if final == "SUCCEEDED" else EXIT_FAILED


def submit_when_agent_up(client, echo, **job: Any) -> None:
    """client.submit_job(**job), sent again while the job server has no agent to take it (one
    line says so); any other error, or no agent after AGENT_WAIT_S, is raised."""
    deadline = time.monotonic() + AGENT_WAIT_S
    told = False
    while True:
        try:
            client.submit_job(**job)
            return
        except RuntimeError as e:
            if NO_AGENT not in str(e) or time.monotonic() >= deadline:
                raise
        if not told:
            echo(f"[specrej] the cluster's job agent is not up yet; trying again for up to "
                 f"{AGENT_WAIT_S:.0f} s")
            told = True
        time.sleep(AGENT_RETRY_S)


async def follow(client, sid: str, timeout_s: float | None, echo=print) -> str | None:
    """Print the job's logs as they come; return its terminal status, or None at timeout.

    No wait is unbounded: a quiet log stream for POLL_S triggers a status check, and a broken
    stream falls back to polling the status."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def expired() -> bool:
        return deadline is not None and time.monotonic() > deadline

    async def status() -> str:
        s = await asyncio.wait_for(asyncio.to_thread(client.get_job_status, sid), 60)
        return str(s.value)

    stream = client.tail_job_logs(sid).__aiter__()
    pending: asyncio.Future | None = None
    try:
        while not expired():
            if pending is None:
                pending = asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=POLL_S)
            if not done:
                if (s := await status()) in ("SUCCEEDED", "FAILED", "STOPPED"):
                    break
                continue
            task, pending = pending, None
            try:
                echo(task.result(), end="", flush=True)
            except StopAsyncIteration:
                break
            except Exception as e:  # the stream broke: poll the status instead
                echo(f"[specrej] log stream ended ({_first_line(e)}); polling the job status")
                while not expired():
                    if (s := await status()) in ("SUCCEEDED", "FAILED", "STOPPED"):
                        return s
                    await asyncio.sleep(POLL_S)
                return None
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(stream.aclose(), 10)
    # The stream ends when the job does; its status may trail by a moment.
    for _ in range(30):
        if (s := await status()) in ("SUCCEEDED", "FAILED", "STOPPED"):
            return s
        if expired():
            return None
        await asyncio.sleep(1)
    return None
