"""The dsa package's layers and the check that its imports respect them (grimp's import graph).

    python -m dsa.tools.layers          # exit 0, or 1 with every illegal import chain, one per line

Layers, highest first: a module may import from its own layer and the layers below it, never above
(docs/architecture.md says what each holds):

    tools → frontends → stages → manifest → runtime → core

and two packages stay free of PyTorch: `dsa.runtime` (what a robot runs) and `dsa.core`. Within a layer the
modules import each other without cycles: two modules that need each other are one job split badly (their
shared piece belongs in one of them, or a layer down). Imports inside functions count like any other. A name
starting with `_` is private to its module: no other module of the package imports it (`from dsa.x import
_name`) or reaches for it (`x._name`, `x.Class._name`).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from typing import Dict, List, Optional

LAYERS = ("tools", "frontends", "stages", "manifest", "runtime", "core")
# Packages that must not reach these external packages, directly or through other modules.
FORBIDDEN_EXTERNAL = {"dsa.runtime": ("torch",), "dsa.core": ("torch", "iree")}


def violations(package: str = "dsa") -> List[str]:
    """Every import that breaks the layers or reaches a forbidden package, as `importer -> ... -> imported`."""
    import grimp

    graph = grimp.build_graph(package, include_external_packages=True, cache_dir=None)
    found = []
    for dependency in sorted(graph.find_illegal_dependencies_for_layers(layers=LAYERS, containers={package}),
                             key=lambda d: (d.importer, d.imported)):
        for route in dependency.routes:
            for head in sorted(route.heads):
                for tail in sorted(route.tails):
                    chain = [head, *route.middle, tail]
                    found.append(f"{dependency.importer} must not import {dependency.imported} "
                                 f"(layers {' > '.join(LAYERS)}): {' -> '.join(chain)}")
    for importer, externals in sorted(FORBIDDEN_EXTERNAL.items()):
        for external in externals:
            chain = graph.find_shortest_chain(importer=importer.replace("dsa", package, 1), imported=external,
                                              as_packages=True)
            if chain:
                found.append(f"{importer} must not import {external}: {' -> '.join(chain)}")
    found += cycles(graph, package)
    return found


def _layer(module: str, package: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == package and parts[1] in LAYERS else ""


def cycles(graph, package: str = "dsa") -> List[str]:
    """Every import cycle between modules of one layer (networkx's strongly connected components of the layer's
    import graph, each shown as one shortest cycle through its first module), as `dsa.<layer>: a -> b -> a`."""
    import networkx as nx

    modules = [m for m in graph.modules if _layer(m, package)]
    imports = nx.DiGraph()
    imports.add_nodes_from(modules)
    imports.add_edges_from((m, n) for m in modules for n in graph.find_modules_directly_imported_by(m)
                           if n != m and _layer(n, package) == _layer(m, package))
    found = []
    for component in sorted(sorted(c) for c in nx.strongly_connected_components(imports) if len(c) > 1):
        start = component[0]
        inside = imports.subgraph(component)
        # The shortest way back to `start`: through the successor nearest to it (ties: by name).
        ways = [nx.shortest_path(inside, child, start) for child in sorted(inside.successors(start))]
        cycle = [start, *min(ways, key=len)]
        found.append(f"{package}.{_layer(start, package)} must not import in a cycle "
                     f"({', '.join(component)}): {' -> '.join(cycle)}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.AST) -> Optional[List[str]]:
    """`a.b.c` as ["a", "b", "c"], or None for anything but a chain of names."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def private_uses(package: str = "dsa") -> List[str]:
    """Every use of a name private to another module of the package: imported from it, or reached through a
    name bound to something of the package (`from dsa.x import y` then `y._z`; `import dsa.x as x` then `x._z`)."""
    root = Path(importlib.util.find_spec(package).origin).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        bound: Dict[str, str] = {}  # a name in this file → what of the package it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.split(".")[0] == package and node.module != module:
                for alias in node.names:
                    if _private(alias.name):
                        found.append(f"{module} imports {node.module}.{alias.name}, private to {node.module} "
                                     f"({path.relative_to(root.parent)}:{node.lineno})")
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == package:
                        bound[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or package
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                chain = _dotted(node.value)
                if chain and chain[0] in bound:
                    owner = ".".join([bound[chain[0]], *chain[1:]])
                    if owner != module:
                        found.append(f"{module} uses {owner}.{node.attr}, private to it "
                                     f"({path.relative_to(root.parent)}:{node.lineno})")
    return found


def main() -> None:
    found = violations() + private_uses()
    for line in found:
        print(line)
    if found:
        print(f"dsa layers: {len(found)} illegal import(s) or private name(s) used across modules; see "
              "docs/architecture.md", file=sys.stderr)
        sys.exit(1)
    print(f"dsa layers: ok ({' > '.join(LAYERS)})")


if __name__ == "__main__":
    main()
