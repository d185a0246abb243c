"""Where an output may be: on a filesystem that holds files, and neither inside another
specrej-ray output nor around one. Reads only; refuses in one line (OutputError).

Inside: every folder above output.path (its real path, links resolved) up to the
filesystem's root, or an object store's bucket, is asked for a manifest.json of ours: one
look a level, so the walk costs a few stats (a few HEAD requests on a store). An output
made in another's shards/ made that one unresumable, and one made anywhere below it would be
removed by nothing and listed by nothing.

Around: a folder that holds another output below it is non-empty, and the guard
(output_guard.survey) already refuses a non-empty folder that is not ours, however deep the
other output lies. What is left is an output of ours that holds one in a top-level folder
(made there before this check existed, or moved in): its top-level folders are asked, one
level down only. Looking deeper would read a tree of unbounded size, and below a folder of
ours that is not ours a run never reads or removes anything.
"""

from __future__ import annotations

import json
import os
import posixpath
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from specrej_ray.data.dataset import Location
from specrej_ray.data.output_guard import MANIFEST, SHARDS, TUNE, is_ours
from specrej_ray.errors import OutputError

# Kernel filesystems: a folder there holds the kernel's entries, never a user's files (a
# run as root gets past the permission check and fails at its first mkdir or write).
KERNEL_FILESYSTEMS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs",
    "pstore", "bpf", "efivarfs", "devpts", "mqueue", "fusectl", "binfmt_misc", "nsfs",
    "selinuxfs", "rpc_pipefs",
})
_MOUNTS = "/proc/self/mountinfo"
_MANIFEST_LIMIT = 64 << 20  # a manifest holds a spec: far less; more is not ours


def check_filesystem(path: str, out: Location) -> None:
    """Refuse a local output whose nearest existing folder `path` is on a kernel filesystem
    (/proc, /sys, ...)."""
    kind = filesystem_type(path)
    if kind in KERNEL_FILESYSTEMS:
        what = "write to" if os.path.abspath(path) == os.path.abspath(out.root) else "create"
        raise OutputError(f"output.path: cannot {what} {out}: {path} is on the kernel's {kind} "
                          "filesystem, which holds no files of a user; choose another location")


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem mounted where `path` (an existing local path) lies, from
    /proc/self/mountinfo; None where that cannot be read (not Linux)."""
    real = os.path.realpath(path)
    best, kind = -1, None
    try:
        with open(_MOUNTS, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if " - " not in line or len(fields) < 5:
                    continue
                point = _unescape(fields[4])
                after = line.split(" - ", 1)[1].split()
                if after and _under(real, point) and len(point) >= best:  # the last mount wins
                    best, kind = len(point), after[0]
    except OSError:
        return None
    return kind


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline and backslash in octal (\\040 ...)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _under(path: str, folder: str) -> bool:
    return folder == "/" or path == folder or path.startswith(folder.rstrip("/") + "/")


def check_not_nested(out: Location) -> None:
    """Refuse output.path inside another output of ours, or an output of ours holding one in
    a top-level folder (see the module doc for how far each look goes)."""
    fs = out.fs
    local = isinstance(fs, LocalFileSystem)
    root = os.path.realpath(out.root) if local else out.root.rstrip("/")
    parent, shown = posixpath.dirname(root), out.url.rstrip("/")
    while parent and parent != root:
        shown = posixpath.dirname(shown)  # the user's spelling of a URL, a level up
        if _holds_output(fs, parent):
            raise OutputError(f"output.path: {out} is inside {parent if local else shown}, "
                              "the output of another specrej-ray run; choose a path outside "
                              "it")
        root, parent = parent, posixpath.dirname(parent)
    _check_none_below(out)


def _check_none_below(out: Location) -> None:
    fs = out.fs
    if not (fs.isdir(out.root) and _holds_output(fs, out.root)):
        return  # not ours: the guard refuses it if it holds anything at all
    for entry in fs.ls(out.root, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if entry.get("type") == "directory" and name not in (SHARDS, TUNE) \
                and _holds_output(fs, entry["name"].rstrip("/")):
            raise OutputError(f"output.path: {out} holds another specrej-ray output in "
                              f"{out.url_of(name)}; move that one out first, or choose "
                              "another output.path")


def _holds_output(fs, folder: str) -> bool:
    """`folder` holds a manifest.json of ours (a torn one, unreadable, counts: its shard
    records make it ours, output_guard)."""
    path = posixpath.join(folder, MANIFEST)
    try:
        if not fs.isfile(path):
            return False
        if fs.size(path) > _MANIFEST_LIMIT:
            return False
        data = fs.cat_file(path)
    except (OSError, ValueError):
        return False
    try:
        return is_ours(json.loads(data))
    except (ValueError, UnicodeDecodeError):
        return fs.isdir(posixpath.join(folder, SHARDS))



def side_folder(out: str | None, output_path: str, name: str, command: str,
                error: type[Exception]) -> Path:
    """Where a command that writes local files beside a job's output writes them (`tune`,
    `evaluate`): `--out`, else <output.path>/<name>; an object store's output.path has no
    local folder, so there `--out` is needed (`error`, one line)."""
    if out:
        return Path(out).expanduser()
    if "://" in output_path:
        raise error(f"output.path is a URL ({output_path}); {command} writes local files: "
                    "pass --out DIR")
    return Path(output_path).expanduser() / name
