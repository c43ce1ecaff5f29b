"""The layer table of docs/architecture.md, checked on the source: a module imports only from
its own layer or the layers below it (lazy imports inside functions count too), and
``core/`` and ``server/`` never import torch or triton.

Fails with every offending ``file:line``; an exception needs a reason written below.
"""

import ast
from pathlib import Path
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
