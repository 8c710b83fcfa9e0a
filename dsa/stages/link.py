"""DsaLink: joins separately compiled models into one pipeline by the tensors they exchange.

    bin/dsa link link --stage groot_backbone=bazel-bin/models/groot_backbone.modules.json \\
        --stage groot_head=bazel-bin/models/groot_head.modules.json \\
        --edge groot_head.backbone_features=groot_backbone.backbone_features \\
        --edge groot_head.backbone_mask=groot_backbone.backbone_mask --out groot.link.json
    bin/dsa link run --pipeline bazel-bin/models/groot.pipeline.json --steps 1 4
    bin/dsa link run --bundle bazel-bin/models/groot_bundle.tar       # a pipeline bundle, verified first

`link` checks the edges (dsa.runtime.link_check, which says what it refuses: the runner checks the loaded
modules again with it) and writes `link.json` (format 1, docs/bundle-format.md) and, with --pipeline-out, the
pipeline index. `run` is dsa.runtime.pipeline_runtime's `CompiledPipeline`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import List, Optional, Tuple

from dsa.core.errors import DsaError, run_cli
from dsa.core.formats import LINK_FORMAT, PIPELINE_INDEX_FORMAT, Link, PipelineIndex  # noqa: F401 (re-exported)
from dsa.runtime.link_check import Stage, edges_of, link, read_link  # noqa: F401 (re-exported)


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
    from dsa.runtime.pipeline_runtime import run_command  # running needs IREE's runtime; linking does not

    run_command(a)


if __name__ == "__main__":
    run_cli(main, "dsa link")
