"""The package's layers: every import inside turbine_fmha, at
module level or inside a function, points to its own layer or a lower one,
and no modules import each other in a circle. The runtime layers import
no compiler, torch or transformers at module level: the runtime works
with numpy and iree-base-runtime alone."""

from __future__ import annotations

import ast
from pathlib import Path

import turbine_fmha

PACKAGE = Path(turbine_fmha.__file__).resolve().parent
# Lowest first. The package's own __init__ (the public names) sits above all.
LAYERS = ("core", "kernels", "build", "calls", "testing", "runtime", "api", "integrations", "cli")
# The only modules that import these at module level (the build extra,
# torch, transformers); everything else defers them to the functions that
# need them.
HEAVY = ("torch", "iree.compiler", "iree.turbine", "jinja2", "transformers")
HEAVY_ALLOWED = {
    "kernels.custom_ops",
    "api.torch_ops",
    "api.exported",
    "integrations.transformers",
    "integrations._hf_masks",
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(name: str, path: Path):
    """(target module, at module level) for each import of the package's
    modules in `name`, and the absolute names of its other imports."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body} | {
        id(c) for n in tree.body if isinstance(n, (ast.If, ast.Try)) for c in ast.walk(n)
    }
    ours, others = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1] if node.level > 1 else package
            mod = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{mod}.{a.name}" if mod else a.name
                ours.append((full if full in MODULES else mod, id(node) in top))
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("turbine_fmha"):
                ours.append((node.module.removeprefix("turbine_fmha").lstrip("."), id(node) in top))
            else:
                others.append((node.module, id(node) in top))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("turbine_fmha"):
                    ours.append((a.name.removeprefix("turbine_fmha").lstrip("."), id(node) in top))
                else:
                    others.append((a.name, id(node) in top))
    return ours, others


def _layer(module: str) -> int:
    head = module.split(".")[0]
    return len(LAYERS) if module == "" else LAYERS.index(head)


def test_every_module_is_in_a_layer():
    stray = [m for m in MODULES if m and m.split(".")[0] not in LAYERS]
    assert not stray, f"modules outside the layers {LAYERS}: {stray}"


def test_imports_point_down():
    upward = []
    for name, path in MODULES.items():
        for target, _ in _imports(name, path)[0]:
            if target in MODULES and _layer(target) > _layer(name):
                upward.append(f"{name or 'turbine_fmha'} -> {target}")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(set(upward)))


def test_no_import_circles():
    graph = {
        name: {
            t
            for t, _ in _imports(name, path)[0]
            if t in MODULES
            and t != name
            and not (MODULES[t].name == "__init__.py" and name.startswith(t + ".") or t == "")
        }
        for name, path in MODULES.items()
    }

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for t in graph[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return seen

    circles = sorted({tuple(sorted({m} | {t for t in reach(m) if m in reach(t)})) for m in graph if m in reach(m)})
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_heavy_imports_only_where_allowed():
    found = []
    for name, path in MODULES.items():
        for module, at_top in _imports(name, path)[1]:
            if (
                at_top
                and module.split(".")[0] in {h.split(".")[0] for h in HEAVY}
                and name not in HEAVY_ALLOWED
                and any(module == h or module.startswith(h + ".") for h in HEAVY)
            ):
                found.append(f"{name}: import {module}")
    assert not found, "module-level imports of the build extra, torch or transformers:\n" + "\n".join(found)


def test_the_checks_see_the_whole_package():
    """The parse finds the package's real edges (a check that saw none
    would pass anything)."""
    edges = {(name, t) for name, path in MODULES.items() for t, _ in _imports(name, path)[0]}
    assert ("api.torch_ops", "api.eager") in edges and ("runtime.session", "kernels.variants") in edges
    assert ("api.public", "api.torch_ops") in edges  # a function-level import
    assert len(MODULES) > 40
