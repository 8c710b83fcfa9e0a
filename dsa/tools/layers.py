"""The dsa package's layers and the check that its imports respect them (grimp's import graph).

    python -m dsa.tools.layers          # exit 0, or 1 with every illegal import chain, one per line

Layers, highest first: a module may import from its own layer and the layers below it, never above
(docs/architecture.md says what each holds):

    tools → frontends → stages → manifest → runtime → core

and two packages stay free of PyTorch: `dsa.runtime` (what a robot runs) and `dsa.core`. Within a layer the
modules import each other without cycles: two modules that need each other are one job split badly (their
shared piece belongs in one of them, or a layer down). Imports inside functions count like any other.
"""

from __future__ import annotations

import sys
from typing import Dict, List, Set

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
    """Every import cycle between modules of one layer (its strongly connected parts, each shown as one shortest
    cycle through its first module), as `dsa.<layer>: a -> b -> a`."""
    modules = sorted(m for m in graph.modules if _layer(m, package))
    edges: Dict[str, List[str]] = {
        m: sorted(n for n in graph.find_modules_directly_imported_by(m)
                  if n != m and _layer(n, package) == _layer(m, package))
        for m in modules}
    # Tarjan's strongly connected components, iteratively (no recursion limit).
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                child = edges[node][i]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            for child in edges[node]:
                if child in on_stack:
                    low[node] = min(low[node], low[child])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    found = []
    for component in sorted(components):
        start, members = component[0], set(component)
        # The shortest way back to `start` (breadth first, inside the component).
        previous = {start: ""}
        queue, cycle = [start], None
        while queue and cycle is None:
            node = queue.pop(0)
            for child in edges[node]:
                if child == start:
                    path = [node]
                    while previous[path[-1]]:
                        path.append(previous[path[-1]])
                    cycle = [*reversed(path), start]
                    break
                if child in members and child not in previous:
                    previous[child] = node
                    queue.append(child)
        found.append(f"{package}.{_layer(start, package)} must not import in a cycle "
                     f"({', '.join(component)}): {' -> '.join(cycle)}")
    return found


def main() -> None:
    found = violations()
    for line in found:
        print(line)
    if found:
        print(f"dsa layers: {len(found)} illegal import(s); see docs/architecture.md", file=sys.stderr)
        sys.exit(1)
    print(f"dsa layers: ok ({' > '.join(LAYERS)})")


if __name__ == "__main__":
    main()
