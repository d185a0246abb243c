"""Reading a spec: YAML (size- and alias-bounded, unique keys), --set overrides,
validation with one line per error, and relative paths."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    ValidationError,
)

from specrej_ray.spec.base import SpecError
from specrej_ray.spec.job import JobSpec


def _format_error(source: str, err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    loc = loc.replace(".literal['memory','auto']", "").replace(".TokensSchedule", "")
    if err["type"] == "extra_forbidden":
        return f"{source}: {loc}: unknown key; check the spelling (see docs/spec.md)"
    if err["type"] == "missing":
        return f"{source}: {loc}: required field is missing"
    if err["type"] == "finite_number":
        return f"{source}: {loc}: must be a finite number, not .inf or .nan"
    msg = err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
    prefix = f"{loc}: " if loc else ""
    return f"{source}: {prefix}{msg}{shown}"


def _dedupe_schedule_errors(errors: list[dict[str, Any]], data: Any) -> list[dict[str, Any]]:
    """A bad schedule fails both union arms; report only the arm the user was writing."""
    schedule = (
        data.get("search", {}).get("schedule") if isinstance(data.get("search"), dict) else None
    )
    wrote_literal = isinstance(schedule, str)

    def wrong_arm(e: dict[str, Any]) -> bool:
        loc = [str(p) for p in e["loc"]]
        if "schedule" not in loc:
            return False
        is_literal_arm = any(p.startswith("literal") for p in loc)
        return is_literal_arm != wrote_literal

    return [e for e in errors if not wrong_arm(e)]


# A spec is a few KB of YAML: past these it is a mistake (or an attack), refused in one line
# before it costs minutes and gigabytes.
MAX_SPEC_BYTES = 1 << 20
MAX_SPEC_NODES = 100_000  # after aliases are expanded: a billion-laughs spec has 10^9


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges may be overridden on purpose
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # unhashable: the base class reports it
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first}); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, source: str) -> Any:
    """The YAML document, refused if its aliases expand past MAX_SPEC_NODES (the expanded
    size is what validation, fingerprints and run.json would walk)."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            size = _expanded_size(node, {}, set())
        except SpecError as e:
            raise SpecError(f"{source}: {e}") from None
        if size > MAX_SPEC_NODES:
            raise SpecError(f"{source}: its aliases expand to over {MAX_SPEC_NODES:,} values; "
                            "a job spec is small: write the values out")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, memo: dict[int, int], open_: set[int]) -> int:
    """Nodes in the document once every alias is replaced by what it names (capped just
    past the limit, so a bomb is not counted to the end)."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in open_:
        raise SpecError("a YAML alias refers to itself; write the values out")
    open_.add(key)
    size = 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    for child in children:
        size += _expanded_size(child, memo, open_)
        if size > MAX_SPEC_NODES:
            break
    open_.discard(key)
    memo[key] = size
    return size


def _read_spec_text(path: Path) -> str:
    """The spec file's text: a regular file of at most MAX_SPEC_BYTES (a device or a FIFO
    would be read forever)."""
    try:
        # Asked before opening: opening a FIFO blocks until something writes to it.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise SpecError(f"{path}: not a regular file; give a YAML job spec")
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError(f"{path}: cannot read job spec ({e.strerror})") from None
    if len(raw) > MAX_SPEC_BYTES:
        size = os.path.getsize(path)
        raise SpecError(f"{path}: job spec is {size:,} bytes, over the {MAX_SPEC_BYTES >> 20} "
                        "MiB limit; a spec is a small YAML file (prompts go in prompts.path)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(
            f"{path}: not a text file (byte {e.start} is not UTF-8); give a YAML job spec"
        ) from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line for any PyYAML error: its problem (or reason) and line, never its excerpt."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}" if mark else ""
    what = getattr(e, "problem", None) or getattr(e, "reason", None) or type(e).__name__
    return f"{where}: {' '.join(str(what).split())}"


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set data['a']['b'] = value for 'a.b', creating sections as needed."""
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        if not isinstance(child, dict):
            raise SpecError(f"--set {dotted}: {k} is not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'search.alpha=0.7' -> ('search.alpha', 0.7); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise SpecError(f"--set {text!r}: expected KEY=VALUE, e.g. search.alpha=0.7")
    try:
        value = _load_yaml(raw, f"--set {key}") if raw.strip() else ""
    except RecursionError:
        raise SpecError(f"--set {key}: value is nested too deeply") from None
    except yaml.YAMLError as e:
        raise SpecError(f"--set {key}: value is not valid YAML{_yaml_problem(e)}") from None
    return key.strip(), value


def validate_spec(data: Any, source: str = "<spec>") -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(
            f"{source}: a job spec must be a YAML mapping with sections prompts, generator, ..."
        )
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        errors = _dedupe_schedule_errors(e.errors(), data)
        if isinstance(data.get("reward"), dict):  # written as one mapping: no list index
            for err in errors:
                if err["loc"][:2] == ("reward", 0):
                    err["loc"] = ("reward", *err["loc"][2:])
        raise SpecError("\n".join(_format_error(source, err) for err in errors)) from None


def load_spec(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Read, override and validate a job spec; relative paths resolve from the spec's folder."""
    path = Path(path)
    text = _read_spec_text(path)
    try:
        data = _load_yaml(text, str(path))
    except RecursionError:
        raise SpecError(f"{path}: nested too deeply; a job spec is a few levels deep") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML{_yaml_problem(e)}") from None
    data = {} if data is None else data
    if isinstance(data, dict):
        try:
            for item in overrides or []:
                set_dotted(data, *parse_override(item))
        except SpecError as e:  # every line names the spec file, as validation errors do
            raise SpecError(f"{path}: {e}") from None
    spec = validate_spec(data, str(path))
    return _resolve_relative_paths(spec, path.parent)


def _resolve_relative_paths(spec: JobSpec, base: Path) -> JobSpec:
    """Prompt and output paths are relative to the current directory, as users expect from CLIs;
    a prompt path that only exists relative to the spec file is taken from there."""
    spec.prompts.path = _from_spec_folder(spec.prompts.path, base)
    if spec.iterate is not None:  # a round's prompt files, likewise
        spec.iterate.prompts.paths = [_from_spec_folder(x, base)
                                      for x in spec.iterate.prompts.paths]
    return spec


def _from_spec_folder(path: str, base: Path) -> str:
    p = Path(path).expanduser()
    if not p.is_absolute() and not _exists(p) and _exists(base / p):
        return str(base / p)
    return path


def _exists(path: Path) -> bool:
    # An over-long name raises instead of answering; prompts.py reports the path.
    try:
        return path.exists()
    except (OSError, ValueError):
        return False
