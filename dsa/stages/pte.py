"""DsaPte: the ExecuTorch Plan B — the manifest's model (export view + checkpoint) → an ExecuTorch program
(.pte, XNNPACK-delegated) and a program record.

The same entry point, manifest and checkpoint as the IREE build: the model is built by its entry point at
static dims (a bucket's, else each dynamic dim at its minimum), the checkpoint's weights are loaded into it
(by name, every tensor checked), traced by torch.export and lowered by ExecuTorch
(`to_edge_transform_and_lower(..., partitioner=[XnnpackPartitioner()])`). The weights live inside the .pte (an
ExecuTorch program carries its constants); rules_dsa's graph rewrites are for IREE and are not applied.

The program record says what went to XNNPACK and what stayed on ExecuTorch's portable kernels, the inputs and
outputs, and the provenance a bundle needs: digests of the manifest, its views, the checkpoint, the model
sources, the stage code that ran, and the identity of the environment (ExecuTorch 1.5.1 beside torch 2.13).

Runs in the ExecuTorch environment (@dsa_executorch_python, requirements_executorch.in). Frameworks onnx and
stablehlo have no PyTorch program and LeRobot policies need their own environment's torch: they are refused.
"""

from __future__ import annotations

import argparse
import collections
import warnings
from pathlib import Path
from typing import Dict, List, Optional

from dsa.core.determinism import pin_math_libraries
from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import atomic_output, read_json, sha256_bytes, sha256_file
from dsa.core.formats import PTE_RECORD_FORMAT, PteRecord

# The ExecuTorch program's method, as ExecuTorch names it.
METHOD = "forward"


def _program(view: dict, checkpoint: Path, bucket: Optional[dict], pythonpath, manifest_name: str):
    """(module with the checkpoint's weights, example args, input specs) at static dims."""
    import numpy as np
    from safetensors.torch import load_file

    from dsa.stages.export import EXAMPLE_SEED, NominalDims, load_entry_point

    where = f"{manifest_name}: framework"
    if view["framework"] not in ("pytorch",):
        raise DsaError(where, f"an ExecuTorch program is built from a PyTorch entry point; framework "
                       f"'{view['framework']}' has none here",
                       "build the .pte for framework pytorch manifests (LeRobot policies need their own "
                       "environment's torch; ONNX and StableHLO models have no PyTorch program)")
    if view.get("quant_scheme", {}).get("kind", "none") != "none":
        raise DsaError(f"{manifest_name}: quant_scheme", "the ExecuTorch program is built in float32",
                       "use quant_scheme kind none for dsa_pte (ExecuTorch quantises with its own flow)")
    entry = load_entry_point(view["model"]["entry_point"], pythonpath)
    probe = entry(view, NominalDims())
    minimums = dict(probe.dim_minimums)
    dims = {name: max(1, minimums.get(name, 1)) for name in probe.dynamic_dim_names()}
    if bucket is not None:
        dims[bucket["dim"]] = bucket["size"]
    spec = entry(view, dims)
    module = spec.module.eval()
    state = load_file(str(checkpoint))
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise DsaError(str(checkpoint), f"lacks {len(missing)} tensor(s) the model has: {', '.join(missing[:5])}",
                       "use a checkpoint of the manifest's model")
    for name, tensor in own.items():
        if tuple(state[name].shape) != tuple(tensor.shape) or state[name].dtype != tensor.dtype:
            raise DsaError(f"{checkpoint}: tensor '{name}'",
                           f"has shape {list(state[name].shape)} {state[name].dtype}, the model expects "
                           f"{list(tensor.shape)} {tensor.dtype}", "use a checkpoint of the manifest's model")
    module.load_state_dict({k: state[k] for k in own}, strict=True)
    rng = np.random.default_rng(EXAMPLE_SEED)
    args = tuple(s.example(rng) for s in spec.inputs)
    return module, args, spec.inputs, dims


def delegation(edge) -> Dict[str, object]:
    """Ops inside XNNPACK delegates and ops left on ExecuTorch's portable kernels (call counts)."""
    graph_module = edge.exported_program().graph_module
    delegated: collections.Counter = collections.Counter()
    portable: collections.Counter = collections.Counter()
    delegates = 0
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if "executorch_call_delegate" in name:
            delegates += 1
            lowered = getattr(graph_module, node.args[0].target)
            for inner in lowered.original_module.graph.nodes:
                if inner.op == "call_function" and "getitem" not in str(inner.target):
                    delegated[_op_name(inner.target)] += 1
        elif "getitem" not in name:
            portable[_op_name(node.target)] += 1
    return {"delegates": delegates, "delegated_ops": dict(sorted(delegated.items())),
            "portable_ops": dict(sorted(portable.items()))}


def _op_name(target) -> str:
    name = getattr(target, "__name__", str(target))
    return name.replace("aten.", "").replace(".default", "")


def build_pte(view: dict, checkpoint: Path, out_pte: Path, out_record: Path, *, params_view: dict,
              bucket: Optional[dict] = None, pythonpath=(), manifest_name: str = "manifest",
              provenance: Optional[dict] = None) -> dict:
    import torch

    from dsa.stages.params import check_checkpoint_digest
    from dsa.stages.spec import DTYPE_NAMES

    check_checkpoint_digest(checkpoint, params_view, manifest_name)
    module, args, inputs, dims = _program(view, checkpoint, bucket, pythonpath, manifest_name)
    where = f"{manifest_name}: model.entry_point ({view['model']['entry_point']})"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower

        try:
            with torch.no_grad():
                exported = torch.export.export(module, args, strict=False)
                reference = module(*args)
            edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
            report = delegation(edge)  # before to_executorch, which rewrites the edge program in place
            program = edge.to_executorch().buffer
        except DsaError:
            raise
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DsaError(where, f"ExecuTorch could not lower the model: {type(e).__name__}: {first[:300]}",
                           "the IREE build (dsa_vmfb) does not depend on this; see docs/frontends.md for what "
                           "ExecuTorch's XNNPACK backend takes") from None
    outputs = reference if isinstance(reference, (tuple, list)) else (reference,)
    from importlib import metadata

    record = {
        "format": PTE_RECORD_FORMAT,
        "model_id": view["model_id"],
        "method": METHOD,
        "inputs": [{"name": s.name, "shape": list(a.shape), "dtype": DTYPE_NAMES[a.dtype]}
                   for s, a in zip(inputs, args)],
        "outputs": [{"shape": list(o.shape), "dtype": DTYPE_NAMES[o.dtype]} for o in outputs],
        "dims": dims,
        "backend": "XnnpackBackend",
        **report,
        "pte_sha256": sha256_bytes(program),
        "pte_bytes": len(program),
        "toolchain": {"torch": torch.__version__, "executorch": metadata.version("executorch")},
    }
    if bucket is not None:
        record["bucket"] = {"dim": bucket["dim"], "size": bucket["size"], "slot": bucket["slot"]}
    if provenance:
        record["provenance"] = provenance
    with atomic_output(out_pte) as tmp:
        tmp.write_bytes(program)
    PteRecord.write(out_record, record)
    return record


def provenance_of(*, manifest: Path, views: Dict[str, Path], checkpoint: Path, model_sources: Dict[str, Path],
                  stage_sources: Dict[str, Path], identity: Path) -> dict:
    """What a bundle's provenance statement names: every input's digest."""
    return {
        "manifest": {"sha256": sha256_file(manifest)},
        "views": {name: sha256_file(path) for name, path in sorted(views.items())},
        "checkpoint": {"sha256": sha256_file(checkpoint)},
        "model_sources": {key: sha256_file(path) for key, path in sorted(model_sources.items())},
        "tool_sources": {key: sha256_file(path) for key, path in sorted(stage_sources.items())},
        "toolchain": read_json(identity),
    }


def _pairs(values: List[str], flag: str) -> Dict[str, Path]:
    out = {}
    for value in values:
        key, sep, path = value.partition("=")
        if not sep:
            raise DsaError(flag, f"'{value}' is not KEY=PATH")
        out[key] = Path(path)
    return out


def main(argv: Optional[List[str]] = None) -> None:
    pin_math_libraries()  # before any computation: dsa.core.determinism
    parser = argparse.ArgumentParser(prog="dsa-pte", description=__doc__.splitlines()[0])
    parser.add_argument("--view", required=True, help="the manifest's export view (JSON)")
    parser.add_argument("--params-view", required=True, help="the manifest's params view (checkpoint pin)")
    parser.add_argument("--bucket-view", help="a bucket view: build the program at that size")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--pythonpath", action="append", default=[], help="directory holding model code")
    parser.add_argument("--manifest", required=True, help="the manifest (its digest goes to the record)")
    parser.add_argument("--manifest-name", default="manifest", help="manifest path, for messages")
    parser.add_argument("--model-source", action="append", default=[], help="KEY=PATH of model code")
    parser.add_argument("--tool-source", action="append", default=[], help="KEY=PATH of stage code")
    parser.add_argument("--identity", required=True, help="identity.json of the environment")
    parser.add_argument("--out-pte", required=True)
    parser.add_argument("--out-record", required=True)
    a = parser.parse_args(argv)
    views = {"export": Path(a.view), "params": Path(a.params_view)}
    if a.bucket_view:
        views["bucket"] = Path(a.bucket_view)
    provenance = provenance_of(manifest=Path(a.manifest), views=views, checkpoint=Path(a.checkpoint),
                               model_sources=_pairs(a.model_source, "--model-source"),
                               stage_sources=_pairs(a.tool_source, "--tool-source"), identity=Path(a.identity))
    build_pte(read_json(a.view), Path(a.checkpoint), Path(a.out_pte), Path(a.out_record),
              params_view=read_json(a.params_view), bucket=read_json(a.bucket_view) if a.bucket_view else None,
              pythonpath=a.pythonpath, manifest_name=a.manifest_name, provenance=provenance)


if __name__ == "__main__":
    run_cli(main, "dsa-pte")
