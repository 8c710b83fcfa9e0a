"""Which iree-compile flags a tuning file, a tuning candidate or a target spec may carry: an allow-list.

A tuning file (toolchains/tuning/<family>.<target>.json), a candidate of the tuner (toolchains/tuning/
candidates.json) and a target spec (toolchains/targets/<name>.json, or a `--targets-dir` of the user's) are
data a reviewer reads as "code generation settings". iree-compile has flags that do much more: write files
anywhere (`--iree-hal-dump-executable-files-to=DIR`, `--dump-compilation-phases-to`), print the IR, link
differently, override the data layout, choose another device or input. None of those may come from these
files: the action's only outputs are its vmfb and report.

So every flag is checked against a list of the flags these files may set, with a check of its value:
- CODEGEN_FLAGS: code generation and optimisation (tuning files, candidates, and target specs);
- TARGET_FLAGS: what a target spec adds to say which CPU or GPU it compiles for (never `host`).
Everything else is refused naming the file, the flag and the allowed flags. The flags the rule set sets itself
(input type, device, reproducibility, output) are refused in every source (OWN_FLAGS). Adding a flag here is a
reviewed change of the rule set, with the value check it needs.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional

from dsa.core.errors import DsaError

_KiB = 1024
_MiB = 1024 * 1024


def _boolean(value: Optional[str]) -> Optional[str]:
    """A boolean flag: bare (`--flag`) or `=true` / `=false`."""
    if value in (None, "true", "false", "1", "0"):
        return None
    return "a boolean: the bare flag, =true or =false"


def _choice(*allowed: str) -> Callable[[Optional[str]], Optional[str]]:
    def check(value: Optional[str]) -> Optional[str]:
        return None if value in allowed else f"one of {', '.join(allowed)}"
    return check


def _byte_count(low: int, high: int) -> Callable[[Optional[str]], Optional[str]]:
    def check(value: Optional[str]) -> Optional[str]:
        if value is not None and re.fullmatch(r"[0-9]{1,10}", value) and low <= int(value) <= high:
            return None
        return f"a byte count from {low} to {high}"
    return check


def _pattern(regex: str, what: str) -> Callable[[Optional[str]], Optional[str]]:
    compiled = re.compile(regex)

    def check(value: Optional[str]) -> Optional[str]:
        if value is None or value == "host" or len(value) > 256 or not compiled.fullmatch(value):
            return what
        return None
    return check


def _list_of(*allowed: str) -> Callable[[Optional[str]], Optional[str]]:
    def check(value: Optional[str]) -> Optional[str]:
        if value and all(item in allowed for item in value.split(",")):
            return None
        return f"a comma-separated list of {', '.join(allowed)}"
    return check


# The passes a tuning may put in `--iree-preprocessing-pass-pipeline` (attention decomposition, which the
# flow-VLA tunings use); a pipeline is `builtin.module(util.func(PASS,PASS,...))` with no pass options.
PREPROCESSING_PASSES = (
    "iree-linalg-ext-convert-attention-to-online-attention",
    "iree-linalg-ext-decompose-attention",
)


def _preprocessing_pipeline(value: Optional[str]) -> Optional[str]:
    match = re.fullmatch(r"builtin\.module\((?:util|func)\.func\(([a-z0-9,-]+)\)\)", value or "")
    if match and all(p in PREPROCESSING_PASSES for p in match.group(1).split(",")):
        return None
    return ("builtin.module(util.func(PASS,...)) with PASS one of " + ", ".join(PREPROCESSING_PASSES)
            + " and no pass options")


# Code generation and optimisation: what a tuning (and a target spec) may set.
# The ukernels a CPU module is lowered with: the flag's value, and a dispatch spec entry's (dispatch_spec.py).
UKERNEL_SETS = r"none|default|all|[a-z0-9_]+(,[a-z0-9_]+)*"

CODEGEN_FLAGS: Dict[str, Callable[[Optional[str]], Optional[str]]] = {
    "--iree-opt-level": _choice("O0", "O1", "O2", "O3"),
    "--iree-opt-data-tiling": _boolean,
    "--iree-opt-const-eval": _boolean,
    "--iree-opt-const-expr-hoisting": _boolean,
    # How many bytes one hoisted constant expression may add (IREE's default: 1 MiB): what is computed from the
    # weights alone (data-tiled packing, Winograd's transformed filters) is then computed once at load instead
    # of every call, and held in memory. Bounded: a limit past every weight hoists expressions of GBs (measured
    # on ACT: 12 GB resident with 1 GiB).
    "--iree-opt-const-expr-max-size-increase-threshold": _byte_count(1, 256 * _MiB),
    "--iree-llvmcpu-enable-ukernels": _pattern(UKERNEL_SETS, "none, default, all or a comma-separated list of "
                                                             "ukernel names"),
    # A function's stack; the runtime's worker stack must hold it (runtime_flags), up to 8 MiB.
    "--iree-llvmcpu-stack-allocation-limit": _byte_count(1, 8 * _MiB),
    "--iree-llvmcpu-matmul-tile-bytes": _byte_count(1, 16 * _MiB),
    "--iree-llvmcpu-fail-on-large-vector": _boolean,
    "--iree-dispatch-creation-block-matmul-producer-fusion": _boolean,
    "--iree-dispatch-creation-enable-aggressive-fusion": _boolean,
    "--iree-dispatch-creation-experimental-set-data-tiling-ops": _list_of("matmul", "convolution", "scaled_matmul"),
    "--iree-global-opt-use-im2col-for-convs": _boolean,
    "--iree-global-opt-propagate-transposes": _boolean,
    # IREE (O1 and above) transposes every concatenation to its outermost dimension; a concatenated attention
    # mask is then read transposed by the softmax that selects with it (docs/performance.md).
    "--iree-opt-outer-dim-concat": _boolean,
    # How a vector loop's remainder is handled: IREE masks elementwise ops and reductions on x86, and a masked
    # softmax whose row is not a multiple of the vector width (PI0's expert, 251 keys) then runs ~6x slower than
    # with the remainder peeled (docs/performance.md).
    "--iree-llvmcpu-vector-pproc-strategy": _choice("peel", "mask", "none"),
    "--iree-preprocessing-pass-pipeline": _preprocessing_pipeline,
}

# Which CPU or GPU a target spec compiles for: a target spec's own (never `host`: the artifact would depend on
# the build machine).
TARGET_FLAGS: Dict[str, Callable[[Optional[str]], Optional[str]]] = {
    "--iree-hal-local-target-device-backends": _choice("llvm-cpu", "vmvx"),
    "--iree-llvmcpu-target-triple": _pattern(r"[a-z0-9_]+(-[a-z0-9_.]+){1,4}", "an LLVM target triple"),
    "--iree-llvmcpu-target-cpu": _pattern(r"[a-z0-9][a-z0-9._-]{0,63}", "a named CPU (e.g. x86-64-v3)"),
    "--iree-llvmcpu-target-cpu-features": _pattern(r"[+-][a-z0-9._]+(,[+-][a-z0-9._]+)*",
                                                   "a comma-separated list of +feature / -feature"),
    "--iree-llvmcpu-target-abi": _pattern(r"[a-z0-9_]{1,16}", "an ABI name (e.g. lp64d)"),
    "--iree-cuda-target": _pattern(r"sm_[0-9]{2,3}[a-z]?", "a CUDA architecture (e.g. sm_87)"),
    "--iree-rocm-target": _pattern(r"gfx[0-9a-f]{3,5}", "a ROCm architecture (e.g. gfx942)"),
    "--iree-vulkan-target": _pattern(r"[a-z0-9_-]{1,64}", "a Vulkan target name (e.g. rdna3)"),
}

# Set by the rule set (dsa/stages/compile.py) and by no file: input type, device, reproducibility, output.
OWN_FLAGS = (
    "--iree-input-type", "--iree-hal-target-device", "--iree-hal-target-backends",
    "--iree-vm-bytecode-module-strip-source-map", "--iree-llvmcpu-debug-symbols", "-o", "--output",
    "--compile-to", "--compile-from", "--output-format",
)


def _allowed_text(allowed: Dict[str, Callable]) -> str:
    return ", ".join(sorted(allowed))


def check_flags(flags, where: str, source: str, allowed: Dict[str, Callable]) -> List[str]:
    """`flags` of a `source` ("tuning", "target spec", "candidate ...") checked against `allowed`; returns
    them as given. Refuses, naming `where`, the flag and the allowed flags: a value that is not a string
    `--flag[=value]`, a flag the rule set owns, a flag not in `allowed`, a value its check refuses."""
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise DsaError(where, f"{source} 'flags' must be a list of '--flag[=value]' strings")
    for flag in flags:
        name, sep, value = flag.partition("=")
        shown = flag if len(flag) <= 200 else f"{flag[:200]}... ({len(flag)} characters)"
        if not name.startswith("--") or len(flag) > 4096 or "\n" in flag or "\x00" in flag:
            raise DsaError(where, f"{source} flag {flag[:80]!r} is not a '--flag[=value]' string")
        if name in OWN_FLAGS or (name in TARGET_FLAGS and allowed is CODEGEN_FLAGS):
            raise DsaError(where, f"{source} flag '{shown}' is not allowed: the target spec and the rule set own "
                           "the device, CPU, input, output and reproducibility flags",
                           f"remove it from the {source}; flags a {source} may set: {_allowed_text(allowed)}")
        if value == "host" or (name == "--iree-llvmcpu-target-cpu-features" and "host" in value.split(",")):
            raise DsaError(where, f"{source} flag '{shown}' compiles for the build machine's own CPU: the "
                           "artifact would not be reproducible or portable",
                           "name an explicit CPU (e.g. --iree-llvmcpu-target-cpu=x86-64-v3)")
        if name not in allowed:
            raise DsaError(where, f"{source} flag '{shown}' is not allowed: only code-generation flags are "
                           "(no output, dump, printing, linking or layout overrides)",
                           f"flags a {source} may set: {_allowed_text(allowed)} "
                           "(the allow-list: dsa/stages/compile_flags.py)")
        problem = allowed[name](value if sep else None)
        if problem is not None:
            raise DsaError(where, f"{source} flag '{shown}' has a value this rule set does not take: "
                           f"{name} takes {problem}")
    return list(flags)


def check_tuning_flags(flags, where: str, source: str = "tuning") -> List[str]:
    """A tuning file's or tuning candidate's flags: code generation only."""
    return check_flags(flags, where, source, CODEGEN_FLAGS)


def check_target_flags(flags, where: str) -> List[str]:
    """A target spec's flags: its CPU / GPU, and code generation."""
    return check_flags(flags, where, "target spec", {**TARGET_FLAGS, **CODEGEN_FLAGS})
