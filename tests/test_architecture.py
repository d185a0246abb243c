"""The package layout holds (docs/architecture.md): Ray lives in distributed/ alone, and all of
distributed/ is Ray; imports go down the layers, never up, and never round in a cycle, counting
every import statement of specrej_ray/ and bench/, those inside functions included."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "specrej_ray"

# Each room may import its own layer and the ones below it, never one above. A room's layer
# is where it stands on the path of a job: spec -> job core -> distributed -> engine,
# rewards -> data; the commands on top.
LAYERS: list[set[str]] = [
    {"errors", "numbers", "figures", "search"},  # leaves: no other room
    {"spec", "models", "engine", "reward"},
    {"data", "quality"},
    {"job", "train"},
    {"distributed", "report"},
    {"benchmark", "tune", "evaluate", "iterate"},
    {"cli", "__main__"},
]
TOP_LEVEL_MODULES_AT_MOST = 6


def _modules(root: Path = PACKAGE) -> dict[str, ast.Module]:
    """The modules under `root` by dotted name (a package by its own name), parsed; the
    trees are shared, so no test changes them."""
    return _parsed(root)


@functools.cache  # once a process: five tests read the package
def _parsed(root: Path) -> dict[str, ast.Module]:
    out = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _layer(room: str) -> int:
    return next(i for i, rooms in enumerate(LAYERS) if room in rooms)


def _imports(tree: ast.Module, top_only: bool) -> list[str]:
    """The specrej_ray modules (and `ray`) a module imports: all, or those at module level."""
    nodes = tree.body if top_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            found += [f"{base}.{a.name}" if base == "specrej_ray" else base for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


def test_every_room_has_a_layer_and_the_top_level_is_small():
    rooms = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if p.suffix == ".py" or (p / "__init__.py").exists()} - {"__init__"}
    assert rooms <= set().union(*LAYERS), rooms - set().union(*LAYERS)
    top = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= TOP_LEVEL_MODULES_AT_MOST, top


def test_no_import_points_up_a_layer():
    up = []
    for name, tree in _modules().items():
        for target in _imports(tree, top_only=False):
            if target.startswith("specrej_ray.") and _layer(_room(target)) > _layer(_room(name)):
                up.append(f"{name} -> {target}")
    assert not up, "\n".join(up)


def _targets(name: str, tree: ast.Module, known: set[str], is_package: bool) -> set[str]:
    """The modules of `known` that module `name` imports anywhere in its code: for `from a.b
    import c`, a.b and a.b.c if that is a module (a relative import resolved from the
    module's package), each the nearest module of `known` at or above it. A module's own
    packages are not counted: Python has loaded them before it."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in names:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def _import_graph(root: Path) -> dict[str, set[str]]:
    mods = _modules(root)
    packages = {m.rpartition(".")[0] for m in mods}  # a module with modules below is a package
    return {name: _targets(name, tree, set(mods), name in packages) for name, tree in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected parts of more than one module (Tarjan): each holds a
    cycle, and every cycle lies in one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("root", ["specrej_ray", "bench"])
def test_no_import_cycle_at_any_level(root):
    cycles = _cycles(_import_graph(REPO / root))
    assert not cycles, [" <-> ".join(c) for c in cycles]


def test_only_distributed_imports_ray_at_module_level():
    found = [name for name, tree in _modules().items() if _room(name) != "distributed"
             and any(t == "ray" or t.startswith("ray.") for t in _imports(tree, top_only=True))]
    assert not found, found


def _ray_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name.split(".")[0] == "ray"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray":
            names |= {a.asname or a.name for a in node.names}
    return names


def _uses(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def _imports_ray(node: ast.AST) -> bool:
    """A lazy import of Ray inside a definition."""
    return any((isinstance(n, ast.Import) and any(a.name.split(".")[0] == "ray" for a in n.names))
               or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "ray")
               for n in ast.walk(node))


def _ray_defs(tree: ast.Module) -> tuple[dict[str, ast.AST], set[str]]:
    """A module's definitions, and which of them are Ray: they use Ray (a Ray name, a lazy
    import of it, or a Ray definition of the module), or Ray code of the module uses them."""
    defs = {n.name: n for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    ray = _ray_names(tree)
    values = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)}  # module-level objects
    grew = True
    while grew:
        grew = False
        for var, value in values.items():
            if var not in ray and _uses(value, ray):
                ray.add(var)
                grew = True
        for def_name, node in defs.items():
            if def_name in ray:
                continue
            serves = any(other in ray and _uses(defs[other], {def_name})
                         for other in defs if other != def_name)
            if _uses(node, ray) or _imports_ray(node) or serves:
                ray.add(def_name)
                grew = True
    return defs, ray & set(defs)


def test_distributed_holds_nothing_ray_free():
    """Every class and function defined in distributed/ is Ray code or a piece of it (a
    helper or record that Ray code uses, in its module, or from a module of Ray code). A
    module with no Ray at all, or a definition nothing of Ray uses, belongs in the job, data
    or quality rooms, where tests reach it without a cluster."""
    mods = {n: t for n, t in _modules().items()
            if _room(n) == "distributed" and n != "specrej_ray.distributed"}
    found = {name: _ray_defs(tree) for name, tree in mods.items()}
    ray_code = [node for defs, ray in found.values() for d, node in defs.items() if d in ray]
    ray_free = [f"{name}.{d}" for name, (defs, ray) in found.items() for d in defs
                if d not in ray and not (ray and any(_uses(n, {d}) for n in ray_code))]
    assert not ray_free, ray_free


# The KV slot tables (issue 57): the block manager's state, changed by its own code alone, at
# the scheduler's request alone. A prompt, the runner and the pool only read what it hands out.
BLOCK_MANAGER = "specrej_ray.engine.hf.block_manager"
SCHEDULER = "specrej_ray.engine.hf.scheduler"
TABLE_STATE = {"_groups", "_prefixes", "_free", "_refs", "_capacity", "_grown"}
MUTATORS = {"add_prefix", "drop_prefix", "add_group", "fork", "drop_group", "keep_rows",
            "clear", "step", "set_limit", "take_growth", "_alloc", "_release", "_grow",
            "_writable"}


def _holders(tree: ast.Module) -> set[str]:
    """Names and attributes this module binds to a BlockManager (`x = BlockManager()`,
    `self.blocks = BlockManager(...)`), and `blocks`, what the scheduler calls its own."""
    found = {"blocks"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                getattr(node.value.func, "id", None) == "BlockManager":
            for t in node.targets:
                found.add(t.id if isinstance(t, ast.Name) else getattr(t, "attr", ""))
    return found


def slot_table_changes(name: str, tree: ast.Module) -> list[str]:
    """Where a module other than the block manager touches its state, or one other than the
    scheduler asks it to change (a mutator called on something holding one)."""
    found = []
    holders = _holders(tree)

    def held(owner: ast.AST) -> bool:
        return (isinstance(owner, ast.Name) and owner.id in holders) or \
            (isinstance(owner, ast.Attribute) and owner.attr in holders)

    for node in ast.walk(tree):
        if name != BLOCK_MANAGER and isinstance(node, ast.Attribute) and \
                node.attr in TABLE_STATE and held(node.value):
            found.append(f"{name}:{node.lineno} .{node.attr}")
        if name in (BLOCK_MANAGER, SCHEDULER) or not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in MUTATORS and held(f.value):
            found.append(f"{name}:{node.lineno} .{f.attr}()")
        if isinstance(f, ast.Name) and f.id == "BlockManager":
            found.append(f"{name}:{node.lineno} BlockManager()")
    return found


def test_only_the_block_manager_changes_the_slot_tables_and_only_the_scheduler_asks():
    found = [hit for name, tree in _modules().items() for hit in slot_table_changes(name, tree)]
    assert not found, found


@pytest.mark.parametrize("source", [
    "def f(self):\n    self.scheduler.blocks.keep_rows(0, [])\n",
    "def f(engine):\n    engine.scheduler.blocks._groups.clear()\n",
    "from x import BlockManager\nb = BlockManager()\nb.step([])\n",
    "def f(blocks):\n    blocks._refs[0] = 3\n",
])
def test_the_slot_table_check_catches_a_change_from_elsewhere(source):
    assert slot_table_changes("specrej_ray.engine.hf.prompt_state", ast.parse(source))
