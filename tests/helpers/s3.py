"""A real S3 API on 127.0.0.1: moto's server, in a process of its own (so the test process's
GIL never slows its answers), for the object-store tests and the chaos and load benches.

moto checks S3's conditional writes (PutObject If-None-Match / If-Match, DeleteObject
If-Match, CompleteMultipartUpload If-None-Match) and keeps a multipart upload invisible
until it completes. But it checks a condition and then writes, in two steps, on a thread per
request, with no lock between them: two racing creates could both pass, where S3 makes a
conditional write atomic (the first to finish wins, the other gets 412 or 409). So the
server here is moto's app answering one request at a time (`serve`), connections still open
in parallel. `env()` is what a process needs to
reach it through s3fs: botocore reads the endpoint and credentials from the environment.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> MotoServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from tests.helpers.s3 import serve; serve({self.port})"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2).read()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL_S3": self.url, "AWS_ENDPOINT_URL": self.url,
                "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def make_bucket(self, name: str) -> None:
        self.fs().mkdir(name)

    def fs(self, **options):
        return s3_fs(self.url, **options)

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def s3_fs(endpoint_url: str, **options):
    """A fresh s3fs filesystem on the server at endpoint_url (no instance cache)."""
    import s3fs

    return s3fs.S3FileSystem(key="testing", secret="testing", skip_instance_cache=True,
                             client_kwargs={"endpoint_url": endpoint_url}, **options)


def serve(port: int) -> None:
    """moto's S3 server (what `python -m moto.server` runs) on 127.0.0.1, one request at a
    time, so that a conditional write is atomic as on S3 (see the module doc)."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    one_at_a_time = threading.Lock()

    def serial(environ, start_response):
        with one_at_a_time:  # the body too: the request is whole before the next begins
            return list(app(environ, start_response))

    run_simple("127.0.0.1", port, serial, threaded=True, request_handler=MotoRequestHandler)


def use(server: MotoServer) -> dict[str, str]:
    """Point this process's s3fs at the server; returns the environment it had."""
    import s3fs

    before = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    s3fs.S3FileSystem.clear_instance_cache()
    return before
