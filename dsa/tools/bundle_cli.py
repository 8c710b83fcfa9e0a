"""dsa bundle: one compiled policy for one target as a single, deterministic, verifiable release archive.

    bin/dsa bundle create --lock L --manifest M --runtime-view R --target-spec T --params P \\
        --module NAME=VMFB,EXPORT_RECORD,COMPILE_REPORT ... --out NAME.tar [--digest NAME.sha256]
    bin/dsa bundle create --index out/pi0/x86_64-v3.modules.json --manifest manifests/pi0.yaml \\
        --target-spec toolchains/targets/x86_64-v3.json --out pi0_bundle.tar    # from dsa compile's output
    bin/dsa bundle create --pipeline bazel-bin/models/groot.pipeline.json \\
        --stage-manifest groot_backbone=manifests/groot_backbone.yaml \\
        --stage-manifest groot_head=manifests/groot_head.yaml --out groot_bundle.tar   # a linked pipeline
    bin/dsa bundle verify NAME.tar          # every check `dsa run --bundle` makes, then a summary
    bin/dsa bundle list NAME.tar            # the files, their sizes and digests
    dsa bundle release NAME.tar DEST    # verify, then copy NAME.tar and NAME.sha256 into DEST

`create` is the DsaBundle action's writer (dsa.stages.bundle), `verify` and `list` the reader (dsa.runtime.bundle),
`release` dsa.runtime.release; the format is docs/bundle-format.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import List, Optional

from dsa.core.bundle_layout import EXECUTORCH_KIND, PARAMS_IRPA
from dsa.core.errors import run_cli
from dsa.core.formats import PteRecord
from dsa.runtime.bundle import extract_pte_bundle, open_bundle, read_bundle_json, user_path
from dsa.runtime.release import add_release_arguments, release_command
from dsa.stages.bundle import add_create_arguments, create


def format_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa bundle", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_create_arguments(sub.add_parser("create", help="write a bundle archive and its .sha256"))
    for command, text in (("verify", "check a bundle as `dsa run` would and summarise it"),
                          ("list", "list a verified bundle's files")):
        p = sub.add_parser(command, help=text)
        p.add_argument("bundle")
    add_release_arguments(sub.add_parser("release", help="verify a bundle, then copy it and its .sha256 into DEST"))
    a = parser.parse_args(argv)

    if a.command == "create":
        create(a)
        return
    if a.command == "release":
        release_command(a)
        return
    if read_bundle_json(user_path(a.bundle)).get("kind") == EXECUTORCH_KIND:
        with tempfile.TemporaryDirectory(prefix="dsa-bundle-") as tmp:
            meta = extract_pte_bundle(user_path(a.bundle), Path(tmp))
            record = PteRecord.read(Path(tmp) / meta["record"])
        print(f"{a.bundle}: ExecuTorch bundle (format {meta['format']}) of {meta['model_id']}: "
              f"{record.get('backend')}, {record.get('delegates')} delegated subgraphs, "
              f"{format_size(meta['files'][meta['program']]['size'])} program; every file matches bundle.json")
        if a.command == "list":
            for name, entry in sorted(meta["files"].items()):
                print(f"  {entry['sha256']}  {entry['size']:>12d}  {name}")
        return
    with open_bundle(user_path(a.bundle)) as b:
        print(b.describe())
        if a.command == "list":
            for name, entry in sorted(b.meta["files"].items()):
                print(f"  {entry['sha256']}  {entry['size']:>12d}  {name}")
        else:
            for stage, report in zip(b.stages, b.stage_reports):
                prefix = f"{stage.name}." if stage.name else ""
                for m in report["modules"]:
                    bucket = f"{m['bucket']['dim']}={m['bucket']['size']}" if m.get("bucket") else "dynamic"
                    print(f"  {prefix}{m['name']}: {bucket}, {m['export']['op_count']} exported ops, "
                          f"{m['compile']['dispatch_count']} dispatches, {format_size(m['sizes']['vmfb_bytes'])}")
            if b.is_multi_target:
                for target, why in b.why_not_here().items():
                    print(f"  target {target} ({b.target_spec(target).get('runtime_driver', 'local-task')}): "
                          + ("runs on this machine" if why is None else f"not here: {why}"))
            params = sum(report["parameters"]["bytes"] for report in
                         (b.stage_reports[:1] if b.is_multi_target else b.stage_reports))
            label = (f"{PARAMS_IRPA} (all stages)" if b.is_pipeline else
                     f"{PARAMS_IRPA} (shared by all targets)" if b.is_multi_target else PARAMS_IRPA)
            print(f"  {label}: {format_size(params)}; archive {format_size(b.archive.stat().st_size)}")


if __name__ == "__main__":
    run_cli(main, "dsa bundle")
