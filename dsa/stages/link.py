"""DsaLink: joins separately compiled models into one pipeline by the tensors they exchange, and runs it.

    bin/dsa link link --stage groot_backbone=bazel-bin/models/groot_backbone.modules.json \\
        --stage groot_head=bazel-bin/models/groot_head.modules.json \\
        --edge groot_head.backbone_features=groot_backbone.backbone_features \\
        --edge groot_head.backbone_mask=groot_backbone.backbone_mask --out groot.link.json
    bin/dsa link run --pipeline bazel-bin/models/groot.pipeline.json --steps 1 4
    bin/dsa link run --bundle bazel-bin/models/groot_bundle.tar       # a pipeline bundle, verified first

A pipeline is an ordered list of stages (each a compiled model: its module index, or one export record)
and edges. An edge `CONSUMER_STAGE.INPUT=PRODUCER_STAGE.OUTPUT` feeds an output of an earlier stage to an
input of a later one. `link` reads every stage's export records and refuses, with one message naming the
edge, both records' shape and dtype and what to do:

* an edge whose producer output and consumer input differ in shape or dtype (in any module of either stage);
* an edge naming an unknown stage, output or input, or a producer that does not run before its consumer;
* two edges into one input;
* a stage input that has no edge although an earlier stage produces an output of that name (a forgotten
  edge: it would silently become an input the caller has to provide);
* two stages taking an external input of the same name with different shapes or dtypes (the runner feeds
  external inputs by name).

It writes `link.json` (format 1, docs/bundle-format.md): the stages in order with the sha256 of their export
records, each edge's name, shape, dtype, producer and consumer, and the pipeline's external inputs and
outputs. No output is written when a check fails.

`CompiledPipeline` runs a linked pipeline from its pipeline index (`NAME.pipeline.json`, written by
`dsa_pipeline`: the link file and each stage's module index, paths relative to it): each stage is a
`dsa.runtime.policy.CompiledPolicy`, run in order, its inputs taken from the edges or from the caller's inputs by
name. Before running it checks that the loaded modules are the ones the link describes.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import read_json, sha256_file

from dsa.core.formats import LINK_FORMAT, PIPELINE_INDEX_FORMAT, Link, PipelineIndex  # noqa: E402 (formats re-exported)

_STAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_HINT_MISMATCH = ("make the two models agree on the edge: change the consumer's manifest (its model.config) or "
                  "the producer's so that both export records give the same shape and dtype, then rebuild both")


class Stage:
    """One stage of a pipeline: its name and the export records of its modules (one per bucket, or one)."""

    def __init__(self, name: str, records: List[dict], sources: List[str], digests: Optional[List[str]] = None):
        if not _STAGE.match(name):
            raise DsaError(f"stage '{name}'", "is not a plain name", "name stages with letters, digits, '_', '-'")
        if not records:
            raise DsaError(f"stage '{name}'", "has no export records", "pass the stage's module index or record")
        self.name = name
        self.records = records
        self.sources = sources  # where each record came from, for messages
        self.digests = digests or []

    @classmethod
    def load(cls, name: str, path: Path) -> "Stage":
        """A stage from a module index (NAME.modules.json: every module's record) or one export record."""
        path = Path(path)
        if not path.is_file():
            raise DsaError(str(path), f"no such file (stage '{name}')",
                           "pass the stage's module index (NAME.modules.json) or an export record")
        data = read_json(path)
        if isinstance(data, dict) and "modules" in data and "inputs" not in data:
            files = [path.parent / m["record"] for m in data["modules"]]
        else:
            files = [path]
        records, digests = [], []
        for f in files:
            record = read_json(f)
            if not isinstance(record, dict) or not isinstance(record.get("inputs"), list) or not isinstance(
                    record.get("outputs"), list):
                raise DsaError(str(f), "is not an export record (no inputs/outputs lists)",
                               "pass an export record or module index that dsa_model/dsa_vmfb wrote")
            records.append(record)
            digests.append(sha256_file(f))
        return cls(name, records, [str(f) for f in files], digests)

    def entry(self, kind: str, tensor: str, index: int) -> Optional[dict]:
        return next((e for e in self.records[index][kind] if e["name"] == tensor), None)

    def names(self, kind: str) -> List[str]:
        return [e["name"] for e in self.records[0][kind]]


def _split(ref: str, what: str) -> Tuple[str, str]:
    stage, dot, tensor = ref.partition(".")
    if not dot or not stage or not tensor:
        raise DsaError(f"edge {what} '{ref}'", "is not STAGE.TENSOR", "write edges as CONSUMER.INPUT=PRODUCER.OUTPUT")
    return stage, tensor


def _describe(entry: dict) -> str:
    return f"{entry['shape']} {entry['dtype']}"


def link(stages: Sequence[Stage], edges: Sequence[Tuple[str, str]]) -> dict:
    """Checks `edges` ((consumer "stage.input", producer "stage.output") pairs) against the stages' export
    records; returns the link (link.json's content). Raises DsaError naming the edge at fault."""
    order = {}
    for i, s in enumerate(stages):
        if s.name in order:
            raise DsaError(f"stage '{s.name}'", "is listed twice", "list each stage once, in the order they run")
        order[s.name] = i
    if len(stages) < 2:
        raise DsaError("link", f"has {len(stages)} stage(s)", "a pipeline links at least two stages")
    by_name = {s.name: s for s in stages}

    linked: Dict[Tuple[str, str], dict] = {}
    out_edges = []
    for consumer_ref, producer_ref in edges:
        cs, cin = _split(consumer_ref, "consumer")
        ps, pout = _split(producer_ref, "producer")
        edge_where = f"edge '{pout}' ({ps}.{pout} → {cs}.{cin})"
        for stage_name, role in ((ps, "producer"), (cs, "consumer")):
            if stage_name not in by_name:
                raise DsaError(edge_where, f"names no stage '{stage_name}' as its {role}",
                               f"stages: {', '.join(order)}")
        if order[ps] >= order[cs]:
            raise DsaError(edge_where, f"the producer {ps} does not run before the consumer {cs}",
                           f"stages run in the order listed ({', '.join(order)}); an edge feeds a later stage")
        producer, consumer = by_name[ps], by_name[cs]
        if (cs, cin) in linked:
            raise DsaError(edge_where, f"{cs}.{cin} already has an edge (from {linked[(cs, cin)]['producer']})",
                           "feed each input from one output")
        if producer.entry("outputs", pout, 0) is None:
            raise DsaError(edge_where, f"{ps} has no output '{pout}' (its outputs: {', '.join(producer.names('outputs'))})",
                           "name an output of the producer's export record")
        if consumer.entry("inputs", cin, 0) is None:
            raise DsaError(edge_where, f"{cs} has no input '{cin}' (its inputs: {', '.join(consumer.names('inputs'))})",
                           "name an input of the consumer's export record")
        made = producer.entry("outputs", pout, 0)
        for i, source in enumerate(producer.sources):
            out = producer.entry("outputs", pout, i)
            if out is None or (out["shape"], out["dtype"]) != (made["shape"], made["dtype"]):
                raise DsaError(edge_where, f"the producer's modules disagree: {producer.sources[0]} gives "
                               f"{_describe(made)}, {source} gives {_describe(out) if out else 'nothing'}",
                               "an edge's producer must give one shape in every bucket")
        for i, source in enumerate(consumer.sources):
            want = consumer.entry("inputs", cin, i)
            if want is None:
                raise DsaError(edge_where, f"{source} has no input '{cin}'", "rebuild the consumer's modules")
            if (want["shape"], want["dtype"]) != (made["shape"], made["dtype"]):
                raise DsaError(
                    edge_where,
                    f"shape/dtype mismatch: the producer {ps} outputs {_describe(made)} ({producer.sources[0]}), "
                    f"the consumer {cs} takes {_describe(want)} ({source})",
                    _HINT_MISMATCH,
                )
        edge = {
            "name": pout,
            "shape": made["shape"],
            "dtype": made["dtype"],
            "producer": {"stage": ps, "output": pout},
            "consumer": {"stage": cs, "input": cin},
        }
        linked[(cs, cin)] = edge
        out_edges.append(edge)

    # External inputs: every stage input without an edge. Refuse a forgotten edge and a name clash.
    external: Dict[str, dict] = {}
    for s in stages:
        earlier = {out: p.name for p in stages[:order[s.name]] for out in p.names("outputs")}
        for entry in s.records[0]["inputs"]:
            name = entry["name"]
            if (s.name, name) in linked:
                continue
            if name in earlier:
                raise DsaError(
                    f"stage {s.name}: input '{name}'",
                    f"has no edge, but stage {earlier[name]} outputs a tensor of that name",
                    f"add the edge {s.name}.{name}={earlier[name]}.{name}, or rename one of the two",
                )
            if name in external:
                first = external[name]
                if (first["shape"], first["dtype"]) != (entry["shape"], entry["dtype"]):
                    raise DsaError(
                        f"stage {s.name}: input '{name}'",
                        f"is {_describe(entry)}, but stage {first['stage']} takes an input of that name as "
                        f"{_describe(first)}; the runner feeds both from one value",
                        "rename one of the two inputs",
                    )
                continue
            external[name] = {"name": name, "shape": entry["shape"], "dtype": entry["dtype"], "stage": s.name}

    last = stages[-1]
    return {
        "format": LINK_FORMAT,
        "stages": [
            {"name": s.name, "model_id": s.records[0].get("model_id"), "export_records": list(s.digests)}
            for s in stages
        ],
        "edges": sorted(out_edges, key=lambda e: (order[e["consumer"]["stage"]], e["consumer"]["input"])),
        "inputs": list(external.values()),
        "outputs": [
            {"name": e["name"], "shape": e["shape"], "dtype": e["dtype"], "stage": last.name}
            for e in last.records[0]["outputs"]
        ],
    }


def edges_of(link_data: dict) -> List[Tuple[str, str]]:
    """The (consumer, producer) pairs a link.json records."""
    return [
        (f"{e['consumer']['stage']}.{e['consumer']['input']}", f"{e['producer']['stage']}.{e['producer']['output']}")
        for e in link_data["edges"]
    ]


def read_link(path: Path) -> dict:
    return Link.read(path)


# ---------------------------------------------------------------------------------------------------------
# Running


class CompiledPipeline:
    """A linked pipeline of compiled policies, run stage by stage (see the module docstring)."""

    def __init__(self, pipeline_index: Path, driver: Optional[str] = None):
        from dsa.runtime.policy import CompiledPolicy

        pipeline_index = Path(pipeline_index)
        index = PipelineIndex.read(pipeline_index)
        base = pipeline_index.parent
        self.index = index
        self.link = read_link(base / index["link"])
        names = [s["name"] for s in index["stages"]]
        linked = [s["name"] for s in self.link["stages"]]
        if names != linked:
            raise DsaError(str(pipeline_index), f"lists stages {names}, its link {linked}",
                           "rebuild the pipeline: the index and the link come from different builds")
        self.stages: List[Tuple[str, "CompiledPolicy"]] = []
        loaded: List[Stage] = []
        for entry, linked_stage in zip(index["stages"], self.link["stages"]):
            stage = Stage.load(entry["name"], base / entry["index"])
            if stage.digests != linked_stage["export_records"]:
                raise DsaError(f"{pipeline_index}: stage {entry['name']}",
                               "its export records are not the ones the link was checked against",
                               "rebuild the pipeline so the link describes these modules")
            loaded.append(stage)
            self.stages.append((entry["name"], CompiledPolicy(base / entry["index"], driver=driver)))
        # The edges, checked again on what was loaded.
        again = link(loaded, edges_of(self.link))
        if again["edges"] != self.link["edges"]:
            raise DsaError(str(base / index["link"]), "does not describe the loaded modules' edges",
                           "rebuild the pipeline")

    @property
    def inputs(self) -> List[dict]:
        return self.link["inputs"]

    def sample_inputs(self, rng) -> Dict[str, "object"]:
        """A deterministic sample of the pipeline's external inputs (dsa.runtime.policy.sample_inputs per stage)."""
        from dsa.runtime.policy import sample_inputs

        external = {e["name"] for e in self.link["inputs"]}
        values: Dict[str, object] = {}
        for _, policy in self.stages:
            record = dict(policy.modules[0].record)
            record["inputs"] = [s for s in record["inputs"] if s["name"] in external and s["name"] not in values]
            values.update(sample_inputs(record, {}, rng))
        return values

    def run(self, inputs: Dict[str, object]) -> Tuple[Dict[str, object], Dict[str, Dict[str, object]]]:
        """Runs every stage in order. Returns (the last stage's outputs by name, every stage's outputs)."""
        feeds = {(e["consumer"]["stage"], e["consumer"]["input"]): (e["producer"]["stage"], e["producer"]["output"])
                 for e in self.link["edges"]}
        produced: Dict[str, Dict[str, object]] = {}
        for name, policy in self.stages:
            stage_inputs = {}
            for spec in policy.input_specs:
                source = feeds.get((name, spec["name"]))
                if source:
                    stage_inputs[spec["name"]] = produced[source[0]][source[1]]
                elif spec["name"] in inputs:
                    stage_inputs[spec["name"]] = inputs[spec["name"]]
                else:
                    raise DsaError("pipeline input", f"missing input '{spec['name']}' (of stage {name})",
                                   f"provide: {', '.join(e['name'] for e in self.link['inputs'])}")
            outputs, module = policy.run(stage_inputs)
            produced[name] = {o["name"]: v for o, v in zip(module.record["outputs"], outputs)}
        return produced[self.stages[-1][0]], produced


def _run(a: argparse.Namespace, pipeline_index: Path) -> None:
    import numpy as np

    pipeline = CompiledPipeline(pipeline_index)
    observation = pipeline.sample_inputs(np.random.default_rng(a.seed))
    last = pipeline.stages[-1][1]
    step_input = next((s["name"] for s in last.modules[0].record["inputs"] if "value_range" in s), None)
    print(f"pipeline {' → '.join(n for n, _ in pipeline.stages)}; edges "
          + ", ".join(f"{e['name']} {e['shape']} {e['dtype']}" for e in pipeline.link["edges"]))
    for steps in a.steps or [last.runtime_view["flow_steps"]]:
        if step_input:
            observation[step_input] = np.array(steps, dtype=np.int64)
        pipeline.run(observation)  # warm-up
        latencies = []
        for _ in range(a.repeats):
            start = time.perf_counter()
            outputs, _ = pipeline.run(observation)
            latencies.append((time.perf_counter() - start) * 1e3)
        actions = next(iter(outputs.values()))
        p50, p90 = np.percentile(latencies, [50, 90])
        print(f"flow_steps={steps:<3d} action chunk {tuple(actions.shape)}; latency p50 {p50:.2f} ms, "
              f"p90 {p90:.2f} ms over {len(latencies)} runs (all stages)")
        print(f"  first action: {np.array2string(actions.reshape(-1, actions.shape[-1])[0], precision=3)}")


def _edge_arg(value: str) -> Tuple[str, str]:
    consumer, sep, producer = value.partition("=")
    if not sep:
        raise DsaError("--edge", f"'{value}' is not CONSUMER.INPUT=PRODUCER.OUTPUT")
    return consumer, producer


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa link", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    k = sub.add_parser("link", help="check the edges between stages and write link.json")
    k.add_argument("--stage", action="append", default=[], required=True,
                   help="NAME=FILE: a stage's module index or export record, in the order the stages run")
    k.add_argument("--edge", action="append", default=[], type=_edge_arg,
                   help="CONSUMER_STAGE.INPUT=PRODUCER_STAGE.OUTPUT (repeat per edge)")
    k.add_argument("--out", required=True, help="link.json to write (only when every check passes)")
    k.add_argument("--pipeline-out", help="also write the pipeline index (NAME.pipeline.json) here: the link and "
                   "each stage's module index, relative to it")
    r = sub.add_parser("run", help="run a linked pipeline on a generated sample")
    source = r.add_mutually_exclusive_group(required=True)
    source.add_argument("--pipeline", help="pipeline index (NAME.pipeline.json) from dsa_pipeline")
    source.add_argument("--bundle", help="pipeline bundle (NAME.tar) from dsa_bundle; verified before use")
    r.add_argument("--steps", type=int, nargs="+", help="flow steps (default: the last stage's flow_steps)")
    r.add_argument("--repeats", type=int, default=10)
    r.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)

    if a.command == "link":
        stages = []
        for value in a.stage:
            name, sep, path = value.partition("=")
            if not sep:
                raise DsaError("--stage", f"'{value}' is not NAME=FILE")
            stages.append(Stage.load(name, Path(path)))
        Link.write(Path(a.out), link(stages, a.edge))
        if a.pipeline_out:
            base = os.path.dirname(a.pipeline_out)
            PipelineIndex.write(Path(a.pipeline_out), {
                "format": PIPELINE_INDEX_FORMAT,
                "link": os.path.relpath(a.out, base),
                "stages": [{"name": value.partition("=")[0], "index": os.path.relpath(value.partition("=")[2], base)}
                           for value in a.stage],
            })
        return
    if a.pipeline:
        _run(a, Path(a.pipeline))
        return
    from dsa.runtime.bundle import open_bundle, user_path

    with open_bundle(user_path(a.bundle)) as bundle:
        print(bundle.describe())
        _run(a, bundle.pipeline_path)


if __name__ == "__main__":
    run_cli(main, "dsa link")
