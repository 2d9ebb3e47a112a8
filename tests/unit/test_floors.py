"""The floors of kvllm: every import runs down (or stays on its floor), and no new circle closes.

A room is a top-level package or module of kvllm (`attention/`, `llm.py`, `__init__.py`). FLOORS
lists the rooms ground first; a module may import from its own room, from another room of its
floor, or from any room below. Every import counts: at module level, inside functions and under
TYPE_CHECKING, since a type-only or lazy import still states a dependency. Strings that name
modules (the backend registry's "module:Class" paths, `python -m` targets) are data, not imports.

Circles between modules are allowed only where ALLOWED_CIRCLES lists them; rooms never import
each other both ways, even two rooms of one floor.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvllm"

FLOORS: tuple[tuple[str, ...], ...] = (
    ("logger", "utils", "forward_context", "sampling_params", "pooling_params", "outputs", "beam_search"),
    ("distributed",),  # tensor-parallel process groups and collectives (torch.distributed only)
    ("config",),  # the vocabulary of user choices, backend names, EngineArgs (no torch)
    ("platforms",),  # DeviceInfo, detection, priority lists (names only)
    ("attention",),
    ("layers",),
    ("models",),
    # scheduling bookkeeping and the message to the worker; sampling; grammars (structured outputs)
    ("core", "sample", "structured_output"),
    ("spec_decode",),  # drafting and verification over the scheduler's steps (the worker runs them)
    ("worker",),
    ("executor",),
    ("engine",),
    ("llm",),
    ("__init__", "v1"),  # the public API and vLLM's import paths
    ("benchmarks",),
    ("entrypoints",),
)

# The return types of AttentionBackend.get_impl_cls / get_builder_cls and the builder's backend
# argument: type-only both ways, inside one room.
ALLOWED_CIRCLES = ({"kvllm.attention.backend", "kvllm.attention.impl"},)


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Module name -> file, for every module of the package."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _room(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _imports(modules: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(importing module, line, imported module) for every kvllm import, resolved to a module."""
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}:{node.lineno}: use absolute imports"
                base = node.module or ""
                # `from kvllm.attention import registry` imports the module kvllm.attention.registry.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if target == "kvllm" or target.startswith("kvllm."):
                    while target not in modules:  # `import kvllm.a.b` names a module; keep its package
                        target = target.rpartition(".")[0]
                    found.append((module, node.lineno, target))
    return found


def _floor_of() -> dict[str, int]:
    return {room: i for i, rooms in enumerate(FLOORS) for room in rooms}


def test_every_room_has_a_floor() -> None:
    rooms = {_room(m) for m in _modules()}
    unplaced = sorted(rooms - set(_floor_of()))
    assert not unplaced, f"rooms with no floor in FLOORS: {unplaced}; place them"
    missing = sorted(set(_floor_of()) - rooms)
    assert not missing, f"FLOORS names rooms that do not exist: {missing}"


def test_imports_run_down_the_floors() -> None:
    modules, floor = _modules(), _floor_of()
    upward = []
    for module, line, target in _imports(modules):
        here, there = _room(module), _room(target)
        if here != there and floor[there] > floor[here]:
            path = modules[module].relative_to(PACKAGE.parent)
            upward.append(f"{path}:{line}: {module} -> {target} ({here} stands below {there})")
    assert not upward, "imports that run up the floors:\n" + "\n".join(upward)


def test_no_two_rooms_import_each_other() -> None:
    edges = defaultdict(list)
    for module, line, target in _imports(_modules()):
        if _room(module) != _room(target):
            edges[(_room(module), _room(target))].append(f"{module}:{line} -> {target}")
    both_ways = [
        f"{a} <-> {b}: {edges[(a, b)][0]} / {edges[(b, a)][0]}"
        for a, b in sorted(edges)
        if a < b and (b, a) in edges
    ]
    assert not both_ways, "rooms that import each other:\n" + "\n".join(both_ways)


def _circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(component)
    return circles


def test_no_new_circles() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for module, _, target in _imports(_modules()):
        if module != target:
            edges[module].add(target)
            edges[target]
    new = [sorted(c) for c in _circles(edges) if c not in ALLOWED_CIRCLES]
    assert not new, f"modules that import each other in a circle: {new}"


def test_the_checker_sees_lazy_and_type_only_imports_and_circles(tmp_path: Path) -> None:
    files = {
        "__init__.py": "",
        "engine/__init__.py": "",
        "engine/core.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvllm.worker import runner\n",
        "worker/__init__.py": "",
        "worker/runner.py": "def f():\n    from kvllm.engine.core import X\n    import kvllm.engine\n",
    }
    for name, text in files.items():
        (tmp_path / "kvllm" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "kvllm" / name).write_text(text)
    found = _imports(_modules(tmp_path / "kvllm"))
    assert found == [
        ("kvllm.engine.core", 3, "kvllm.worker.runner"),
        ("kvllm.worker.runner", 2, "kvllm.engine.core"),
        ("kvllm.worker.runner", 3, "kvllm.engine"),
    ]
    edges: dict[str, set[str]] = defaultdict(set)
    for module, _, target in found:
        edges[module].add(target)
        edges[target]
    assert _circles(edges) == [{"kvllm.engine.core", "kvllm.worker.runner"}]
