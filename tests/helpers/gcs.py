"""gcsfs over an in-memory Google Cloud Storage, for the lease's calls where no GCS server
is at hand (the emulators on PyPI ignore most preconditions: fake-gcs-server 1.54 checks
them on multipart uploads only, gcp-storage-emulator not at all).

Only the HTTP exchange is replaced (GCSFileSystem._request): gcsfs itself builds every URL
and query, and its own validate_response turns statuses into exceptions (404
FileNotFoundError, 412 FileExistsError). The store follows the JSON API's documented rules
for what the lease uses: object metadata and media GETs (`generation=` pins one), media
uploads and deletes with `ifGenerationMatch` (0: only if absent), and a new generation per
write.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from urllib.parse import unquote

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # no gRPC probe

import gcsfs.core  # noqa: E402
from gcsfs.retry import validate_response  # noqa: E402


class FakeGcs:
    """Objects by (bucket, key): (generation, bytes); every write a new generation."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], tuple[int, bytes]] = {}
        self.generations = itertools.count(1_700_000_000_000_000)
        self.mutex = threading.Lock()
        self.requests: list[tuple[str, str, dict]] = []

    def handle(self, method: str, url: str, params: dict, data) -> tuple[int, bytes]:
        with self.mutex:
            self.requests.append((method, url, dict(params)))
            return self._handle(method, url, params, data)

    def _handle(self, method, url, params, data):
        if "/upload/storage/v1/b/" in url and method == "POST":
            bucket = url.split("/upload/storage/v1/b/")[1].split("/")[0]
            key = params["name"]
            if (status := self._precondition(bucket, key, params)) is not None:
                return status
            body = data.read() if hasattr(data, "read") else bytes(data)
            gen = next(self.generations)
            self.objects[(bucket, key)] = (gen, body)
            return 200, self._meta(bucket, key)
        bucket, key = self._object(url)
        if method == "GET":
            got = self.objects.get((bucket, key))
            if got is None or ("generation" in params and str(got[0]) != str(params["generation"])):
                return 404, b'{"error": {"code": 404, "message": "No such object"}}'
            if params.get("alt") == "media":
                return 200, got[1]
            return 200, self._meta(bucket, key)
        if method == "DELETE":
            if (bucket, key) not in self.objects:
                return 404, b'{"error": {"code": 404, "message": "No such object"}}'
            if (status := self._precondition(bucket, key, params)) is not None:
                return status
            del self.objects[(bucket, key)]
            return 204, b""
        return 400, b'{"error": {"code": 400, "message": "not emulated"}}'

    def _precondition(self, bucket, key, params):
        want = params.get("ifGenerationMatch")
        if want is None:
            return None
        have = self.objects.get((bucket, key))
        if str(have[0] if have else 0) != str(want):
            return 412, b'{"error": {"code": 412, "message": "conditionNotMet"}}'
        return None

    def _meta(self, bucket, key) -> bytes:
        gen, body = self.objects[(bucket, key)]
        return json.dumps({"bucket": bucket, "name": key, "generation": str(gen),
                           "metageneration": "1", "size": str(len(body))}).encode()

    @staticmethod
    def _object(url: str) -> tuple[str, str]:
        rest = url.split("/storage/v1/b/", 1)[1]
        bucket, _, key = rest.partition("/o/")
        return unquote(bucket), unquote(key.split("?")[0])


class FakeGcsFileSystem(gcsfs.core.GCSFileSystem):
    """gcsfs whose requests go to a FakeGcs (the `store` storage option)."""

    def __init__(self, *args, store: FakeGcs, **kwargs) -> None:
        super().__init__(*args, token="anon", **kwargs)
        self.store = store

    async def _request(self, method, path, *args, headers=None, json=None, data=None,
                       cache_type=None, cache_source=None, **kwargs):
        url = self._format_path(path, args)
        params = {k: v for k, v in self._get_params(kwargs).items() if v is not None}
        status, contents = self.store.handle(method, url, params, data)
        validate_response(status, contents, path, args)
        return status, {}, None, contents
