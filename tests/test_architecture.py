"""The import graph of taco_jax/ is one-way: floors util -> codec -> kernels -> collectives -> parallel ->
models (and data) -> perf -> testing -> train -> cli (with launch and emulate); a floor imports only its own floor
and lower ones, and no module-level import cycle.

The order is the measured one (0 upward imports): `util` imports nothing of taco_jax; `perf` (the cost
model) imports codec, collectives and models; `testing` (fault injection) imports only util; `train`
imports perf (`--min-bytes auto`, plan) and testing (faults fired by the loop, checkpoints and the
watchdog); cli, launch and emulate sit on top (launch starts `train` processes in emulate's
namespaces). perf and testing import neither each other nor train, so each gets its own floor below
train; `data` imports nothing of taco_jax and sits with the models.

Read from the source with `ast` (nothing is imported); imports inside functions count too, so a lazy
import cannot hide an arrow that runs back up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "taco_jax"
#: Lowest floor first (the measured order: the module docstring).
FLOORS = {"util": 0, "codec": 1, "kernels": 2, "collectives": 3, "parallel": 4, "models": 5, "data": 5, "perf": 6,
          "testing": 7, "train": 8, "cli": 9, "launch": 9, "emulate": 9, "__main__": 9}
#: Known arrows up (none: an entry here must say why it cannot go yet).
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """taco_jax modules `name` imports (`from pkg import sub` counts as pkg.sub when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m.split(".")[0] == "taco_jax" and m != name}


def _floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None  # the package root has no floor


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_subpackage_has_a_floor():
    subs = {p.name if p.is_dir() else p.stem for p in ROOT.iterdir()
            if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert subs <= set(FLOORS), f"give {sorted(subs - set(FLOORS))} a floor in FLOORS"


def test_no_import_runs_from_a_lower_floor_to_a_higher_one(graph):
    upward = {(a, b) for a, targets in graph.items() for b in targets
              if _floor(a) is not None and _floor(b) is not None and _floor(b) > _floor(a)}
    new = sorted(upward - ALLOWED_UPWARD)
    assert not new, "imports from a lower floor to a higher one (order: util -> codec -> kernels -> " \
                    f"collectives -> parallel -> models -> perf -> testing -> train -> cli): {new}"
    gone = sorted(ALLOWED_UPWARD - upward)
    assert not gone, f"remove these from ALLOWED_UPWARD, they are fixed: {gone}"


def test_no_import_cycle(graph):
    done, stack, on_stack = set(), [], set()

    def visit(m):
        stack.append(m)
        on_stack.add(m)
        for n in sorted(graph.get(m, ())):
            if n in on_stack:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in done:
                visit(n)
        stack.pop()
        on_stack.discard(m)
        done.add(m)

    for m in sorted(graph):
        if m not in done:
            visit(m)


def test_the_graph_sees_known_arrows(graph):
    """Guards the parser itself: a few imports that exist must be found."""
    assert "taco_jax.codec.config" in graph["taco_jax.codec.reference"]
    assert "taco_jax.codec.backends" in graph["taco_jax.kernels"]
    assert "taco_jax.kernels" in graph["taco_jax.collectives.policy"]


def test_training_never_reaches_into_the_kernels(graph):
    """taco_jax.train reaches the codec kernels only through the codec and the collectives."""
    bad = sorted((a, b) for a, targets in graph.items() if a.startswith("taco_jax.train")
                 for b in targets if b == "taco_jax.kernels" or b.startswith("taco_jax.kernels."))
    assert not bad, f"modules of taco_jax/train import taco_jax.kernels: {bad}"


def test_the_compressed_collectives_never_import_a_kernel(graph):
    """`collectives/compressed.py` dispatches to wire codecs through the codec's registry."""
    bad = sorted(b for b in graph["taco_jax.collectives.compressed"] if b.startswith("taco_jax.kernels"))
    assert not bad, bad


def test_the_floors_follow_measured_arrows(graph):
    """The arrows that order perf, testing and train (module docstring) exist, so the floors are measured."""
    def reaches(pkg, target):
        return any(b.startswith(f"taco_jax.{target}") for a, bs in graph.items() if a.startswith(f"taco_jax.{pkg}")
                   for b in bs)

    assert reaches("train", "perf") and reaches("train", "testing") and reaches("perf", "models")
    assert reaches("launch", "train") and not reaches("testing", "perf") and not reaches("perf", "testing")
