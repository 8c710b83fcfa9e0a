"""dsa: the rule set's one command, without Bazel (`bin/dsa`, `python -m dsa`, `bazel run //:dsa --`).

    dsa run BUNDLE.tar [run flags]          verify a release bundle, then run it
    dsa run --index NAME.modules.json ...   run a build's modules on an observation or a sample
    dsa compile --manifest M --out DIR      the whole pipeline: export, params, compile, lock
    dsa manifest validate|explain|project   check a manifest, say which stage each field affects, write a view
    dsa lerobot init --config-file P.json --out-dir D
                                            a LeRobot policy directory (config.json + model.safetensors) with
                                            stand-in weights, to try a manifest before the real checkpoint
                                            (LeRobot's environment: requirements_lerobot_lock.txt)
    dsa bundle create|verify|list|release   make, check, list or ship a release bundle
    dsa keygen KEY | dsa sign BUNDLE --key KEY.pem | dsa verify BUNDLE [--key KEY.pub.pem]
                                            sign a bundle (ed25519, DSSE) and check it and its signature
    dsa diff A.tar B.tar [--json]           which inputs and artifacts changed between two bundles
    dsa link link|run                       check a split policy's edges; run a linked pipeline
    dsa pte run BUNDLE.tar|PROGRAM.pte      run the ExecuTorch Plan B (in the ExecuTorch environment)
    dsa profile --manifest M ...            the top dispatches, with their source ops and modules
    dsa bench | dsa tune MODEL...           the latency benchmark; measure compile flags for a model family
    dsa tune-dispatches --profile-dir DIR   measure tile sizes of a profile's heaviest dispatches: a dispatch spec
                                            (--winograd: Winograd or im2col per 3x3 convolution weight shape)
    dsa import-matrix                       the README's import matrix from built models
    dsa scale MANIFEST... | --sweep pi0     real-size models' stages, runtime and eager: time and peak memory
    dsa execlog LOG                         what a build with --execution_log_json_file ran and what hit a cache
    dsa schema-doc                          the manifest schema reference (docs/manifest-schema.md)
    dsa rules-doc                           the rule reference (docs/rules.md)

`dsa COMMAND --help` prints a command's flags. Each command is one module's own command line, run as if by
`python -m MODULE`, so its flags, output and exit codes are the same either way.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Dict, List, Optional

from dsa.core.errors import DsaError, missing_package, run_cli

# command → the module whose `__main__` it runs.
COMMANDS: Dict[str, str] = {
    "run": "dsa.runtime.run",
    "keygen": "dsa.runtime.signing",
    "sign": "dsa.runtime.signing",
    "verify": "dsa.runtime.signing",
    "compile": "dsa.tools.pipeline",
    "manifest": "dsa.manifest.contract",
    "lerobot": "dsa.frontends.lerobot.cli",
    "bundle": "dsa.tools.bundle_cli",
    "diff": "dsa.tools.diff",
    "link": "dsa.stages.link",
    "pte": "dsa.tools.executorch",
    "profile": "dsa.tools.profiler",
    "bench": "dsa.tools.bench",
    "tune": "dsa.tools.tune",
    "tune-dispatches": "dsa.tools.dispatch_tune",
    "import-matrix": "dsa.tools.import_matrix",
    "scale": "dsa.tools.scale",
    "execlog": "dsa.tools.execlog",
    "schema-doc": "dsa.manifest.schema_doc",
    "rules-doc": "dsa.tools.rules_doc",
}


def usage() -> str:
    return __doc__.split("\n\n")[1] + "\n"


def main(argv: Optional[List[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.stderr.write("usage: dsa COMMAND [ARGS]\n\n" + usage())
        sys.exit(2)
    if args[0] in ("-h", "--help", "help"):
        sys.stdout.write("usage: dsa COMMAND [ARGS]\n\n" + usage())
        sys.exit(0)
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        sys.stderr.write(f"dsa: error: unknown command '{command}' (one of: {', '.join(COMMANDS)}; "
                         f"`dsa --help` lists them)\n")
        sys.exit(2)
    if command == "run" and rest and not rest[0].startswith("-"):
        rest = ["--bundle"] + rest  # `dsa run BUNDLE.tar ...`
    if COMMANDS[command] == "dsa.runtime.signing":
        rest = [command] + rest  # one module, three subcommands
    if os.environ.get("BUILD_WORKING_DIRECTORY"):
        os.chdir(os.environ["BUILD_WORKING_DIRECTORY"])  # `bazel run //:dsa`: paths as the caller wrote them
    sys.argv = [f"dsa {command}"] + rest

    def run() -> None:
        try:
            runpy.run_module(COMMANDS[command], run_name="__main__", alter_sys=True)
        except ModuleNotFoundError as e:
            if missing_package(e) is None:
                raise
            raise DsaError(f"dsa {command}", missing_package(e)) from None

    # Whatever the subcommand raises before (or outside) its own handler is one line and exit 2 as well.
    run_cli(run, "dsa")


if __name__ == "__main__":
    main()
