"""What a run may do at output.path: use it only when it is empty or ours, and never read,
write or delete through a link or outside it.

A directory is ours only when its `manifest.json` says so: a JSON object with our format
marker (`"format": "specrej-ray-output"`) and a layout version, written by the run that made
the results. File names prove nothing: a user's own `run.json` or `manifest.json` is theirs.
The manifest also lists every top-level name the runs wrote (`files`), and `--overwrite`
removes those and nothing else. Two older kinds are still recognised by their content: a
manifest of layout 2 written before the marker (a fingerprint and a spec; it owns the names
such a run could write), and a torn manifest whose shard records are whole (rebuilt).

`survey()` decides before anything is written, and again under the output's lock.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from specrej_ray.data.dataset import OUR_FILES, Location, write_atomic
from specrej_ray.data.output_lock import LEASE_FILE, LOCK_FILE, take_lock
from specrej_ray.errors import OutputError

FORMAT = "specrej-ray-output"
LAYOUT = 2  # 2 = per-shard records keyed by prompt content
MANIFEST = "manifest.json"
SHARDS = "shards"
REPORT = "report.html"
LOCKS = frozenset({LOCK_FILE, LEASE_FILE})
TUNE, TUNE_FILES = "tune", frozenset({"tune.json", "tune.png"})  # tune's default --out
# What a layout-2 run written before the `files` list could have put at the top.
LEGACY_FILES = frozenset({*OUR_FILES, REPORT})
# Our temp names (dataset.tmp_name) and a shard's three files (output._shard_file).
_TEMP = re.compile(r"^\..+\.tmp-\d+-[0-9a-f]+$")
_SHARD_FILE = re.compile(r"^[^.][^/]*\.(json|best\.parquet|candidates\.parquet)$")


def is_temp(name: str) -> bool:
    return bool(_TEMP.match(name))


def is_shard_file(name: str) -> bool:
    return bool(_SHARD_FILE.match(name)) or is_temp(name)


@dataclass
class Survey:
    """What output.path holds: nothing, or results of ours (by their manifest)."""

    names: set[str] = field(default_factory=set)  # top-level names, lock files aside
    manifest: dict[str, Any] | None = None  # parsed and ours
    torn: bool = False  # ours, but manifest.json is unreadable: the shard records say so

    @property
    def ours(self) -> bool:
        return self.manifest is not None or self.torn

    def owned(self) -> set[str]:
        """The top-level names our runs wrote here (what --overwrite may remove)."""
        if self.manifest is not None and isinstance(self.manifest.get("files"), list):
            listed = {n for n in self.manifest["files"] if isinstance(n, str)}
        else:
            listed = set(LEGACY_FILES)
        return (listed | {MANIFEST}) & self.names


def survey(out: Location) -> Survey:
    """Refuse (one line, OutputError) anything a run must not touch: a path that is not a
    directory, a non-empty directory that is not ours, a link or a file where a folder
    belongs. Reads only; writes nothing."""
    fs = out.fs
    fs.invalidate_cache(out.root)
    if not fs.exists(out.root):
        return Survey()
    if not fs.isdir(out.root):
        raise OutputError(f"output.path: {out} exists and is not a directory; choose a new or "
                          "empty path")
    local = isinstance(fs, LocalFileSystem)
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(out.root, detail=False)} - LOCKS
    found = Survey(names)
    if MANIFEST in names:
        if local:
            _check_tree(out)  # no manifest or shard record read through a link
        found.manifest, found.torn = _read_manifest(out)
        if found.torn and not _has_records(out):
            found.torn = False
    if found.ours or not {n for n in names if not is_temp(n)} - _tune_results(out, names):
        if local:
            _check_tree(out)
        return found
    # A folder that is not ours is refused as such, whatever it holds: its links said
    # `/proc/1/cwd is a symbolic link` of output.path=/proc/1.
    why = ("its manifest.json is not one specrej-ray wrote" if MANIFEST in names
           else "it has no manifest.json of specrej-ray's")
    raise OutputError(f"output.path: {out} is a non-empty directory that specrej-ray did not "
                      f"write ({why}); choose a new or empty path")


def _tune_results(out: Location, names: set[str]) -> set[str]:
    """{"tune"} where output.path/tune is `specrej-ray tune`'s default folder, holding only
    what tune writes (tune.json, by its keys, and tune.png): a run may start beside it. It
    stays tune's: the manifest does not list it, so --overwrite never removes it."""
    if TUNE not in names or not isinstance(out.fs, LocalFileSystem):
        return set()
    folder = os.path.join(out.root, TUNE)
    if os.path.islink(folder) or not os.path.isdir(folder):
        return set()
    if "tune.json" not in (held := set(os.listdir(folder))) or not held <= TUNE_FILES:
        return set()
    try:
        with open(os.path.join(folder, "tune.json"), "rb") as fh:
            data = json.loads(fh.read(1 << 26))
    except (OSError, ValueError, UnicodeDecodeError):
        return set()
    return {TUNE} if isinstance(data, dict) and {"settings", "results"} <= set(data) else set()


def _read_manifest(out: Location) -> tuple[dict[str, Any] | None, bool]:
    """(the manifest if ours, whether it is torn: not JSON at all)."""
    try:
        data = json.loads(out.fs.cat_file(out.path(MANIFEST)))
    except (ValueError, UnicodeDecodeError):
        return None, True
    return (data if is_ours(data) else None), False


def is_ours(data: Any) -> bool:
    """A manifest we wrote: the marker, or (before it) a fingerprint and a spec."""
    if not isinstance(data, dict):
        return False
    if data.get("format") == FORMAT:
        return isinstance(data.get("layout"), int)
    return isinstance(data.get("fingerprint"), str) and isinstance(data.get("spec"), dict)


def _has_records(out: Location) -> bool:
    """A whole shard record of ours under shards/ (what a torn manifest is rebuilt from)."""
    root = out.path(SHARDS)
    if not out.fs.isdir(root):
        return False
    for path in out.fs.ls(root, detail=False):
        if not path.endswith(".json") or is_temp(path.rsplit("/", 1)[-1]):
            continue
        try:
            record = json.loads(out.fs.cat_file(path))
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and {"fingerprint", "prompts", "files"} <= set(record):
            return True
    return False


def _check_tree(out: Location) -> None:
    """No link at the top or in shards/, and each of our names of the kind we write there."""
    shards = None
    for entry in os.scandir(out.root):
        kind = _kind(entry)
        if kind == GONE:
            continue
        if kind == "link":
            _refuse_link(out, entry.name)
        if entry.name == SHARDS:
            if kind != "folder":
                raise OutputError(f"output.path: {out.url_of(SHARDS)} is a {kind}, where "
                                  "specrej-ray keeps its shards folder; move it away or choose "
                                  "another output.path")
            shards = entry.path
        elif entry.name in LEGACY_FILES and kind != "file":
            raise OutputError(f"output.path: {out.url_of(entry.name)} is a {kind}, where "
                              "specrej-ray writes a file; move it away or choose another "
                              "output.path")
    if shards is None:
        return
    try:
        entries = list(os.scandir(shards))
    except FileNotFoundError:  # removed meanwhile (another run's --overwrite)
        return
    for entry in entries:
        kind = _kind(entry)
        if kind == GONE:
            continue
        if kind == "link":
            _refuse_link(out, f"{SHARDS}/{entry.name}")
        if kind != "file":
            raise OutputError(f"output.path: {out.url_of(SHARDS + '/' + entry.name)} is a "
                              f"{kind} inside specrej-ray's shards folder; move it away")


# What _kind says of a name that went between the listing and the look: a temp file
# published, or another run's --overwrite removing a folder. Nothing there to refuse (a
# "file" here once refused a racing run's shards/ folder as a file).
GONE = "gone"


def _kind(entry: os.DirEntry) -> str:
    try:
        mode = entry.stat(follow_symlinks=False).st_mode
    except FileNotFoundError:
        return GONE
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "folder"
    return "file" if stat.S_ISREG(mode) else "special file"


def _refuse_link(out: Location, name: str) -> None:
    raise OutputError(f"output.path: {out.url_of(name)} is a symbolic link; specrej-ray never "
                      "reads or writes through links inside its output: put the real file or "
                      "folder there, or choose another output.path")


def inside(out: Location, path: str) -> str:
    """`path`, after checking it names an entry inside the output (real paths, no link on
    the way): nothing outside output.path is ever removed or replaced through it."""
    if not isinstance(out.fs, LocalFileSystem):
        return path  # object stores have no links
    root = os.path.realpath(out.root)
    parent = os.path.realpath(os.path.dirname(path))
    if os.path.islink(path) or os.path.commonpath([root, parent]) != root:
        raise OutputError(f"output.path: {path} is a link or lies outside {out}; specrej-ray "
                          "never writes through links: remove it, then run again")
    return path


def remove_owned(out: Location, names: set[str]) -> None:
    """Remove what our runs wrote at these top-level names: files, and of shards/ only our
    shard files (the folder too, once empty). Anything else stays."""
    fs = out.fs
    for name in sorted(names):
        path = inside(out, out.path(name))
        if name != SHARDS:
            fs.rm(path)
            continue
        fs.invalidate_cache(path)
        for child in fs.ls(path, detail=False):
            if is_shard_file(child.rstrip("/").rsplit("/", 1)[-1]):
                fs.rm(inside(out, child))
        fs.invalidate_cache(path)
        if isinstance(fs, LocalFileSystem) and not fs.ls(path, detail=False):
            fs.rmdir(path)  # object stores have no empty folders


def write_report(out: Location, page: str) -> None:
    """`report`'s page as report.html in the output: in one of ours, listed in the manifest
    first and written under the output's lock (an --overwrite then removes it with the data
    it shows); always whole, by a rename that replaces a link instead of writing through it."""
    if not out.fs.exists(out.path(MANIFEST)):
        write_atomic(out, REPORT, page.encode())  # not ours: nothing lists its files
        return
    survey(out)  # no link or foreign manifest
    with take_lock(out, "report"):
        manifest, _ = _read_manifest(out)
        files = manifest.get("files") if manifest else None
        if isinstance(files, list) and REPORT not in files:  # (a manifest of before the
            manifest["files"] = sorted({*files, REPORT})  # list owns report.html anyway)
            write_atomic(out, MANIFEST, json.dumps(manifest, indent=1).encode())
        write_atomic(out, REPORT, page.encode())
