"""One small object that changes only if it is still what its writer last saw: the lease's
storage on an object store.

A check-then-write is a race on an object store: two runs read "no lease", both write, and
each may go on. S3 and GCS have conditional writes that close it:

- S3: PutObject with `If-None-Match: *` (create only if absent) or `If-Match: <ETag>` (replace
  only that version), DeleteObject with `If-Match`; a failed condition is HTTP 412 (409 when
  two conditional writes meet).
- GCS: `ifGenerationMatch=0` (absent) or `=<generation>` on uploads and deletes; 412.

`lease_object` picks the kind for a location's filesystem. Any other filesystem (memory://,
a custom fsspec store; S3 through a botocore too old to send the conditions) gets
PlainObject: unconditional writes, and the lease falls back to writing, waiting and reading
back (output_lock.Lease), which docs/reliability.md says is not safe against two runs
starting within that wait.
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import dataclass
from typing import Any

from specrej_ray.data.dataset import Location


class Conflict(Exception):
    """The object was not what the condition said: another writer got there first."""


@dataclass(frozen=True)
class Version:
    data: dict[str, Any]  # the object's JSON ({} when torn or foreign)
    tag: str | None  # its ETag (S3) or generation (GCS); None where the store has neither


class PlainObject:
    """Unconditional writes (stores without preconditions)."""

    conditional = False

    def __init__(self, out: Location, name: str) -> None:
        self.fs, self.path = out.fs, out.path(name)

    def read(self) -> Version | None:
        try:
            return Version(_json(self.fs.cat_file(self.path)), None)
        except FileNotFoundError:
            return None

    def create(self, data: bytes) -> str | None:
        self.fs.pipe_file(self.path, data)
        return None

    def replace(self, data: bytes, tag: str | None) -> str | None:
        return self.create(data)

    def delete(self, tag: str | None) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path)


class S3Object:
    """Through s3fs's own client: PutObject / DeleteObject with If-None-Match / If-Match."""

    conditional = True

    def __init__(self, out: Location, name: str) -> None:
        self.fs = out.fs
        bucket, key, _ = self.fs.split_path(out.path(name))
        self.where = {"Bucket": bucket, "Key": key}

    def read(self) -> Version | None:
        """Body and ETag from one GET, so they belong together."""
        from fsspec.asyn import sync

        async def get():
            resp = await self.fs._call_s3("get_object", **self.where)
            try:
                return await resp["Body"].read(), resp["ETag"]
            finally:
                resp["Body"].close()

        try:
            body, etag = sync(self.fs.loop, get)
        except FileNotFoundError:
            return None
        return Version(_json(body), etag)

    def create(self, data: bytes) -> str:
        return self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, tag: str | None) -> str:
        return self._put(data, IfMatch=tag)

    def delete(self, tag: str | None) -> None:
        try:
            self.fs.call_s3("delete_object", **self.where, IfMatch=tag)
        except FileNotFoundError:
            return
        except OSError as e:
            _raise_conflict(e)
            raise
        finally:
            self.fs.invalidate_cache(self.where["Bucket"])

    def _put(self, data: bytes, **condition: str | None) -> str:
        try:
            resp = self.fs.call_s3("put_object", **self.where, Body=data, **condition)
        except FileNotFoundError as e:
            if _code(e) == "NoSuchKey":  # If-Match on an object that is gone
                raise Conflict("the lease object is gone") from None
            raise  # no such bucket
        except OSError as e:
            _raise_conflict(e)
            raise
        finally:
            self.fs.invalidate_cache(self.where["Bucket"])
        return resp["ETag"]


def _raise_conflict(e: OSError) -> None:
    """s3fs turns a failed If-None-Match into FileExistsError, and any other 412 (or a 409
    between two conditional writes) into a plain OSError whose cause is botocore's error."""
    if isinstance(e, FileExistsError):
        raise Conflict(str(e)) from None
    code = _code(e)
    if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
        raise Conflict(code) from None


def _code(e: BaseException) -> str:
    """The S3 error code behind an exception s3fs translated (botocore's, on its cause)."""
    response = getattr(e.__cause__, "response", None) or {}
    return str((response.get("Error") or {}).get("Code", ""))


@functools.cache
def _s3_has_conditions() -> bool:
    """Whether this botocore knows PutObject's If-Match and If-None-Match (releases since
    late 2024): s3fs drops the arguments an older one does not know, and the writes would
    quietly be unconditional."""
    try:
        from botocore.loaders import Loader
        from botocore.model import ServiceModel

        model = ServiceModel(Loader().load_service_model("s3", "service-2"))
        members = model.operation_model("PutObject").input_shape.members
        return "IfMatch" in members and "IfNoneMatch" in members
    except Exception:  # botocore missing or changed: not known to be safe
        return False


class GcsObject:
    """Through gcsfs's JSON API calls: uploads and deletes with ifGenerationMatch (0: only if
    absent). gcsfs raises FileExistsError for every 412."""

    conditional = True

    def __init__(self, out: Location, name: str) -> None:
        self.fs = out.fs
        self.bucket, self.key, _ = self.fs.split_path(out.path(name))

    def read(self) -> Version | None:
        """The metadata's generation, then that very generation's bytes (a newer one in
        between: read again)."""
        for _ in range(5):
            try:
                meta = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, json_out=True)
            except FileNotFoundError:
                return None
            gen = str(meta["generation"])
            try:
                body = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, alt="media",
                                    generation=gen)
            except FileNotFoundError:
                continue  # replaced (or removed) between the two calls
            return Version(_json(_payload(body)), gen)
        return None

    def create(self, data: bytes) -> str:
        return self._upload(data, "0")

    def replace(self, data: bytes, tag: str | None) -> str:
        return self._upload(data, tag or "0")

    def delete(self, tag: str | None) -> None:
        try:
            self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key, ifGenerationMatch=tag)
        except FileExistsError:
            raise Conflict("generation changed") from None
        except FileNotFoundError:
            return
        finally:
            self.fs.invalidate_cache(self.bucket)

    def _upload(self, data: bytes, generation: str) -> str:
        try:
            meta = self.fs.call(
                "POST", f"{self.fs._location}/upload/storage/v1/b/{self.bucket}/o",
                uploadType="media", name=self.key, ifGenerationMatch=generation, data=data,
                headers={"Content-Type": "application/json"}, json_out=True)
        except FileExistsError:
            raise Conflict(f"generation is not {generation}") from None
        finally:
            self.fs.invalidate_cache(self.bucket)
        return str(meta["generation"])


def _payload(body: Any) -> bytes:
    """gcsfs returns a call's body as bytes, or as (headers, bytes) from some versions."""
    return body[1] if isinstance(body, tuple) else body


def _json(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError:  # torn or foreign: names no holder
        return {}
    return data if isinstance(data, dict) else {}


def protocols(out: Location) -> set[str]:
    """The names the location's filesystem answers to (fsspec gives a str or a tuple)."""
    proto = out.fs.protocol
    return {proto} if isinstance(proto, str) else set(proto)


def lease_object(out: Location, name: str) -> PlainObject | S3Object | GcsObject:
    """The conditional kind for the location's store, by its filesystem's protocol."""
    if protocols(out) & {"s3", "s3a"} and hasattr(out.fs, "call_s3") and _s3_has_conditions():
        return S3Object(out, name)
    if protocols(out) & {"gs", "gcs"} and hasattr(out.fs, "call"):
        return GcsObject(out, name)
    return PlainObject(out, name)
