"""The transformer control (models/transformer) as an ONNX model, as a customer would bring one: exported with
torch's own ONNX exporter (`torch.onnx.export(dynamo=True)`) from the control's module and checkpoint, with a
dynamic batch dim named "batch" and its weights in an external-data file.

    make_onnx.py --manifest manifests/transformer.yaml --checkpoint transformer.safetensors \\
        --out DIR/model.onnx          # writes DIR/model.onnx and DIR/model.onnx.data

Byte-identical on every run and machine (checked by the test; the manifest pins both files' sha256): the
exporter's output depends only on the module, the example shapes and the weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", required=True, type=Path, help="the transformer control's manifest")
    parser.add_argument("--checkpoint", required=True, type=Path, help="its checkpoint (.safetensors)")
    parser.add_argument("--out", required=True, type=Path, help="the .onnx file to write (+ .data beside it)")
    a = parser.parse_args(argv)

    import numpy as np
    import torch
    from safetensors.torch import load_file

    from dsa.manifest.contract import load_manifest, project
    from dsa.stages.export import EXAMPLE_SEED, load_entry_point

    view = project(load_manifest(a.manifest), "export")
    spec = load_entry_point(view["model"]["entry_point"])(view, {})
    module = spec.module.eval()
    module.load_state_dict(load_file(str(a.checkpoint)))
    rng = np.random.default_rng(EXAMPLE_SEED)
    # Batch 2 in the example (a size-1 example would specialise the dynamic dim away).
    args = tuple(torch.cat([s.example(rng)] * 2) for s in spec.inputs)
    batch = torch.export.Dim("batch", min=1, max=64)
    names = [s.name for s in spec.inputs]
    with torch.no_grad():
        program = torch.onnx.export(module, args, dynamo=True, input_names=names, output_names=["action"],
                                    dynamic_shapes=tuple({0: batch} for _ in names), verbose=False)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    # The external-data file is named after the model file: model.onnx → model.onnx.data.
    program.save(str(a.out), external_data=True)
    for path in (a.out, Path(str(a.out) + ".data")):
        if not path.is_file():
            sys.exit(f"make_onnx: the exporter did not write {path}")
    strip_metadata(a.out)


def strip_metadata(path: Path) -> None:
    """Drops what the exporter records about the Python source (each node's stack trace and module path, with
    absolute file paths): the graph itself is all the model is, and the file must not depend on where it was
    made. The external-data references are kept as they are."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graphs = [model.graph] + [f for f in model.functions]
    for graph in graphs:
        for node in graph.node:
            del node.metadata_props[:]
            node.doc_string = ""
    for value in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output):
        del value.metadata_props[:]
    del model.metadata_props[:]
    onnx.save(model, str(path))


if __name__ == "__main__":
    main()
