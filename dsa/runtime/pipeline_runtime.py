"""Running a linked pipeline of compiled policies (`bin/dsa link run`, a pipeline bundle's stages).

`CompiledPipeline` runs a linked pipeline from its pipeline index (`NAME.pipeline.json`, written by
`dsa_pipeline`: the link file and each stage's module index, paths relative to it): each stage is a
`dsa.runtime.policy.CompiledPolicy`, run in order, its inputs taken from the edges or from the caller's inputs by
name. Before running it checks that the loaded modules are the ones the link describes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dsa.core.errors import DsaError
from dsa.core.formats import ModuleIndex, PipelineIndex
from dsa.runtime.link_check import Stage, edges_of, link, read_link


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
            # Each stage's own build: a pipeline is linked per target (a dsa_pipeline of the levels' stages
            # is another pipeline), so a stage index's levels are not chosen from here.
            stage_index = base / entry["index"]
            self.stages.append((entry["name"], CompiledPolicy(stage_index, driver=driver,
                                                              target=ModuleIndex.read(stage_index).target)))
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


def run_pipeline(a: argparse.Namespace, pipeline_index: Path) -> None:
    """`dsa link run`: a generated sample through every stage, timed."""
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


def run_command(a: argparse.Namespace) -> None:
    """`dsa link run --pipeline INDEX | --bundle NAME.tar` (a pipeline bundle is verified first)."""
    if a.pipeline:
        run_pipeline(a, Path(a.pipeline))
        return
    from dsa.runtime.bundle import open_bundle, user_path

    with open_bundle(user_path(a.bundle)) as bundle:
        print(bundle.describe())
        run_pipeline(a, bundle.pipeline_path)
