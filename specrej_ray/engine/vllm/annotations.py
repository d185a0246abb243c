"""A type annotation written as a string, resolved without running it.

vLLM writes a few of EngineArgs' field types as strings. `eval()` would run whatever such a
string holds; here the string is parsed and only the forms an annotation takes are resolved,
from the names of the module that wrote it: names, dotted attributes, subscripts
(`dict[str, Any]`, `Literal['a', 'b']`), unions with `|`, `None` and quoted forward
references. Anything else (a call, an operator, a lambda) is refused with ValueError, as is
a name the module does not hold (one imported for type checkers only).
"""

from __future__ import annotations

import ast
import builtins
import typing
from typing import Any

_LITERALS = {typing.Literal}  # subscripts whose strings are values, not forward references


def resolve(text: str, namespace: dict[str, Any]) -> Any:
    """The type `text` names in `namespace` (ValueError: not an annotation, or unknown)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError(f"not an annotation: {text!r}") from None
    return _resolve(node, namespace)


def _resolve(node: ast.AST, ns: dict[str, Any]) -> Any:
    match node:
        case ast.Constant(value=None):
            return None
        case ast.Constant(value=str() as quoted):  # a forward reference
            return resolve(quoted, ns)
        case ast.Name(id=name):
            if name in ns:
                return ns[name]
            if hasattr(builtins, name):
                return getattr(builtins, name)
            raise ValueError(f"unknown name {name!r}")
        case ast.Attribute(value=value, attr=attr) if not attr.startswith("_"):
            try:
                return getattr(_resolve(value, ns), attr)
            except AttributeError:
                raise ValueError(f"unknown attribute {attr!r}") from None
        case ast.BinOp(left=left, op=ast.BitOr(), right=right):
            return _resolve(left, ns) | _resolve(right, ns)
        case ast.List(elts=elts):  # Callable[[args], result]
            return [_resolve(e, ns) for e in elts]
        case ast.Subscript(value=value, slice=index):
            base = _resolve(value, ns)
            parts = index.elts if isinstance(index, ast.Tuple) else [index]
            if any(base is literal for literal in _LITERALS):
                args = tuple(_literal(p) for p in parts)
            else:
                args = tuple(_resolve(p, ns) for p in parts)
            return base[args if len(args) > 1 else args[0]]
    raise ValueError(f"not an annotation: {ast.unparse(node)!r}")


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    raise ValueError(f"not a literal value: {ast.unparse(node)!r}")
