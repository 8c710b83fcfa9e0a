"""Quantised matmuls at OpenVLA's real layer sizes: each layer of its Llama-2-7B decoder as the build compiles
it (fp32, and dsa.stages.quant's int8 / int4 op), timed in alternating rounds and checked against float64.
Rendered by report.render_quant_layers."""

from __future__ import annotations

from pathlib import Path
from typing import List

import numpy as np

from dsa.core.fileio import read_json
from dsa.tools.bench.runtimes import Built, IreeModule
from dsa.tools.bench.timing import measure_interleaved, parity

# -- quantised matmuls at OpenVLA's real sizes --------------------------------------------------------
# //models:openvla is a scaled-down stand-in (256-wide decoder): its fp32 weights (21 MB) sit in the CPU's
# caches, where packing cannot pay. OpenVLA's own decoder is Llama-2-7B's (4096 wide, 11008-wide MLP, 32
# layers: 13 GB fp32, memory-bound in every decode step). These rows time exactly the layers it is made of,
# at those sizes, as the build compiles them (dsa.stages.quant's op, the target's flags and the quantised-model
# flags of dsa.stages.compile; manifests/openvla*.yaml name no tuning family).
QUANT_LAYERS = (("attention q/k/v/o", 4096, 4096), ("MLP gate/up", 11008, 4096), ("MLP down", 4096, 11008))
QUANT_ROWS = ((1, "decode step"), (64, "prefill, 64 tokens"))
QUANT_SCHEMES = (("fp32", {"kind": "none"}), ("int8 g32", {"kind": "int8", "group_size": 32}),
                 ("int4 g32", {"kind": "int4", "group_size": 32}))
QUANT_LAYERS_SUBJECT = "quant_layers"  # its name for --models


def _quant_layer_module(out_f: int, in_f: int, scheme: dict, weight: np.ndarray, work: Path):
    """One linear layer (no bias) with `weight`, quantised by `scheme` as DsaParams would, exported with its
    parameters outside the module; compiled by the caller."""
    import torch
    from iree.turbine import aot

    from dsa.stages.export import PARAMETER_SCOPE
    from dsa.stages.quant import SCALE_SUFFIX, quantize_module, quantize_weight

    work.mkdir(parents=True, exist_ok=True)
    layer = torch.nn.Sequential(torch.nn.Linear(in_f, out_f, bias=False)).eval()
    if scheme["kind"] == "none":
        layer[0].weight.data.copy_(torch.from_numpy(weight))
    else:
        quantize_module(layer, scheme)
        parts = quantize_weight(weight, scheme)
        layer[0].weight.copy_(torch.from_numpy(parts[""]))
        getattr(layer[0], "weight" + SCALE_SUFFIX).copy_(torch.from_numpy(parts[SCALE_SUFFIX]))
    aot.externalize_module_parameters(layer, external_scope=PARAMETER_SCOPE)
    return layer


def bench_quant_layers(root: Path, target_name: str, work: Path, *, runs: int, warmup: int,
                       light: bool = False) -> List[dict]:
    """Each OpenVLA decoder layer shape x each row count x fp32 / int8 / int4: latency (median/p90 of
    `runs` calls, alternating the three schemes), output parity against the fp32 layer on the same
    dequantised weights, and the bytes of weights each reads. `light`: the decode step (one row) only."""
    import torch
    from iree.turbine import aot

    from dsa.stages.compile import compile_module
    from dsa.stages.export import PARAMETER_SCOPE
    from dsa.stages.quant import SCALE_SUFFIX, dequantize, quantize_weight

    target = read_json(root / "toolchains" / "targets" / f"{target_name}.json")
    rng = np.random.default_rng(0)
    rows = []
    for label, out_f, in_f in QUANT_LAYERS:
        weight = (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)
        for n_rows, what in QUANT_ROWS[:1] if light else QUANT_ROWS:
            x = rng.standard_normal((n_rows, in_f)).astype(np.float32)
            modules, weights_bytes, outputs, checks = {}, {}, {}, {}
            for name, scheme in QUANT_SCHEMES:
                sub = work / f"{out_f}x{in_f}_{n_rows}_{scheme['kind']}"
                layer = _quant_layer_module(out_f, in_f, scheme, weight, sub)
                with torch.no_grad():
                    program = torch.export.export(layer, (torch.from_numpy(x),), strict=False)
                (sub / "model.mlir").write_text(str(aot.export(program).mlir_module))
                aot.save_module_parameters(str(sub / "params.irpa"), layer)
                view = {"model_id": "layer", "quant_scheme": scheme, "target": target_name, "tuning": None}
                report = compile_module(sub / "model.mlir", view, target, sub / "model.vmfb",
                                        where=f"{label} {scheme['kind']}")
                record = {"parameter_scope": PARAMETER_SCOPE, "function": "main", "inputs": [{"name": "x"}]}
                built = Built(sub / "model.vmfb", record, sub / "params.irpa", report["flags"], {}, 0.0, 0.0,
                              report["vmfb_bytes"])
                modules[name] = IreeModule(built, target["runtime_driver"])
                weights_bytes[name] = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
                outputs[name] = modules[name]({"x": x})
                # Exactness: the same math in float64 on the weights the module holds (dequantised).
                held = weight if scheme["kind"] == "none" else dequantize(
                    *(lambda parts: (parts[""], parts[SCALE_SUFFIX]))(quantize_weight(weight, scheme)),
                    {"shape": [out_f, in_f], "kind": scheme["kind"], "group_size": scheme["group_size"]})
                checks[name] = parity(outputs[name], x.astype(np.float64) @ held.T.astype(np.float64))
            ref = x.astype(np.float64) @ weight.T.astype(np.float64)
            fns = {name: (lambda m: lambda: m({"x": x}))(m) for name, m in modules.items()}
            timings = measure_interleaved(fns, warmup=warmup, runs=runs)
            scale = float(np.abs(ref).max())
            rows.append({
                "layer": label, "shape": [out_f, in_f], "rows": n_rows, "case": what,
                "schemes": {name: dict(timings[name], parity=checks[name], weight_bytes=weights_bytes[name],
                                       rel_error=round(float(np.abs(outputs[name] - ref).max()) / scale, 6))
                            for name in modules},
            })
            del modules
    return rows
