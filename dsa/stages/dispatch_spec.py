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

An entry may also choose the ukernels its dispatch is lowered with (`"ukernels"`, e.g. `mmt4d,pack`): its
action then annotates the dispatch function with `hal.executable.target` = the variant's target with those
ukernels, which IREE's codegen looks up from each op before the variant's (`ExecutableTargetAttr::lookup`).
The case it exists for: IREE computes the transpose of a matmul whose N is the smaller dimension and unpacks the
result transposed in the matmul's dispatch, and on x86 the unpack ukernel has no transposing fast path (it runs
element by element; codegen vectorises the same unpack).

An entry for a reduction may carry `siblings` (IREE's config → the one to set): the other ops of its dispatch
function that share the root op's loop nest (a decomposed softmax's max and normalisation), which must take the
same row tile for the root op's to matter; its action sets them by their configured `lowering_config`.

A spec may also hold rewrites chosen per op before IREE's own pipeline: `@rewrite_<name>` sequences applied by
`@__dsa_preprocess` to the IR after input conversion (`--compile-to=input`). Today's one rewrite is Winograd: an
entry matches a 3×3 `linalg.conv_2d_nchw_fchw` by its weight type, and only when the convolution's init is a
zero fill (IREE 3.13's Winograd conversion drops the init: a bias there would be lost; dsa/stages/passes.py's
`split_conv_bias` makes biased convolutions such convolutions), marks it `__winograd_conv` and
`dsa.rewritten = "<name>"`, and `iree-linalg-ext-convert-conv2d-to-winograd` converts the marked ones. The compile
then goes on with `--compile-from=input`. The choice is per weight shape because it is measured per shape: on
AVX2, F(6×6, 3×3) beats im2col + matmul for 64- and 128-channel convolutions and loses beyond (toolchains/
tuning/README.md).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError
from dsa.core.fileio import atomic_output, sha256_file
from dsa.stages.compile_flags import UKERNEL_SETS
from dsa.stages.iree_tools import first_error_line, iree_compile_path

ENTRY_POINT = "__dsa_tune"
TUNED_ATTR = "dsa.tuned"
CONFIGURED_PHASE = "executable-configurations"
PREPROCESS_ENTRY_POINT = "__dsa_preprocess"
REWRITTEN_ATTR = "dsa.rewritten"
INPUT_PHASE = "input"
# The rewrites a `@rewrite_<name>` entry may ask for: the marker IREE's pass reads, and that pass.
REWRITES = {"winograd": ("__winograd_conv", "iree-linalg-ext-convert-conv2d-to-winograd")}
# What each rewrite leaves in the IR it rewrote (how a tool tells that IR was compiled with such entries).
REWRITE_PRODUCTS = {"winograd": "iree_linalg_ext.winograd.input_transform"}
# An entry's name: what `dsa profile` calls the dispatch's op (conv_512x15x20x512x3x3_f32), made a symbol.
ENTRY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,127}")
_MATCH_SEQUENCE = re.compile(r"transform\.named_sequence @match_([A-Za-z0-9_]+)\(")
_REWRITE_SEQUENCE = re.compile(r"transform\.named_sequence @rewrite_([A-Za-z0-9_]+)\(")
_TUNED = re.compile(re.escape(TUNED_ATTR) + r' = "([A-Za-z0-9_]+)"')
_REWRITTEN = re.compile(re.escape(REWRITTEN_ATTR) + r' = "([A-Za-z0-9_]+)"')
CPU_CONFIG = re.compile(r"#iree_cpu\.lowering_config<[^<>]*>")
MAX_SPEC_BYTES = 8 << 20
# What an entry may set besides tiles: the ukernels its dispatch is lowered with (IREE's CPU ukernel names).
TARGET_ATTR = "hal.executable.target"
UKERNELS = re.compile(UKERNEL_SETS)
_UKERNELS_FIELD = re.compile(r'ukernels = "[^"]*"')


def iree_opt_path() -> str:
    from iree.compiler.tools.binaries import find_tool

    return find_tool("iree-opt")


# -- reading a spec ------------------------------------------------------------------------------------------


def _spec_text(spec: Path, where: str) -> str:
    hint = "write it with `dsa tune-dispatches` (docs/performance.md, \"Dispatch tuning\")"
    if not spec.is_file():
        raise DsaError(where, "no such dispatch spec", hint)
    if spec.stat().st_size > MAX_SPEC_BYTES:
        raise DsaError(where, f"is {spec.stat().st_size} bytes, more than a dispatch spec holds "
                              f"({MAX_SPEC_BYTES})", hint)
    try:
        return spec.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DsaError(where, "is not UTF-8 text (a dispatch spec is MLIR text)", hint) from None


def spec_parts(spec: Path, where: Optional[str] = None) -> Dict[str, List[str]]:
    """The entry names of a dispatch spec by the phase that applies them, in order: {"preprocess": the
    `@rewrite_<name>` entries of `@__dsa_preprocess`, "tune": the `@match_<name>` entries of `@__dsa_tune`}
    (either may be empty, not both). Refuses a file that is not one (too large, not text, no entry point, an
    entry point without entries or entries without theirs, a name twice) naming it. Whether the MLIR parses is
    iree-opt's to say (apply)."""
    where = where or str(spec)
    hint = "write it with `dsa tune-dispatches` (docs/performance.md, \"Dispatch tuning\")"
    text = _spec_text(spec, where)
    parts = {"preprocess": _REWRITE_SEQUENCE.findall(text), "tune": _MATCH_SEQUENCE.findall(text)}
    points = {"preprocess": PREPROCESS_ENTRY_POINT, "tune": ENTRY_POINT}
    for part, point in points.items():
        has_point = f"@{point}(" in text
        if parts[part] and not has_point:
            raise DsaError(where, f"has {part} entries but no transform sequence @{point} (the entry point the "
                                  "compile applies)", hint)
        if has_point and not parts[part]:
            raise DsaError(where, f"has @{point} but no {'@rewrite_' if part == 'preprocess' else '@match_'}"
                                  "<name> entry", hint)
    if not any(parts.values()):
        raise DsaError(where, f"has no transform sequence @{ENTRY_POINT} or @{PREPROCESS_ENTRY_POINT} (the entry "
                              "points the compile applies)", hint)
    seen = set()
    for name in parts["preprocess"] + parts["tune"]:
        if name in seen:
            raise DsaError(where, f"entry '{name}' is defined twice", hint)
        seen.add(name)
    return parts


_REWRITE_ENTRY = re.compile(r"transform\.named_sequence @rewrite_([A-Za-z0-9_]+)\(.*?"
                            r"cast_compatible_type %w = (tensor<[0-9x]+xf32>)", re.S)
_REWRITE_ACTION = re.compile(r"@rewrite_([A-Za-z0-9_]+) -> @dsa_(\w+)")


def spec_rewrites(spec: Path, where: Optional[str] = None) -> List[dict]:
    """The preprocess entries of a spec as `write_spec` takes them ({"name", "rewrite", "weight"}), in order;
    refuses one this module did not write (an entry whose weight or rewrite it cannot read)."""
    where = where or str(spec)
    names = spec_parts(spec, where)["preprocess"]
    text = _spec_text(spec, where)
    weights = dict(_REWRITE_ENTRY.findall(text))
    actions = dict(_REWRITE_ACTION.findall(text))
    out = []
    for name in names:
        if name not in weights or actions.get(name) not in REWRITES:
            raise DsaError(where, f"preprocess entry '{name}' is not one `dsa tune-dispatches --winograd` writes "
                                  "(no weight type or no known rewrite)",
                           "write the spec again with `dsa tune-dispatches --winograd`")
        out.append({"name": name, "rewrite": actions[name], "weight": weights[name]})
    return out


def spec_entries(spec: Path, where: Optional[str] = None) -> List[str]:
    """Every entry name of a dispatch spec: its preprocess entries, then its tune entries (spec_parts)."""
    parts = spec_parts(spec, where)
    return parts["preprocess"] + parts["tune"]


# -- applying a spec -----------------------------------------------------------------------------------------


def _run_transform(ir: Path, spec: Path, entry_point: str, out: Path, where: str, local_scope: bool,
                   debuginfo: bool = False) -> None:
    """iree-opt's transform interpreter at `entry_point`; `local_scope` prints attributes in place (the tune
    entries' counting and the tuner read configurations by line; it would drop a resource blob section)."""
    pipeline = (f"builtin.module(transform-preload-library{{transform-library-paths={spec}}},"
                f"transform-interpreter{{entry-point={entry_point}}})")
    proc = subprocess.run([iree_opt_path(), str(ir), f"--pass-pipeline={pipeline}",
                           *(["--mlir-print-local-scope"] if local_scope else []),
                           *(["--mlir-print-debuginfo"] if debuginfo else []), "-o", str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise DsaError(f"{where}: dispatch spec {spec.name}",
                       f"iree-opt could not apply it: {first_error_line(proc.stderr).strip()[:300]}",
                       "the spec is not a transform library this compiler reads: write it again with "
                       "`dsa tune-dispatches`")


def _count(path: Path, pattern: "re.Pattern[str]", names: Sequence[str]) -> Dict[str, int]:
    counts = {name: 0 for name in names}
    with path.open(encoding="utf-8") as f:
        for line in f:
            for name in pattern.findall(line):
                if name in counts:
                    counts[name] += 1
    return counts


def apply_spec(configured: Path, spec: Path, out: Path, where: str) -> Dict[str, int]:
    """Applies `spec`'s tune entries to IR compiled to executable-configurations; writes the result to `out`.
    Returns each entry's count of matched ops (0 for an entry that matched none)."""
    names = spec_parts(spec, f"{where}: dispatch spec {spec.name}")["tune"]
    _run_transform(configured, spec, ENTRY_POINT, out, where, local_scope=True)
    return _count(out, _TUNED, names)


def _dynamic_matches(marked: Path) -> List[str]:
    """The preprocess entries that marked an op with a dynamic dimension in its types (one op per line)."""
    found = set()
    with marked.open(encoding="utf-8") as f:
        for line in f:
            if REWRITTEN_ATTR in line and re.search(r"tensor<(\?|[0-9x]*x\?)", line):
                found.update(_REWRITTEN.findall(line))
    return sorted(found)


def apply_preprocess(input_ir: Path, spec: Path, out: Path, where: str, debuginfo: bool = False) -> Dict[str, int]:
    """Applies `spec`'s preprocess entries to IR compiled to the input phase, then the rewrites they marked
    (REWRITES); writes the result to `out`. Returns each entry's count of matched ops. `debuginfo` keeps the
    ops' source locations in the IR written (the profiler maps dispatches to source ops by them)."""
    names = spec_parts(spec, f"{where}: dispatch spec {spec.name}")["preprocess"]
    marked = out.with_name(out.name + ".marked.mlir")
    _run_transform(input_ir, spec, PREPROCESS_ENTRY_POINT, marked, where, local_scope=False, debuginfo=debuginfo)
    counts = _count(marked, _REWRITTEN, names)
    dynamic = _dynamic_matches(marked)
    if dynamic:
        raise DsaError(f"{where}: dispatch spec {spec.name}",
                       f"entries {', '.join(dynamic)} match convolutions with a dynamic dimension (e.g. "
                       "`tensor<?x...>`), which IREE's Winograd conversion cannot rewrite",
                       "give the model's dynamic dimensions buckets (the manifest's `buckets`, as "
                       "manifests/act.yaml does), or compile with a tuning whose spec has no preprocess entry")
    passes = ",".join(p for _, p in REWRITES.values())
    proc = subprocess.run([iree_opt_path(), str(marked), f"--pass-pipeline=builtin.module(util.func({passes}))",
                           *(["--mlir-print-debuginfo"] if debuginfo else []), "-o", str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise DsaError(f"{where}: dispatch spec {spec.name}",
                       f"iree-opt could not rewrite the marked ops: {first_error_line(proc.stderr).strip()[:300]}",
                       "remove the entries of ops this compiler cannot rewrite from the spec")
    return counts


def preprocess(mlir: Path, flags: Sequence[str], spec: Path, work: Path, where: str, run_compile,
               debuginfo: bool = False) -> Tuple[Path, List[str], Dict[str, int]]:
    """`mlir` with the spec's preprocess entries applied: compiled to the input phase (in `work`) and the marked
    ops rewritten. Returns (the IR to compile on, the flags that resume from it, each entry's match count); when
    the spec has no preprocess entry, (`mlir`, no flag, no count)."""
    if not spec_parts(spec, f"{where}: dispatch spec {spec.name}")["preprocess"]:
        return mlir, [], {}
    input_ir, rewritten = work / "input.mlir", work / "rewritten.mlir"
    run_compile(mlir, [*flags, f"--compile-to={INPUT_PHASE}", *(["--mlir-print-debuginfo"] if debuginfo else [])],
                input_ir)
    counts = apply_preprocess(input_ir, spec, rewritten, where, debuginfo)
    return rewritten, [f"--compile-from={INPUT_PHASE}"], counts


def compile_with_spec(mlir: Path, flags: Sequence[str], spec: Path, out: Path, where: str,
                      run_compile, start_flags: Sequence[str] = (), preprocessed: bool = False) -> Dict[str, int]:
    """iree-compile in phases around the spec (see the module's doc): to the input phase and the preprocess
    entries, when the spec has any (and `mlir` is not `preprocessed` already: executable sources); to
    executable-configurations and the tune entries, when it has any; then to the end. `run_compile(mlir, flags,
    out)` runs iree-compile and raises on failure; `start_flags` go to the compile that leaves the input phase
    (statistics; a --compile-from of executable sources). Returns each entry's match count."""
    parts = spec_parts(spec, f"{where}: dispatch spec {spec.name}")
    with tempfile.TemporaryDirectory(prefix="dsa-dispatch-spec-") as tmp:
        source, resume, counts = mlir, [], {}
        if not preprocessed:
            source, resume, counts = preprocess(mlir, flags, spec, Path(tmp), where, run_compile)
        if parts["tune"]:
            configured = Path(tmp) / "configured.mlir"
            tuned = Path(tmp) / "tuned.mlir"
            run_compile(source, [*flags, *resume, *start_flags, f"--compile-to={CONFIGURED_PHASE}"], configured)
            counts.update(apply_spec(configured, spec, tuned, where))
            run_compile(tuned, [*flags, f"--compile-from={CONFIGURED_PHASE}"], out)
        else:
            run_compile(source, [*flags, *resume, *start_flags], out)
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


_SSA = re.compile(r"%[\w#$.-]+")


def captured_values(op_text: str) -> List[str]:
    """The SSA values `op_text`'s body uses that neither it nor its block arguments define (a constant of the
    dispatch function captured by a linalg.generic's region: a masked softmax's fill value). A matcher cannot
    name them: IREE 3.13's `cast_compatible_dag_from_root` matched none of the ops whose pattern defined such a
    constant itself (measured on SmolVLA's masked softmax), so an entry for such an op cannot be written."""
    body = op_text.split("{", 1)[1] if re.search(r"\}\s*\{", op_text) or "^bb" in op_text else ""
    if not body:
        return []
    defined = set()
    for header in re.findall(r"\^bb\d+\(([^)]*)\)", body):
        defined |= set(_SSA.findall(header))
    for lhs in re.findall(r"^\s*((?:%[\w#$.-]+(?:, )?)+) =", body, re.M):
        defined |= set(_SSA.findall(lhs))
    return [v for v in dict.fromkeys(_SSA.findall(body.split("^bb", 1)[-1])) if v not in defined]


def dag_pattern(op_text: str) -> str:
    """The body of a `cast_compatible_dag_from_root` matcher for `op_text` (a linalg op as IREE prints it, its
    attributes included): its operands become the block's arguments, so any producer matches. An op whose body
    uses values defined outside it (captured_values) is refused."""
    captured = captured_values(op_text)
    if captured:
        raise DsaError("dispatch spec", f"cannot write a matcher for {op_text.strip()[:100]!r}: its body uses "
                                        f"{', '.join(captured)}, defined outside it",
                       "leave this dispatch to IREE (the tuner skips such ops)")
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


def with_ukernels(target: str, ukernels: str) -> str:
    """An executable target (`#hal.executable.target<...>` as IREE prints a variant's) with its `ukernels` set."""
    if not UKERNELS.fullmatch(ukernels):
        raise DsaError("dispatch spec", f"ukernels {ukernels!r} is not a set of IREE's CPU ukernels",
                       "e.g. mmt4d,pack (names joined by commas), all, default or none")
    if not target.startswith("#hal.executable.target<") or len(_UKERNELS_FIELD.findall(target)) != 1:
        raise DsaError("dispatch spec", f"cannot set the ukernels of the executable target {target[:120]!r}",
                       "a bug of the tuner: it passes the variant's target as IREE printed it")
    return _UKERNELS_FIELD.sub(f'ukernels = "{ukernels}"', target)


def write_spec(entries: Sequence[dict], header: Sequence[str] = (), rewrites: Sequence[dict] = ()) -> str:
    """A dispatch spec: `entries` of {"name", "op" (the root op as configured, with IREE's lowering_config),
    "lowering_config" (the one to set)}, and optionally "ukernels" (the ukernels the dispatch is lowered with,
    e.g. "mmt4d,pack") with "target" (the executable target its variant was configured for): the entry then
    also sets the dispatch function's `hal.executable.target`, which IREE's codegen looks up from each op
    before the variant's, to that target with those ukernels; and optionally "siblings" (_sibling_action);
    `rewrites` of {"name", "rewrite" (a REWRITES
    key), "weight" (the 3×3 convolution's weight type, e.g. tensor<64x64x3x3xf32>)}."""
    lines = [f"// {h}" for h in header]
    lines += ["module @dsa_dispatch_spec attributes { transform.with_named_sequence } {"]
    lines += _rewrite_lines(rewrites)
    if not entries:
        return "\n".join(lines + ["}"]) + "\n"
    lines += ["  transform.named_sequence @dsa_set_config(%op: !transform.any_op {transform.readonly},",
              "      %config: !transform.any_param {transform.readonly}, %name: !transform.any_param {transform.readonly}) {",
              '    transform.annotate %op "lowering_config" = %config : !transform.any_op, !transform.any_param',
              f'    transform.annotate %op "{TUNED_ATTR}" = %name : !transform.any_op, !transform.any_param',
              "    transform.yield",
              "  }"]
    if any(e.get("ukernels") for e in entries):
        lines += ["  transform.named_sequence @dsa_set_config_and_ukernels(%op: !transform.any_op {transform.readonly},",
                  "      %config: !transform.any_param {transform.readonly}, %name: !transform.any_param {transform.readonly},",
                  "      %target: !transform.any_param {transform.readonly}) {",
                  '    transform.annotate %op "lowering_config" = %config : !transform.any_op, !transform.any_param',
                  f'    transform.annotate %op "{TUNED_ATTR}" = %name : !transform.any_op, !transform.any_param',
                  '    %fn = transform.get_parent_op %op <op_name = "func.func"> : (!transform.any_op) -> !transform.any_op',
                  f'    transform.annotate %fn "{TARGET_ATTR}" = %target : !transform.any_op, !transform.any_param',
                  "    transform.yield",
                  "  }"]
    for e in entries:
        if not ENTRY_NAME.fullmatch(e["name"]):
            raise DsaError("dispatch spec", f"entry name {e['name']!r} is not a symbol")
        uk = e.get("ukernels")
        params = 3 if uk else 2
        if e.get("siblings"):
            lines += _sibling_action(e, params)
        lines += [
            f"  transform.named_sequence @match_{e['name']}(%op: !transform.any_op {{transform.readonly}})",
            "      -> (!transform.any_op" + ", !transform.any_param" * params + ") {",
            "    %ins, %outs = transform.iree.match.cast_compatible_dag_from_root %op {",
            dag_pattern(e["op"]),
            "    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)",
            f"    %config = transform.param.constant {e['lowering_config']} -> !transform.any_param",
            f'    %name = transform.param.constant "{e["name"]}" -> !transform.any_param']
        if uk:
            target = with_ukernels(e["target"], uk)
            lines += [f"    %target = transform.param.constant {target} -> !transform.any_param",
                      "    transform.yield %op, %config, %name, %target : !transform.any_op, !transform.any_param, "
                      "!transform.any_param, !transform.any_param"]
        else:
            lines += ["    transform.yield %op, %config, %name : !transform.any_op, !transform.any_param, "
                      "!transform.any_param"]
        lines += ["  }"]
    matches = ",\n        ".join(f"@match_{e['name']} -> " + (
        f"@dsa_set_{e['name']}" if e.get("siblings") else
        "@dsa_set_config" + ("_and_ukernels" if e.get("ukernels") else "")) for e in entries)
    lines += [f"  transform.named_sequence @{ENTRY_POINT}(%root: !transform.any_op {{transform.consumed}}) {{",
              f"    %res = transform.foreach_match in %root\n        {matches}",
              "      : (!transform.any_op) -> !transform.any_op",
              "    transform.yield",
              "  }",
              "}"]
    return "\n".join(lines) + "\n"


def _sibling_action(entry: dict, params: int) -> List[str]:
    """The action of an entry with `siblings` ([{"from": IREE's lowering_config, "to": the one to set}]): the
    other ops of the root op's dispatch function that IREE configured with a `from` config get its `to` (the
    ops of a decomposed softmax or normalisation share one loop nest: their reduction and inner-parallel
    vector tiles are chosen together with the root op's), then the root op is set as by @dsa_set_config."""
    for s in entry["siblings"]:
        for key in ("from", "to"):
            if not CPU_CONFIG.fullmatch(s.get(key, "")):
                raise DsaError("dispatch spec", f"entry {entry['name']}: sibling {key} {s.get(key)!r} is not a "
                                                "CPU lowering_config (#iree_cpu.lowering_config<...>)")
        if s["from"] in entry["op"] and "distribution" in s["from"]:
            raise DsaError("dispatch spec", f"entry {entry['name']}: a sibling's from config is the root op's own")
    lines = [f"  transform.named_sequence @dsa_set_{entry['name']}(%op: !transform.any_op {{transform.readonly}},",
             "      %config: !transform.any_param {transform.readonly}, %name: !transform.any_param {transform.readonly}"
             + (",\n      %target: !transform.any_param {transform.readonly}) {" if params == 3 else ") {"),
             '    %fn = transform.get_parent_op %op <op_name = "func.func"> : (!transform.any_op) -> !transform.any_op']
    for i, s in enumerate(entry["siblings"]):
        lines += [f"    %s{i} = transform.structured.match attributes {{lowering_config = {s['from']}}} in %fn",
                  "      : (!transform.any_op) -> !transform.any_op",
                  f"    %c{i} = transform.param.constant {s['to']} -> !transform.any_param",
                  f'    transform.annotate %s{i} "lowering_config" = %c{i} : !transform.any_op, !transform.any_param']
    lines += ['    transform.annotate %op "lowering_config" = %config : !transform.any_op, !transform.any_param',
              f'    transform.annotate %op "{TUNED_ATTR}" = %name : !transform.any_op, !transform.any_param']
    if params == 3:
        lines += [f'    transform.annotate %fn "{TARGET_ATTR}" = %target : !transform.any_op, !transform.any_param']
    return lines + ["    transform.yield", "  }"]


def _rewrite_lines(rewrites: Sequence[dict]) -> List[str]:
    """The `@rewrite_<name>` entries and `@__dsa_preprocess` of a spec (none when `rewrites` is empty)."""
    if not rewrites:
        return []
    lines = []
    for kind, (marker, _) in REWRITES.items():
        lines += [f"  transform.named_sequence @dsa_{kind}(%op: !transform.any_op {{transform.readonly}},",
                  "      %name: !transform.any_param {transform.readonly}) {",
                  f'    transform.annotate %op "{marker}" : !transform.any_op',
                  f'    transform.annotate %op "{REWRITTEN_ATTR}" = %name : !transform.any_op, !transform.any_param',
                  "    transform.yield",
                  "  }"]
    for r in rewrites:
        if not ENTRY_NAME.fullmatch(r["name"]):
            raise DsaError("dispatch spec", f"entry name {r['name']!r} is not a symbol")
        if r["rewrite"] not in REWRITES:
            raise DsaError("dispatch spec", f"entry {r['name']}: unknown rewrite {r['rewrite']!r}",
                           f"known: {', '.join(REWRITES)}")
        if not re.fullmatch(r"tensor<\d+x\d+x3x3xf32>", r["weight"]):
            raise DsaError("dispatch spec", f"entry {r['name']}: weight {r['weight']!r} is not a 3×3 "
                                            "convolution's weight type (tensor<OxIx3x3xf32>)")
        lines += [
            f"  transform.named_sequence @rewrite_{r['name']}(%op: !transform.any_op {{transform.readonly}})",
            "      -> (!transform.any_op, !transform.any_param) {",
            '    transform.match.operation_name %op ["linalg.conv_2d_nchw_fchw"] : !transform.any_op',
            "    %w = transform.get_operand %op[1] : (!transform.any_op) -> !transform.any_value",
            f"    transform.iree.match.cast_compatible_type %w = {r['weight']} : !transform.any_value",
            "    // Only a convolution into a zero fill: the rewrite drops the init (a bias there would be lost).",
            "    %init = transform.get_producer_of_operand %op[2] : (!transform.any_op) -> !transform.any_op",
            "    %fill_ins, %fill_outs = transform.iree.match.cast_compatible_dag_from_root %init {",
            "    ^bb0(%a: tensor<?x?x?x?xf32>):",
            "      %zero = arith.constant 0.000000e+00 : f32",
            "      %f = linalg.fill ins(%zero : f32) outs(%a : tensor<?x?x?x?xf32>) -> tensor<?x?x?x?xf32>",
            "    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)",
            f'    %name = transform.param.constant "{r["name"]}" -> !transform.any_param',
            "    transform.yield %op, %name : !transform.any_op, !transform.any_param",
            "  }"]
    matches = ",\n        ".join(f"@rewrite_{r['name']} -> @dsa_{r['rewrite']}" for r in rewrites)
    lines += [f"  transform.named_sequence @{PREPROCESS_ENTRY_POINT}(",
              "      %root: !transform.any_op {transform.consumed}) {",
              f"    %res = transform.foreach_match in %root\n        {matches}",
              "      : (!transform.any_op) -> !transform.any_op",
              "    transform.yield",
              "  }"]
    return lines


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
        config = CPU_CONFIG.search(op)
        out.append({"op": op, "lowering_config": config.group(0), "function": function})
    return out


def write_spec_file(path: Path, entries: Sequence[dict], header: Sequence[str] = (),
                    rewrites: Sequence[dict] = ()) -> None:
    with atomic_output(path) as tmp:
        tmp.write_text(write_spec(entries, header, rewrites))
