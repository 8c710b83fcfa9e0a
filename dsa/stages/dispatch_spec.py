"""Dispatch specs: measured per-dispatch code-generation decisions, applied to IREE's configured executables.

A dispatch spec (`toolchains/tuning/<family>.<target>.spec.mlir`, written by `dsa tune-dispatches`) is a
transform-dialect library in the form of IREE's tuning specs: one `@match_<name>` sequence per entry, matching a
dispatch's root op exactly as IREE configured it (the op, its operand types and IREE's own `lowering_config`,
through `transform.iree.match.cast_compatible_dag_from_root`) and yielding the measured `lowering_config` that
replaces IREE's. `@__dsa_tune` applies every entry with `transform.foreach_match`, annotating each matched op
with `dsa.tuned = "<name>"` so that what matched is counted.

Why not `--iree-codegen-tuning-spec-path`: IREE 3.13 applies tuning specs (MaterializeUserConfigsPass) *before*
it materialises the CPU encodings of data-tiled ops (MaterializeDeviceEncodingPass), and materialisation drops
the `lowering_config` a spec set, leaving a dispatch without tile sizes ("large vector sizes" at codegen). Every
convolution and matmul of the resnet_policy/flow_vla families is data-tiled. So the compile runs in two phases
instead: `iree-compile --compile-to=executable-configurations`, the spec applied to that IR with `iree-opt`'s
transform interpreter, then `iree-compile --compile-from=executable-configurations` with the same flags. The
entry includes IREE's default configuration in its pattern: when a new compiler configures the op otherwise,
the entry stops matching and says so (the compile report's `dispatch_spec.unmatched`) instead of overriding a
decision it was never measured against.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError
from dsa.core.fileio import atomic_output, sha256_file
from dsa.stages.iree_tools import first_error_line, iree_compile_path

ENTRY_POINT = "__dsa_tune"
TUNED_ATTR = "dsa.tuned"
CONFIGURED_PHASE = "executable-configurations"
# An entry's name: what `dsa profile` calls the dispatch's op (conv_512x15x20x512x3x3_f32), made a symbol.
ENTRY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,127}")
_MATCH_SEQUENCE = re.compile(r"transform\.named_sequence @match_([A-Za-z0-9_]+)\(")
_TUNED = re.compile(re.escape(TUNED_ATTR) + r' = "([A-Za-z0-9_]+)"')
_CPU_CONFIG = re.compile(r"#iree_cpu\.lowering_config<[^<>]*>")
MAX_SPEC_BYTES = 8 << 20


def iree_opt_path() -> str:
    from iree.compiler.tools.binaries import find_tool

    return find_tool("iree-opt")


# -- reading a spec ------------------------------------------------------------------------------------------


def spec_entries(spec: Path, where: Optional[str] = None) -> List[str]:
    """The entry names of a dispatch spec, in order; refuses a file that is not one (too large, not text, no
    entry point, no entry, an entry twice) naming it. Whether the MLIR parses is iree-opt's to say (apply)."""
    where = where or str(spec)
    hint = "write it with `dsa tune-dispatches` (docs/performance.md, \"Dispatch tuning\")"
    if not spec.is_file():
        raise DsaError(where, "no such dispatch spec", hint)
    if spec.stat().st_size > MAX_SPEC_BYTES:
        raise DsaError(where, f"is {spec.stat().st_size} bytes, more than a dispatch spec holds "
                              f"({MAX_SPEC_BYTES})", hint)
    try:
        text = spec.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DsaError(where, "is not UTF-8 text (a dispatch spec is MLIR text)", hint) from None
    if f"@{ENTRY_POINT}(" not in text:
        raise DsaError(where, f"has no transform sequence @{ENTRY_POINT} (the entry point the compile applies)",
                       hint)
    names = _MATCH_SEQUENCE.findall(text)
    if not names:
        raise DsaError(where, "has no @match_<name> entry", hint)
    seen = set()
    for name in names:
        if name in seen:
            raise DsaError(where, f"entry '{name}' is defined twice", hint)
        seen.add(name)
    return names


# -- applying a spec -----------------------------------------------------------------------------------------


def apply_spec(configured: Path, spec: Path, out: Path, where: str) -> Dict[str, int]:
    """Applies `spec` to IR compiled to executable-configurations; writes the result to `out`. Returns each
    entry's count of matched ops (0 for an entry that matched none)."""
    names = spec_entries(spec, f"{where}: dispatch spec {spec.name}")
    pipeline = (f"builtin.module(transform-preload-library{{transform-library-paths={spec}}},"
                f"transform-interpreter{{entry-point={ENTRY_POINT}}})")
    proc = subprocess.run([iree_opt_path(), str(configured), f"--pass-pipeline={pipeline}", "--mlir-print-local-scope",
                           "-o", str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise DsaError(f"{where}: dispatch spec {spec.name}",
                       f"iree-opt could not apply it: {first_error_line(proc.stderr).strip()[:300]}",
                       "the spec is not a transform library this compiler reads: write it again with "
                       "`dsa tune-dispatches`")
    counts = {name: 0 for name in names}
    with out.open(encoding="utf-8") as f:
        for line in f:
            for name in _TUNED.findall(line):
                if name in counts:
                    counts[name] += 1
    return counts


def compile_with_spec(mlir: Path, flags: Sequence[str], spec: Path, out: Path, where: str,
                      run_compile, start_flags: Sequence[str] = ()) -> Dict[str, int]:
    """iree-compile in two phases around the spec (see the module's doc). `run_compile(mlir, flags, out)`
    runs iree-compile and raises on failure; `start_flags` go to the first phase only (a --compile-from of
    executable sources). Returns each entry's match count."""
    with tempfile.TemporaryDirectory(prefix="dsa-dispatch-spec-") as tmp:
        configured = Path(tmp) / "configured.mlir"
        tuned = Path(tmp) / "tuned.mlir"
        run_compile(mlir, [*flags, *start_flags, f"--compile-to={CONFIGURED_PHASE}"], configured)
        counts = apply_spec(configured, spec, tuned, where)
        run_compile(tuned, [*flags, f"--compile-from={CONFIGURED_PHASE}"], out)
    return counts


def spec_report(spec: Path, counts: Dict[str, int]) -> dict:
    """What a compile report says of the spec it applied."""
    return {"file": spec.name, "sha256": sha256_file(spec),
            "matched": {n: c for n, c in counts.items() if c},
            "unmatched": [n for n, c in counts.items() if not c]}


# -- writing a spec (the tuner) --------------------------------------------------------------------------------


def _split_top(text: str) -> List[str]:
    """Splits at the commas outside <>, (), [] and {} (an `->` is not a bracket)."""
    out, depth, cur, prev = [], 0, "", ""
    for ch in text:
        if ch in "<([{":
            depth += 1
        elif ch in ")]}" or (ch == ">" and prev != "-"):
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
        prev = ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _group(text: str, key: str) -> Tuple[int, int, str]:
    start = text.index(f"{key}(")
    i = start + len(key) + 1
    depth = 1
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return start, i, text[start + len(key) + 1:i - 1]


def dag_pattern(op_text: str) -> str:
    """The body of a `cast_compatible_dag_from_root` matcher for `op_text` (a linalg op as IREE prints it, its
    attributes included): its operands become the block's arguments, so any producer matches."""
    op = re.sub(r"^%[\w#:]+ = ", "", op_text.strip())
    args: List[str] = []
    pieces = {}
    for key in ("ins", "outs"):
        start, end, inner = _group(op, key)
        values, types = inner.split(" : ", 1)
        types_list = _split_top(types)
        if len(types_list) != len(values.split(",")):
            raise DsaError("dispatch spec", f"cannot read the operands of {op[:120]!r}")
        names = []
        for t in types_list:
            names.append(f"%a{len(args)}")
            args.append(f"%a{len(args)}: {t}")
        pieces[key] = (start, end, f"{key}({', '.join(names)} : {', '.join(types_list)})")
    for key in ("outs", "ins"):  # outs comes later in the text: replace it first
        start, end, text = pieces[key]
        op = op[:start] + text + op[end:]
    lines = [line.strip() for line in op.splitlines()]
    lines[0] = "%r = " + lines[0]
    body = "\n".join("      " + line for line in lines)
    return f"    ^bb0({', '.join(args)}):\n{body}"


def write_spec(entries: Sequence[dict], header: Sequence[str] = ()) -> str:
    """A dispatch spec: `entries` of {"name", "op" (the root op as configured, with IREE's lowering_config),
    "lowering_config" (the one to set)}."""
    lines = [f"// {h}" for h in header]
    lines += ["module @dsa_dispatch_spec attributes { transform.with_named_sequence } {",
              "  transform.named_sequence @dsa_set_config(%op: !transform.any_op {transform.readonly},",
              "      %config: !transform.any_param {transform.readonly}, %name: !transform.any_param {transform.readonly}) {",
              '    transform.annotate %op "lowering_config" = %config : !transform.any_op, !transform.any_param',
              f'    transform.annotate %op "{TUNED_ATTR}" = %name : !transform.any_op, !transform.any_param',
              "    transform.yield",
              "  }"]
    for e in entries:
        if not ENTRY_NAME.fullmatch(e["name"]):
            raise DsaError("dispatch spec", f"entry name {e['name']!r} is not a symbol")
        lines += [
            f"  transform.named_sequence @match_{e['name']}(%op: !transform.any_op {{transform.readonly}})",
            "      -> (!transform.any_op, !transform.any_param, !transform.any_param) {",
            "    %ins, %outs = transform.iree.match.cast_compatible_dag_from_root %op {",
            dag_pattern(e["op"]),
            "    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)",
            f"    %config = transform.param.constant {e['lowering_config']} -> !transform.any_param",
            f'    %name = transform.param.constant "{e["name"]}" -> !transform.any_param',
            "    transform.yield %op, %config, %name : !transform.any_op, !transform.any_param, !transform.any_param",
            "  }"]
    matches = ",\n        ".join(f"@match_{e['name']} -> @dsa_set_config" for e in entries)
    lines += [f"  transform.named_sequence @{ENTRY_POINT}(%root: !transform.any_op {{transform.consumed}}) {{",
              f"    %res = transform.foreach_match in %root\n        {matches}",
              "      : (!transform.any_op) -> !transform.any_op",
              "    transform.yield",
              "  }",
              "}"]
    return "\n".join(lines) + "\n"


def configured_root_ops(configured_text: str) -> List[dict]:
    """The root ops of IR compiled to executable-configurations: every op IREE gave a CPU lowering_config with
    `distribution` tile sizes (the op the dispatch is tiled around). Each: {"op": its text, attributes
    included, "lowering_config": IREE's, "function": the dispatch function}."""
    lines = configured_text.split("\n")
    out = []
    function = None
    for i, line in enumerate(lines):
        fn = re.search(r"func\.func @([\w$.-]+)\(", line)
        if fn:
            function = fn.group(1)
        if "#iree_cpu.lowering_config<distribution" not in line or not re.search(r"= linalg\.\w+", line):
            continue
        end = i
        if line.rstrip().endswith("{"):
            end = next(k for k in range(i + 1, len(lines)) if lines[k].strip().startswith("} ->"))
        op = "\n".join(l.strip() for l in lines[i:end + 1])
        config = _CPU_CONFIG.search(op)
        out.append({"op": op, "lowering_config": config.group(0), "function": function})
    return out


def write_spec_file(path: Path, entries: Sequence[dict], header: Sequence[str] = ()) -> None:
    with atomic_output(path) as tmp:
        tmp.write_text(write_spec(entries, header))
