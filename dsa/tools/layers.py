"""The dsa package's layers and the check that its imports respect them (grimp's import graph).

    python -m dsa.tools.layers          # exit 0, or 1 with every illegal import chain, one per line

Layers, highest first: a module may import from its own layer and the layers below it, never above
(docs/architecture.md says what each holds):

    tools → frontends → stages → manifest → runtime → core

and two packages stay free of PyTorch: `dsa.runtime` (what a robot runs) and `dsa.core`. Imports inside
functions count like any other.
"""

from __future__ import annotations

import sys
from typing import List

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
