"""The edge check of a linked pipeline, run twice: by the DsaLink action (dsa.stages.link), which writes
link.json when it passes, and by the runner (dsa.runtime.pipeline_runtime) on the modules it loads.

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

`link` returns link.json's content (format 1, docs/bundle-format.md): the stages in order with the sha256 of
their export records, each edge's name, shape, dtype, producer and consumer, and the pipeline's external inputs
and outputs; the DsaLink action writes it only when every check passes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError
from dsa.core.fileio import read_json, sha256_file
from dsa.core.formats import LINK_FORMAT, Link

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
