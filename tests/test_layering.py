"""The layer table of docs/architecture.md, checked on the source: a module imports only from
its own layer or the layers below it (lazy imports inside functions count too), and
``core/`` and ``server/`` never import torch or triton.

Fails with every offending ``file:line``; an exception needs a reason written below.
"""

import ast
from pathlib import Path

import pytest
from typing import Iterator, List, Tuple

ROOT = Path(__file__).resolve().parents[1] / "cvllm"

RANK = {
    "__init__": 0, "config": 0, "sampling_params": 0, "outputs": 0, "logger": 0, "utils": 0,
    "core": 1, "chat": 2, "distributed": 3, "kernels": 4, "attention": 5, "quantization": 5,
    "layers": 6, "models": 7, "loader": 8, "worker": 9, "engine": 10, "runtime": 11,
    "server": 12, "cli": 13, "cli_options": 13, "__main__": 13,
}
"""docs/architecture.md's layer table ("Layers"), bottom first; one rank per row (attention
and quantization share one)."""

ALLOWED = {
    ("cvllm.distributed.custom_allreduce", "cvllm.kernels"):
        "the custom all-reduce launches its own one-shot kernel; comm.py stays the only caller "
        "of collectives",
}
TORCH_FREE = ("core", "server")


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> Iterator[Tuple[int, str]]:
    """``(line, imported module)`` of every import in ``path`` (the module ``module``),
    relative ones resolved."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                yield node.lineno, ".".join(base + ([node.module] if node.module else []))
            elif node.module:
                yield node.lineno, node.module


def test_imports_go_down_the_layer_table():
    bad: List[str] = []
    for path in sorted(ROOT.rglob("*.py")):
        me_mod = _module_name(path)
        me = _layer(me_mod)
        assert me in RANK, f"{path}: {me!r} is in no row of the layer table"
        for line, target in _imports(path, me_mod):
            if not target.startswith("cvllm"):
                continue
            other = _layer(target)
            if other == me or RANK[other] < RANK[me] or (RANK[me] == 13 and RANK[other] == 13):
                continue
            if any(me_mod == a and target.startswith(b) for a, b in ALLOWED):
                continue
            bad.append(f"{path.relative_to(ROOT.parent)}:{line} ({me}) imports {target} ({other})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_core_and_server_never_import_torch():
    bad = []
    for layer in TORCH_FREE:
        for path in sorted((ROOT / layer).rglob("*.py")):
            for line, target in _imports(path, _module_name(path)):
                if target.split(".")[0] in ("torch", "triton"):
                    bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def test_the_walker_sees_lazy_and_relative_imports(tmp_path):
    """Lazy imports inside functions (the ones that slip through) and relative ones."""
    f = tmp_path / "x.py"
    f.write_text("from ..engine import llm\ndef g():\n    from cvllm.worker import a\n"
                 "    import torch\n")
    found = list(_imports(f, "cvllm.core.x"))
    assert found == [(1, "cvllm.engine"), (3, "cvllm.worker"), (4, "torch")]


def _module_files() -> dict:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolved_imports(path: Path, module: str, modules: dict
                      ) -> Iterator[Tuple[int, str, str, str]]:
    """``(line, module, name, local)`` of every ``from M import name [as local]`` (and
    ``import M as local``, name ``""``) in ``path`` whose module is cvllm's: ``module`` is
    ``M.name`` where that is a module of its own (then name is ``""``), else ``M``."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield node.lineno, alias.name, "", alias.asname or alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1]
                                + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base not in modules:
                continue
            for alias in node.names:
                sub, local = f"{base}.{alias.name}", alias.asname or alias.name
                if sub in modules:
                    yield node.lineno, sub, "", local
                else:
                    yield node.lineno, base, alias.name, local


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_uses_another_modules_private_names():
    """``from cvllm.a.b import _helper`` and ``b._helper`` (``b`` an imported cvllm
    module) across modules: what two modules share is public in its own module."""
    modules = _module_files()
    bad: List[str] = []
    for me, path in modules.items():
        aliases = {}  # local name -> cvllm module it is bound to
        for line, target, name, local in _resolved_imports(path, me, modules):
            if name and _is_private(name) and target != me:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}.{name}")
            if not name:
                aliases[local] = target
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and _is_private(node.attr)
                    and aliases[node.value.id] != me):
                bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} uses "
                           f"{aliases[node.value.id]}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(sorted(set(bad)))


def _folder(module: str) -> str:
    path = ROOT.parent / Path(*module.split("."))
    return module if path.is_dir() else module.rsplit(".", 1)[0]


def test_no_import_cycle_inside_a_folder():
    """Modules of one folder (package) import each other without a circle, lazy imports
    inside functions included: a circle means two modules are one concern or a third
    module is missing."""
    modules = _module_files()
    edges = {m: set() for m in modules}
    for me, path in modules.items():
        for _, target, _name, _local in _resolved_imports(path, me, modules):
            if target != me and _folder(target) == _folder(me):
                edges[me].add(target)
    state, stack, cycles = {}, [], []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles inside a folder:\n" + "\n".join(cycles)


def test_the_checks_see_private_names_and_cycles(tmp_path):
    """The two checks above on a made-up package: each finds what it is for."""
    pkg = tmp_path / "cvllm" / "kernels"
    pkg.mkdir(parents=True)
    (tmp_path / "cvllm" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cvllm.kernels.b import _hidden\n")
    (pkg / "b.py").write_text("from cvllm.kernels import a\n_hidden = a\n")
    (pkg / "c.py").write_text("from cvllm.kernels import b as bb\nx = bb._hidden\n")
    globals_ = globals()
    old = globals_["ROOT"]
    globals_["ROOT"] = tmp_path / "cvllm"
    try:
        with pytest.raises(AssertionError, match=r"kernels/a.py:1 imports cvllm.kernels.b._hidden"):
            test_no_module_uses_another_modules_private_names()
        with pytest.raises(AssertionError, match=r"c.py:2 uses cvllm.kernels.b._hidden"):
            test_no_module_uses_another_modules_private_names()
        with pytest.raises(AssertionError, match=r"cvllm.kernels.a -> cvllm.kernels.b -> cvllm.kernels.a"):
            test_no_import_cycle_inside_a_folder()
    finally:
        globals_["ROOT"] = old
