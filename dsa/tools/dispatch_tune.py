"""dsa tune-dispatches: measure lowering configurations of a model's heaviest dispatches; keep the winners as a
dispatch spec (dsa/stages/dispatch_spec.py) with their evidence.

    dsa profile --manifest M ... --keep DIR --json DIR/profile.json      # what is heavy, and the build's IR
    dsa tune-dispatches --profile-dir DIR --out toolchains/tuning/<family>.<target>.spec.mlir

For each of the profile's top dispatches (by time per call of the model) whose root op the tuner knows how to
tile (IREE's data-tiled CPU convolution, the `Mmt4dTilingExpert` 9-D generic that ResNet backbones become on
AVX-512; and its data-tiled matmul, `linalg.mmt4d`/`linalg.batch_mmt4d` lowered to the mmt4d ukernel), it
builds a standalone benchmark of that one dispatch (IREE's own `--iree-hal-dump-executable-benchmarks-to`,
with the executable as the build compiles it), compiles it to executable-configurations, and times IREE's
configuration against candidate tile sizes — for a convolution the register tile (output channels × rows ×
columns held in vector registers), for a matmul the ukernel's extent (how many m0 × n0 tiles one call
computes); then the distribution tile (the work of one workgroup, keeping at least MIN_WORKGROUPS of them);
where the dispatch holds a pack or unpack and the build enables every ukernel, each also without that op's
ukernel (`ukernel_alternatives`) — with iree-benchmark-module on one thread (`--threads`),
in alternating rounds (each candidate's time over IREE's in the same round: a machine that slows down mid-run
biases none). A candidate is kept when the median of its ratios is at
most `--keep-below` (default 0.9: the 2-core machines this runs on vary ±10% run to run) and a confirming run
agrees. Then the whole model is compiled with the spec: every entry must match, the outputs must equal the
untuned module's (|x − y| ≤ 2e-4·max(1, |y|), on the profile's inputs), and both are timed. Nothing is written
unless all of that holds; the evidence file records every dispatch measured, what was chosen and why. A
profile taken with a spec's preprocess entries (Winograd) has executables that exist only with them: the spec
written keeps them, read from the spec `--tuning` pins, with their evidence (`carried_rewrites`).

`--winograd` searches another decision, made before configuration: for each weight shape of the model's 3×3
stride-1 convolutions, IREE's lowering (x86-64-v3: im2col + data-tiled matmul) against Winograd F(6×6, 3×3),
each compiled standalone and timed the same way; the winners become the spec's preprocess entries
(dsa/stages/dispatch_spec.py), under the same whole-model gate.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import read_json, sha256_file, write_json_atomic
from dsa.stages import dispatch_spec
from dsa.runtime.host import host_cpu_model
from dsa.stages.compile import compiler_version, run_iree_compile
from dsa.stages.iree_tools import iree_compile_path

EVIDENCE_FORMAT = 1
# Dispatches are timed on one thread: on the 2-core machines this runs on, one worker's time varies ±4% run
# to run, two workers' ±30% (the second core is shared with the host). Tile sizes decide one workgroup's speed;
# the distribution candidates keep at least this many workgroups, so that the runtime's threads stay balanced.
MIN_WORKGROUPS = 8
PARITY_TOLERANCE = 2e-4
_CONFIG_FIELDS = re.compile(r"(\w+) = \[([0-9, ]*)\]")


# -- the standalone benchmark of one dispatch ------------------------------------------------------------------


def executable_block(text: str, name: str, where: str) -> Tuple[int, int, List[str]]:
    """(first line, last line, lines) of `hal.executable private @name` at the top level of a module."""
    lines = text.split("\n")
    head = f"  hal.executable private @{name} {{"
    try:
        first = lines.index(head)
    except ValueError:
        raise DsaError(where, f"has no executable @{name}") from None
    last = next((k for k in range(first + 1, len(lines)) if lines[k].startswith("  }")), None)
    if last is None:
        raise DsaError(where, f"executable @{name} does not end")
    return first, last, lines


def standalone_benchmark(benchmark_text: str, sources_text: str, executable: str) -> str:
    """IREE's benchmark module of one executable, with the executable as the build's sources hold it (before
    configuration): compiled, it is configured by the same heuristics as in the whole model, so a spec entry
    written from it matches the whole model's op."""
    s_first, s_last, s_lines = executable_block(sources_text, executable, "executable sources")
    b_first, b_last, b_lines = executable_block(benchmark_text, executable, "executable benchmark")
    return "\n".join(b_lines[:b_first] + s_lines[s_first:s_last + 1] + b_lines[b_last + 1:])


# -- candidates -------------------------------------------------------------------------------------------------


def parse_config(config: str) -> Dict[str, List[int]]:
    return {k: [int(x) for x in v.split(",") if x.strip()] for k, v in _CONFIG_FIELDS.findall(config)}


def format_config(fields: Dict[str, List[int]]) -> str:
    body = ", ".join(f"{k} = [{', '.join(map(str, v))}]" for k, v in fields.items())
    return f"#iree_cpu.lowering_config<{body}>"


def conv_shape(op: str) -> Optional[Dict[str, int]]:
    """The sizes of IREE's data-tiled convolution (a linalg.generic over (n, oc_o, oh, ow, ic_o, kh, kw, oc_i,
    ic_i) writing (n, oc_o, oh, ow, oc_i)), or None when `op` is not one."""
    if not op.startswith(("%", "linalg.generic")) or "linalg.generic" not in op.split("\n")[0]:
        return None
    maps = re.findall(r"affine_map<\(d0, d1, d2, d3, d4, d5, d6, d7, d8\) -> \(([^)]*)\)>", op)
    if len(maps) != 3 or maps[2].replace(" ", "") != "d0,d1,d2,d3,d7":
        return None
    outs = re.search(r"outs\(%[\w#]+ : tensor<(\d+)x(\d+)x(\d+)x(\d+)x(\d+)x\w+>\)", op)
    if not outs:
        return None
    n, oco, oh, ow, oci = map(int, outs.groups())
    return {"n": n, "oc_o": oco, "oh": oh, "ow": ow, "oc_i": oci}


_MMT4D = re.compile(r"(?:%[\w#:]+ = )?linalg\.(batch_)?mmt4d ")


def mmt4d_shape(op: str) -> Optional[Dict[str, int]]:
    """The sizes of IREE's data-tiled matmul (`linalg.mmt4d` over (m1, n1, k1, m0, n0, k0), `linalg.batch_mmt4d`
    with a batch dimension before them: LHS [b, m1, k1, m0, k0], RHS [b, n1, k1, n0, k0]), or None when `op` is
    not one."""
    m = _MMT4D.match(op)
    if not m:
        return None
    ins = re.search(r"ins\(%[\w#]+, %[\w#]+ : tensor<([0-9x]+)x\w+>, tensor<([0-9x]+)x\w+>\)", op)
    if not ins:
        return None
    lhs, rhs = ([int(x) for x in s.split("x")] for s in ins.groups())
    batched = m.group(1) is not None
    if len(lhs) != 4 + batched or len(rhs) != 4 + batched:
        return None
    if not batched:
        lhs, rhs = [1] + lhs, [1] + rhs
    return {"batched": int(batched), "b": lhs[0], "m1": lhs[1], "k1": lhs[2], "m0": lhs[3], "k0": lhs[4],
            "n1": rhs[1], "n0": rhs[3]}


def _mmt4d_fields(op: str, config: str) -> Optional[Tuple[Dict[str, int], Dict[str, List[int]], int]]:
    """(shape, config fields, index of m1 in the config's lists) of a data-tiled matmul, or None."""
    shape = mmt4d_shape(op)
    fields = parse_config(config)
    if shape is None or not {"distribution", "vector_common_parallel"} <= set(fields):
        return None
    rank = 6 + shape["batched"]
    if any(len(v) != rank for v in fields.values()):
        return None
    return shape, fields, shape["batched"]


def mmt4d_candidates(op: str, default: str) -> List[Tuple[str, str]]:
    """(name, lowering_config) candidates for a data-tiled matmul lowered to IREE's mmt4d ukernel: how many
    (m0 × n0) tiles one call of the ukernel computes (vector_common_parallel's m1 × n1: stage "v"; one tile
    reloads its accumulators and the LHS panel per call), each inside IREE's distribution tile."""
    found = _mmt4d_fields(op, default)
    if found is None:
        return []
    shape, fields, i = found
    dist = fields["distribution"]
    d_m1 = dist[i] or shape["m1"]
    d_n1 = dist[i + 1] or shape["n1"]
    out = []
    for v_m1 in sorted({d for d in _divisors(shape["m1"]) if d <= 8}):
        for v_n1 in sorted({d for d in _divisors(shape["n1"]) if d <= 8} | {d_n1}):
            vcp = list(fields["vector_common_parallel"])
            vcp[i], vcp[i + 1] = v_m1, v_n1
            new_dist = list(dist)  # a workgroup holds whole ukernel calls
            new_dist[i] = -(-d_m1 // v_m1) * v_m1 if dist[i] else 0
            new_dist[i + 1] = -(-d_n1 // v_n1) * v_n1 if dist[i + 1] else 0
            workgroups = shape["b"] * -(-shape["m1"] // (new_dist[i] or shape["m1"])) * \
                -(-shape["n1"] // (new_dist[i + 1] or shape["n1"]))
            config = format_config(dict(fields, vector_common_parallel=vcp, distribution=new_dist))
            if config != format_config(fields) and (new_dist == dist or workgroups >= MIN_WORKGROUPS):
                out.append((f"v{v_m1}x{v_n1}", config))
    return out


def mmt4d_distribution_candidates(op: str, base: str) -> List[Tuple[str, str]]:
    """Distribution tiles (m1 × n1 tiles per workgroup) around the ukernel extent of `base`."""
    found = _mmt4d_fields(op, base)
    if found is None:
        return []
    shape, fields, i = found
    vcp = fields["vector_common_parallel"]
    out = []
    base_dist = fields["distribution"]
    # Multiples of the ukernel's extent (a workgroup holds whole calls) and the base's own: a few sizes per
    # dimension, not every divisor (a 400-tile N would give dozens of candidates that differ by a percent).
    m_tiles = sorted({vcp[i] * k for k in (1, 2, 4) if vcp[i] * k <= shape["m1"]} | ({base_dist[i]} - {0}))
    n_tiles = sorted({vcp[i + 1] * k for k in (1, 2, 4, 8) if vcp[i + 1] * k <= shape["n1"]} |
                     ({base_dist[i + 1]} - {0}))
    for d_m1 in m_tiles:
        for d_n1 in n_tiles:
            workgroups = shape["b"] * -(-shape["m1"] // d_m1) * -(-shape["n1"] // d_n1)
            if workgroups < MIN_WORKGROUPS:
                continue
            dist = list(fields["distribution"])
            dist[i], dist[i + 1] = d_m1, d_n1
            config = format_config(dict(fields, distribution=dist))
            if config != base:
                out.append((f"d{d_m1}x{d_n1}", config))
    return out


# The vector tiles tried along a reduced dimension (a softmax's or a normalisation's row): IREE gives 16 (one
# AVX-512 register) with a scalar tail, and its decomposed softmax runs at a fraction of memory speed there
# (measured: ACT's 8x302x302 softmax, 2.0 ms standalone on one thread; 1.1 ms with 64).
REDUCTION_TILES = (16, 32, 64, 128)


def _reduction_fields(op: str, config: str) -> Optional[Tuple[Dict[str, List[int]], int, List[int]]]:
    """(config fields, the reduced extent, the iteration space's sizes) of a reduction root op IREE tiled with
    vector_reduction along one dimension (a linalg.generic whose first input spans its iteration space), or
    None when `op` is not one."""
    fields = parse_config(config)
    if not re.match(r"(%[\w#:]+ = )?linalg\.generic ", op) or '"reduction"' not in op or \
            not {"distribution", "vector_common_parallel", "vector_reduction"} <= set(fields):
        return None
    rank = len(fields["distribution"])
    types = re.search(r"ins\([^:]*: (tensor<[0-9x]+x[a-z0-9]+>)", op)
    sizes = [int(x) for x in types.group(1)[len("tensor<"):].split("x")[:-1]] if types else []
    reduced = [i for i, v in enumerate(fields["vector_reduction"]) if v]
    if len(sizes) != rank or any(len(v) != rank for v in fields.values()) or len(reduced) != 1:
        return None
    return fields, sizes[reduced[0]], sizes


def reduction_siblings(configured: str, root_config: str) -> List[str]:
    """The other CPU lowering_configs of a reduction's dispatch that tile along its reduced dimension (the
    decomposed softmax's max and normalisation: vector_reduction or vector_inner_parallel); they take the root
    op's vector tile with it."""
    out = []
    for c in dict.fromkeys(dispatch_spec.CPU_CONFIG.findall(configured)):
        f = parse_config(c)
        if c != root_config and "distribution" not in f and ({"vector_reduction", "vector_inner_parallel"} & set(f)):
            out.append(c)
    return out


def _retile(config: str, tile: int) -> str:
    """`config` with its nonzero vector_reduction and vector_inner_parallel entries set to `tile`."""
    fields = parse_config(config)
    for key in ("vector_reduction", "vector_inner_parallel"):
        if key in fields:
            fields[key] = [tile if v else 0 for v in fields[key]]
    return format_config(fields)


def reduction_candidates(op: str, default: str, configured: str) -> List[tuple]:
    """(name, root lowering_config, siblings) candidates for a reduction: the vector tile along the reduced
    dimension, the root op's and its siblings' reductions together (r), and the siblings' inner-parallel tile
    (the normalisation's, p) on its own; siblings as ((IREE's config, the one to set), ...)."""
    found = _reduction_fields(op, default)
    if found is None:
        return []
    fields, extent, _ = found
    siblings = reduction_siblings(configured, default)
    tiles = [t for t in REDUCTION_TILES if t <= max(extent, REDUCTION_TILES[0])]
    out = []
    for r in tiles:
        for p in tiles:
            root = _retile(default, r)
            sib = tuple((c, _retile(c, r if "vector_reduction" in c else p)) for c in siblings)
            sib = tuple(x for x in sib if x[0] != x[1])
            if root != default or sib:
                out.append((f"r{r}p{p}", root, sib))
    return out


def reduction_distribution_candidates(op: str, base: str) -> List[Tuple[str, str]]:
    """Distribution tiles (the parallel dimensions' rows per workgroup) around `base`, multiples of its vector
    tile so that the siblings' vector tiles still fit."""
    found = _reduction_fields(op, base)
    if found is None:
        return []
    fields, _, sizes = found
    vcp, dist = fields["vector_common_parallel"], fields["distribution"]
    choices = []
    for i, d in enumerate(dist):
        if not d or not vcp[i]:
            choices.append([d])
        else:
            choices.append(sorted({vcp[i] * k for k in (1, 2, 4, 8) if vcp[i] * k <= sizes[i]} | {d}))
    out = []
    for new in itertools.product(*choices):
        workgroups = 1
        for i, d in enumerate(new):
            workgroups *= -(-sizes[i] // d) if d else 1
        config = format_config(dict(fields, distribution=list(new)))
        if config != base and workgroups >= MIN_WORKGROUPS:
            out.append(("d" + "x".join(str(d) for d in new if d), config))
    return out


# The ukernels a variant is lowered with, and the sets a dispatch is also timed with: on x86 IREE's pack and
# unpack ukernels have fast paths only for direct tiles (runtime/src/iree/builtins/ukernel/arch/x86_64), so a
# transposing unpack fused into a matmul dispatch (the result of a matmul whose N is the smaller dimension:
# IREE computes its transpose) runs element by element; without the unpack ukernel, codegen vectorises it.
_VARIANT_UKERNELS = re.compile(r'ukernels = "([^"]*)"')
_VARIANT_TARGET = re.compile(r"^\s*hal\.executable\.variant public @\w+ target\((<.*>)\)(?: \{)?$", re.M)


def ukernel_alternatives(configured: str) -> List[str]:
    """The ukernel sets a dispatch is timed with besides its build's: with `all`, without the pack or unpack
    ukernel when the dispatch holds a pack or unpack (none otherwise)."""
    found = set(_VARIANT_UKERNELS.findall(configured))
    if found != {"all"}:
        return []
    ops = [name for name in ("pack", "unpack") if re.search(rf"= linalg\.{name} ", configured)]
    return [",".join(["mmt4d"] + [o for o in ("pack", "unpack") if o != drop]) for drop in ops]


def variant_target(configured: str, where: str) -> str:
    """The executable target of the (one) variant of a configured standalone dispatch, as an attribute."""
    targets = _VARIANT_TARGET.findall(configured)
    if len(targets) != 1:
        raise DsaError(where, f"has {len(targets)} executable variants (a standalone dispatch has one)")
    return "#hal.executable.target" + targets[0]


def _divisors(x: int) -> List[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


def conv_candidates(op: str, default: str, vector_registers: int) -> List[Tuple[str, str]]:
    """(name, lowering_config) candidates for a data-tiled convolution: register tiles (stage "v"), each with
    IREE's distribution; the distribution tiles are searched around the best register tile afterwards
    (`distribution_candidates`)."""
    shape = conv_shape(op)
    fields = parse_config(default)
    if shape is None or set(fields) != {"distribution", "vector_common_parallel", "vector_reduction"} or \
            len(fields["vector_common_parallel"]) != 9:
        return []
    budget = vector_registers - 4  # accumulators; the rest hold the filter vector and broadcasts
    ow_tiles = sorted({d for d in _divisors(shape["ow"]) if 2 <= d <= 32} | {8, 16} & set(range(1, shape["ow"] + 1)))
    out = []
    for v_oc in (1, 2):
        if shape["oc_o"] % v_oc:
            continue
        for v_oh in (1, 2, 4):
            if v_oh > shape["oh"]:
                continue
            for v_ow in ow_tiles:
                acc = v_oc * v_oh * v_ow
                if not 4 <= acc <= budget:
                    continue
                vcp = list(fields["vector_common_parallel"])
                vcp[1], vcp[2], vcp[3] = v_oc, v_oh, v_ow
                dist = list(fields["distribution"])
                dist[1] = max(dist[1], v_oc) if dist[1] else 0
                dist[2] = max(dist[2], v_oh) if dist[2] else 0
                cand = dict(fields, vector_common_parallel=vcp, distribution=dist)
                config = format_config(cand)
                if config != format_config(fields):
                    out.append((f"v{v_oc}x{v_oh}x{v_ow}", config))
    return out


def distribution_candidates(op: str, base: str) -> List[Tuple[str, str]]:
    """Distribution tiles (output-channel blocks × rows per workgroup) around the register tile of `base`."""
    shape = conv_shape(op)
    fields = parse_config(base)
    vcp = fields["vector_common_parallel"]
    out = []
    oc_tiles = sorted({d for d in (1, 2, 4, 8) if shape["oc_o"] % d == 0 and d >= vcp[1]})
    rows = shape["oh"]
    oh_tiles = sorted({d for d in _divisors(rows) if d >= vcp[2] and d % vcp[2] == 0 and (d <= 16 or d == rows)})
    for d_oc in oc_tiles:
        for d_oh in oh_tiles:
            workgroups = shape["n"] * (shape["oc_o"] // d_oc) * -(-rows // d_oh)
            if workgroups < MIN_WORKGROUPS:  # too few to keep every thread of the runtime busy
                continue
            dist = list(fields["distribution"])
            dist[1], dist[2] = d_oc, d_oh
            config = format_config(dict(fields, distribution=dist))
            if config != base:
                out.append((f"d{d_oc}x{d_oh}", config))
    return out


# -- measuring ---------------------------------------------------------------------------------------------------


class Bench:
    """Compiles candidates of one standalone dispatch and times them in alternating rounds."""

    def __init__(self, configured: str, root_config: str, work: Path, driver: str, where: str, threads: int = 1,
                 inputs: Sequence[str] = ()):
        self.configured, self.root_config, self.work, self.driver, self.where = configured, root_config, work, driver, where
        self.threads, self.inputs = threads, list(inputs)
        self.modules: Dict[str, Path] = {}
        self.failed: Dict[str, str] = {}

    def compile(self, name: str, config: str, ukernels: Optional[str] = None,
                siblings: Sequence[Tuple[str, str]] = ()) -> bool:
        """Compiles the dispatch with `config` as its root op's lowering_config, its other ops' `siblings`
        ((IREE's config, the one to set), ...) replaced, and, when `ukernels` is given, lowered with those
        ukernels (what a spec entry's `hal.executable.target` does to the dispatch)."""
        if name in self.modules:
            return True
        text = self.configured
        for old, new in siblings:
            text = text.replace(f"lowering_config = {old}", f"lowering_config = {new}")
        text = text.replace(f"lowering_config = {self.root_config}", f"lowering_config = {config}", 1)
        if ukernels is not None:
            text = _VARIANT_UKERNELS.sub(f'ukernels = "{ukernels}"', text)
        src = self.work / f"{name}.mlir"
        src.write_text(text)
        vmfb = self.work / f"{name}.vmfb"
        proc = subprocess.run([iree_compile_path(), str(src), f"--compile-from={dispatch_spec.CONFIGURED_PHASE}",
                               "-o", str(vmfb)], capture_output=True, text=True)
        src.unlink()
        if proc.returncode != 0:
            lines = [l for l in proc.stderr.splitlines() if "error:" in l]
            self.failed[name] = (lines[0] if lines else "no message").split("error:", 1)[-1].strip()[:200]
            return False
        self.modules[name] = vmfb
        return True

    def time_us(self, name: str, min_time: float) -> float:
        from dsa.tools.profiler.runner import runtime_tool_path

        cmd = [runtime_tool_path("iree-benchmark-module"), f"--module={self.modules[name]}",
               f"--device={self.driver}", f"--task_topology_max_group_count={self.threads}",
               f"--benchmark_min_time={min_time}s", "--benchmark_format=json",
               *(["--function=main", *self.inputs] if self.inputs else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        try:
            bench = json.loads(proc.stdout[proc.stdout.index("{"):])["benchmarks"][0]
        except (ValueError, KeyError, IndexError):
            raise DsaError(self.where, f"iree-benchmark-module failed: {proc.stderr.strip()[-300:]}",
                           f"reproduce with: {' '.join(cmd)}") from None
        unit = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[bench.get("time_unit", "ns")]
        return float(bench["real_time"]) * unit

    def rounds(self, names: Sequence[str], rounds: int, min_time: float, seed: int) -> Dict[str, dict]:
        """Each name's times and its median ratio to "default" (timed in every round, in a shuffled order). A
        candidate whose module fails to run (a tile IREE compiles but cannot execute: measured, a crash) is
        dropped and recorded in `failed`; IREE's own failing stops the search."""
        order = ["default"] + [n for n in names if n != "default" and n not in self.failed]
        times: Dict[str, List[float]] = {n: [] for n in order}
        rng = random.Random(seed)
        for _ in range(rounds):
            shuffled = list(order)
            rng.shuffle(shuffled)
            for n in shuffled:
                if n in self.failed:
                    continue
                try:
                    times[n].append(self.time_us(n, min_time))
                except DsaError as e:
                    if n == "default":
                        raise
                    self.failed[n] = f"failed to run: {e}"[:300]
        times = {n: t for n, t in times.items() if n not in self.failed}
        base = times["default"]
        return {n: {"us": statistics.median(t), "min_us": min(t),
                    "ratio": statistics.median(x / b for x, b in zip(t, base))} for n, t in times.items()}


def search_space(op: str, default: str, vector_registers: int, configured: str = ""):
    """(first-stage candidates, the distribution candidates around a configuration) for a root op the tuner
    tiles, or None for one it does not. A first-stage candidate is (name, lowering_config) or (name,
    lowering_config, siblings: the other ops' configs it changes, ((IREE's, new), ...))."""
    if conv_shape(op) is not None:
        return conv_candidates(op, default, vector_registers), lambda c: distribution_candidates(op, c)
    if mmt4d_shape(op) is not None:
        return mmt4d_candidates(op, default), lambda c: mmt4d_distribution_candidates(op, c)
    if _reduction_fields(op, default) is not None:
        return reduction_candidates(op, default, configured), lambda c: reduction_distribution_candidates(op, c)
    return None


def tune_dispatch(configured: str, root: dict, work: Path, *, driver: str, vector_registers: int, rounds: int,
                  min_time: float, keep_below: float, where: str, log, threads: int = 1) -> dict:
    """Searches one dispatch; returns its evidence row (with "chosen" when a candidate won, and
    "chosen_ukernels" when it won with other ukernels than the build's)."""
    bench = Bench(configured, root["lowering_config"], work, driver, where, threads)
    if not bench.compile("default", root["lowering_config"]):
        return {"skipped": f"IREE's own configuration does not compile standalone: {bench.failed['default']}"}
    first_stage, around = search_space(root["op"], root["lowering_config"], vector_registers, configured)
    # name -> (lowering_config, ukernels or None for the build's, siblings: the other ops' configs changed)
    configs: Dict[str, Tuple[str, Optional[str], tuple]] = {"default": (root["lowering_config"], None, ())}
    for n, c, *sib in first_stage:
        configs[n] = (c, None, tuple(sib[0]) if sib else ())
    tiles = list(configs.items())
    for uk in ukernel_alternatives(configured):  # each tile candidate, and IREE's, also with other ukernels
        tag = "uk_" + uk.replace(",", "_")
        for n, (c, _, sib) in tiles:
            configs[f"{n}_{tag}" if n != "default" else tag] = (c, uk, sib)
    stage1 = [n for n in configs if n != "default" and bench.compile(n, *configs[n])]
    first = bench.rounds(stage1, max(2, rounds // 2), min_time, seed=1)
    ranked = sorted((n for n in first if n != "default"), key=lambda n: first[n]["ratio"])
    stage2 = []
    for best in dict.fromkeys(ranked[:2] + ["default"]):  # distribution tiles around the best two and IREE's
        config, uk, sib = configs[best]
        for n, c in around(config):
            name = f"{best}_{n}"
            if bench.compile(name, c, uk, sib):
                configs[name] = (c, uk, sib)
                stage2.append(name)
    second = bench.rounds(ranked[:4] + stage2, max(2, rounds // 2), min_time, seed=2)
    finalists = sorted((n for n in second if n != "default"), key=lambda n: second[n]["ratio"])[:3]
    final = bench.rounds(finalists, rounds, min_time, seed=3)
    best = min(finalists, key=lambda n: final[n]["ratio"]) if finalists else None
    row = {"default_config": root["lowering_config"], "default_us": final["default"]["us"],
           "candidates": len(set(stage1) | set(stage2) | set(bench.failed)),
           "failed_to_compile": sum(not why.startswith("failed to run") for why in bench.failed.values()),
           "failed_to_run": sorted(n for n, why in bench.failed.items() if why.startswith("failed to run")),
           "finalists": [dict({"name": n, "config": configs[n][0], "us": final[n]["us"], "ratio": final[n]["ratio"]},
                              **({"ukernels": configs[n][1]} if configs[n][1] else {}),
                              **({"siblings": _sibling_rows(configs[n][2])} if configs[n][2] else {}))
                         for n in finalists]}
    # Kept only when faster both ways: the median of its per-round ratios to IREE's (robust to a machine that
    # drifts) and its median time against IREE's median time (robust to one lucky round).
    if best is not None and final[best]["ratio"] <= keep_below and \
            final[best]["us"] <= keep_below * final["default"]["us"]:
        row.update(chosen=best, chosen_config=configs[best][0], chosen_us=final[best]["us"],
                   ratio=final[best]["ratio"])
        if configs[best][1]:
            row["chosen_ukernels"] = configs[best][1]
        if configs[best][2]:
            row["chosen_siblings"] = _sibling_rows(configs[best][2])
    else:
        row["kept_default"] = (f"no candidate's median time was at most {keep_below} of IREE's (best: {best}, "
                               f"ratio {final[best]['ratio']:.2f}, {final[best]['us'] / 1e3:.2f} ms)"
                               if best else "no candidate compiled")
    log(f"  default {row['default_us'] / 1e3:.2f} ms; " + (
        f"chosen {best} {row['chosen_us'] / 1e3:.2f} ms ({row['ratio']:.2f}x)" if "chosen" in row
        else row["kept_default"]))
    for name in list(bench.modules.values()):
        name.unlink(missing_ok=True)
    return row


def _sibling_rows(siblings: Sequence[Tuple[str, str]]) -> List[dict]:
    return [{"from": a, "to": b} for a, b in siblings]


# -- Winograd per weight shape (a spec's preprocess entries) ----------------------------------------------------

_STRIDE1_CONV3X3 = re.compile(
    r"linalg\.conv_2d_nchw_fchw \{dilations = dense<1> : (?:vector|tensor)<2xi64>, strides = dense<1> : "
    r"(?:vector|tensor)<2xi64>\} ins\(%[^,]+, %[^ ]+ : (tensor<[0-9x]+xf32>), (tensor<(\d+)x(\d+)x3x3xf32>)\) "
    r"outs\((%[^ ]+) : (tensor<[0-9x]+xf32>)\)")


def _zero_fill(input_ir: str, value: str) -> bool:
    """Whether `value` is defined by a linalg.fill of an arith.constant 0.0 in `input_ir`."""
    fill = re.search(re.escape(value) + r" = linalg\.fill ins\((%[\w.]+) : f32\)", input_ir)
    return bool(fill) and re.search(re.escape(fill.group(1)) + r" = arith\.constant 0\.0+e\+00 : f32",
                                    input_ir) is not None


# The weight is a parameter, as the model's weights are: what IREE computes from a parameter (the data-tiled
# packing, Winograd's filter transform) it hoists into the module's initializer when the result fits the build's
# const-expr size limit (`--iree-opt-const-expr-max-size-increase-threshold`), and recomputes on every call when
# it does not. The standalone module then pays per call what the model's pays.
BENCH_SCOPE = "dsa_bench"
STANDALONE_CONV = f'util.global private @w = #flow.parameter.named<"{BENCH_SCOPE}"::"w"> : {{weight}}' + """
func.func @main(%x: {input}) -> {output} {{
  %w = util.global.load @w : {weight}
  %zero = arith.constant 0.0 : f32
  %empty = tensor.empty() : {output}
  %init = linalg.fill ins(%zero : f32) outs(%empty : {output}) -> {output}
  %y = linalg.conv_2d_nchw_fchw {{dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}}
      ins(%x, %w : {input}, {weight}) outs(%init : {output}) -> {output}
  return %y : {output}
}}
"""


def winograd_candidates(input_ir: str) -> Tuple[List[dict], List[dict]]:
    """The convolutions of IR compiled to the input phase that IREE's Winograd conversion takes (3×3, stride 1,
    dilation 1, f32, static) into a zero fill (what a spec entry matches), one per weight type: {"name",
    "weight", "input", "output" (the first occurrence's types), "count"}; and those skipped for their init."""
    out: Dict[str, dict] = {}
    skipped: Dict[str, dict] = {}
    # SSA names are scoped by function: each convolution's init is looked up in its own function's text.
    functions = re.split(r"(?m)^(?=\s*(?:util|func)\.func )", input_ir)
    for function, m in ((f, m) for f in functions for m in _STRIDE1_CONV3X3.finditer(f)):
        weight = m.group(2)
        name = f"conv3x3_{m.group(3)}x{m.group(4)}"
        if not _zero_fill(function, m.group(5)):
            skipped.setdefault(weight, {"entry": name, "weight": weight, "convolutions": 0,
                                        "why": "its init is not a zero fill (a bias: Winograd would drop it; the "
                                               "default rewrite split_conv_bias splits it off)"})
            skipped[weight]["convolutions"] += 1
            continue
        if weight in out:
            out[weight]["count"] += 1
            continue
        out[weight] = {"name": name, "weight": weight, "input": m.group(1), "output": m.group(6), "count": 1}
    return list(out.values()), list(skipped.values())


def _shape_and_type(tensor_type: str) -> str:
    return re.fullmatch(r"tensor<([0-9x]+xf32)>", tensor_type).group(1)


def _zeros_flag(tensor_type: str) -> str:
    return "--input=" + _shape_and_type(tensor_type)


def _weight_parameters(candidate: dict, work: Path, where: str) -> Path:
    """An archive holding the standalone convolution's weight (zeros) as parameter `w`."""
    from dsa.tools.profiler.runner import runtime_tool_path

    archive = work / f"{candidate['name']}.irpa"
    proc = subprocess.run([runtime_tool_path("iree-create-parameters"),
                           f"--data=w={_shape_and_type(candidate['weight'])}", f"--output={archive}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise DsaError(where, f"iree-create-parameters failed: {proc.stderr.strip()[-300:]}")
    return archive


def tune_winograd(candidate: dict, flags: Sequence[str], work: Path, *, driver: str, rounds: int, min_time: float,
                  keep_below: float, where: str, log, threads: int = 1) -> dict:
    """One weight shape's convolution, standalone, as IREE compiles it (`flags`) and by Winograd (a one-entry
    spec): timed in alternating rounds; returns its evidence row ("chosen" when Winograd won). The weight is a
    parameter (STANDALONE_CONV), so the Winograd module transforms the filter once at load or on every call as
    the model's module does under the same flags."""
    source = work / f"{candidate['name']}.mlir"
    source.write_text(STANDALONE_CONV.format(**candidate))
    spec = work / f"{candidate['name']}.spec.mlir"
    dispatch_spec.write_spec_file(spec, [], [], [dict(name=candidate["name"], rewrite="winograd",
                                                      weight=candidate["weight"])])
    archive = _weight_parameters(candidate, work, where)
    bench = Bench("", "", work, driver, where, threads,
                  inputs=[_zeros_flag(candidate["input"]), f"--parameters={BENCH_SCOPE}={archive}"])
    flags = ["--iree-input-type=none", *flags]
    default, winograd = work / f"{candidate['name']}.default.vmfb", work / f"{candidate['name']}.winograd.vmfb"
    run_iree_compile(source, flags, default, where)
    counts = dispatch_spec.compile_with_spec(source, flags, spec, winograd, where,
                                             lambda m, f, o: run_iree_compile(m, f, o, where))
    if counts != {candidate["name"]: 1}:
        raise DsaError(where, f"the standalone {candidate['name']} did not take its Winograd entry ({counts})",
                       "a bug of the tuner: the standalone convolution is not the one the entry matches")
    bench.modules.update(default=default, winograd=winograd)
    result = bench.rounds(["winograd"], rounds, min_time, seed=4)
    row = {"entry": candidate["name"], "weight": candidate["weight"], "input": candidate["input"],
           "convolutions": candidate["count"], "default_us": result["default"]["us"],
           "winograd_us": result["winograd"]["us"], "ratio": result["winograd"]["ratio"]}
    if row["ratio"] <= keep_below and row["winograd_us"] <= keep_below * row["default_us"]:
        row["chosen"] = "winograd"
    else:
        row["kept_default"] = f"Winograd's median time was not at most {keep_below} of IREE's"
    log(f"{candidate['name']} ({candidate['input']}, {candidate['count']} in the model): im2col "
        f"{row['default_us'] / 1e3:.2f} ms, Winograd {row['winograd_us'] / 1e3:.2f} ms ({row['ratio']:.2f}x)"
        + ("" if "chosen" in row else ": kept IREE's"))
    return row


# -- the whole model --------------------------------------------------------------------------------------------


def _input_flags(profile_dir: Path, profile: dict) -> List[str]:
    flags = []
    for i, (name, value) in enumerate(profile["inputs"].items()):
        path = profile_dir / f"input{i}_{name}.npy"
        if path.is_file():
            flags.append(f"--input=@{path}")
        elif isinstance(value, (int, float)):
            flags.append(f"--input={value}")
        else:
            raise DsaError(str(profile_dir), f"has no {path.name} (the profile's input '{name}')",
                           "profile again with --keep DIR")
    return flags


def model_check(vmfbs: Dict[str, Path], params: Path, inputs: List[str], driver: str, rounds: int,
                work: Path, where: str) -> dict:
    """Outputs of the untuned and tuned modules compared, and both timed in alternating rounds."""
    import numpy as np

    from dsa.stages.export import PARAMETER_SCOPE
    from dsa.tools.profiler.runner import runtime_tool_path

    common = [f"--device={driver}", f"--parameters={PARAMETER_SCOPE}={params}", "--function=main", *inputs]
    outputs = {}
    for name, vmfb in vmfbs.items():
        out = work / f"{name}_out.npy"
        proc = subprocess.run([runtime_tool_path("iree-run-module"), f"--module={vmfb}", *common,
                               f"--output=@{out}"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise DsaError(where, f"the {name} module does not run: {proc.stderr.strip()[-300:]}")
        outputs[name] = np.load(out)
    ref, got = outputs["untuned"].astype(np.float64), outputs["tuned"].astype(np.float64)
    diff = float(np.max(np.abs(got - ref) / np.maximum(1.0, np.abs(ref)))) if ref.size else 0.0
    times: Dict[str, List[float]] = {n: [] for n in vmfbs}
    for r in range(rounds):
        for name in (list(vmfbs) if r % 2 == 0 else list(reversed(list(vmfbs)))):
            proc = subprocess.run([runtime_tool_path("iree-benchmark-module"), f"--module={vmfbs[name]}", *common,
                                   "--benchmark_min_time=5x", "--benchmark_format=json"],
                                  capture_output=True, text=True)
            bench = json.loads(proc.stdout[proc.stdout.index("{"):])["benchmarks"][0]
            unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[bench.get("time_unit", "ns")]
            times[name].append(float(bench["real_time"]) * unit)
    return {"max_rel_diff": diff, "parity": diff <= PARITY_TOLERANCE,
            "untuned_ms": statistics.median(times["untuned"]), "tuned_ms": statistics.median(times["tuned"]),
            "ratio": statistics.median(t / u for t, u in zip(times["tuned"], times["untuned"]))}


# -- the command --------------------------------------------------------------------------------------------------


def _vector_registers(configured: str) -> int:
    size = re.search(r"native_vector_size = (\d+)", configured)
    return 32 if size and int(size.group(1)) >= 64 else 16


def entry_name(function: str) -> str:
    """conv_512x15x20x512x3x3_f32 from main$async_dispatch_35_conv_512x15x20x512x3x3_f32."""
    m = re.match(r".*?dispatch_\d+_(.+)$", function)
    name = re.sub(r"[^A-Za-z0-9_]", "_", m.group(1) if m else function)
    return name if re.match(r"[A-Za-z]", name) else f"d_{name}"


def tune(profile_dir: Path, out: Path, evidence: Path, *, params: Optional[Path], top: int, rounds: int,
         min_time: float, keep_below: float, keep: Optional[Path], threads: int = 1,
         tuning_file: Optional[Path] = None, log=print) -> dict:
    where = str(profile_dir)
    profile, params = _read_profile(profile_dir, params)
    flags = list(profile["flags"])
    driver = "local-task"
    with tempfile.TemporaryDirectory(prefix="dsa-tune-dispatches-") as tmp:
        work = keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        bench_dir = work / "benchmarks"
        untuned = work / "untuned.vmfb"
        sources = (profile_dir / "executable_sources.mlir").read_text()
        rewrites, rewrite_evidence = carried_rewrites(profile, sources, tuning_file, where)
        log(f"compiling {profile['model_id']} for {profile['target']} with its executables' benchmarks")
        run_iree_compile(profile_dir / "executable_sources.mlir",
                         flags + ["--compile-from=executable-sources",
                                  f"--iree-hal-dump-executable-benchmarks-to={bench_dir}"], untuned, where)
        rows, skipped, entries, seen = [], [], [], {}
        dispatches = sorted(profile["dispatches"], key=lambda d: -d["total_ms"])
        for d in dispatches[:top]:
            function = d["name"]
            m = re.match(r"(.*?(?:_dispatch|_encoding)_\d+)", function)
            executable = m.group(1) if m else function
            prefix = f"module_{executable}_"
            bench_files = sorted(f for f in bench_dir.glob(f"{prefix}*_benchmark.mlir")
                                 if not f.name[len(prefix):][:1].isdigit())
            if not bench_files:
                skipped.append({"dispatch": function, "why": "IREE wrote no standalone benchmark for it"})
                continue
            standalone = work / f"{executable}.mlir"
            standalone.write_text(standalone_benchmark(bench_files[0].read_text(), sources, executable))
            configured_path = work / f"{executable}.configured.mlir"
            run_iree_compile(standalone, [f"--compile-to={dispatch_spec.CONFIGURED_PHASE}"], configured_path, where)
            configured = configured_path.read_text()
            roots = dispatch_spec.configured_root_ops(configured)
            if len(roots) != 1 or search_space(roots[0]["op"], roots[0]["lowering_config"], 16) is None:
                skipped.append({"dispatch": function, "profile_ms": d["total_ms"],
                                "why": "its root op is not a data-tiled convolution or matmul, nor a "
                                       "reduction (the kinds this tuner tiles)" if len(roots) == 1 else f"{len(roots)} root ops"})
                continue
            captured = dispatch_spec.captured_values(roots[0]["op"])
            if captured:
                skipped.append({"dispatch": function, "profile_ms": d["total_ms"],
                                "why": f"its root op's body uses {', '.join(captured)}, defined outside it: a "
                                       "spec's matcher cannot match such an op"})
                continue
            key = re.sub(r"%[\w#:]+", "%", dispatch_spec.dag_pattern(roots[0]["op"]))  # without SSA names
            if key in seen:
                seen[key]["dispatches"].append(function)
                seen[key]["profile_ms"] += d["total_ms"]
                continue
            log(f"{function}: {d['total_ms']:.1f} ms per model call ({d['count']:g} calls)")
            work_d = work / executable
            work_d.mkdir(exist_ok=True)
            row = {"entry": entry_name(function), "dispatches": [function], "profile_ms": d["total_ms"]}
            row.update(tune_dispatch(configured, roots[0], work_d, driver=driver,
                                     vector_registers=_vector_registers(configured), rounds=rounds,
                                     min_time=min_time, keep_below=keep_below, where=f"{where}: {function}",
                                     log=log, threads=threads))
            seen[key] = row
            rows.append(row)
            if "chosen" in row:
                entries.append({"name": row["entry"], "op": roots[0]["op"], "lowering_config": row["chosen_config"]})
                if "chosen_ukernels" in row:
                    entries[-1].update(ukernels=row["chosen_ukernels"], target=variant_target(configured, where))
                if "chosen_siblings" in row:
                    entries[-1]["siblings"] = row["chosen_siblings"]
        result = dict(_evidence(profile, flags, rounds, keep_below, threads), min_workgroups=MIN_WORKGROUPS,
                      dispatches=rows, skipped=skipped)
        if rewrites:
            result["carried_rewrites"] = rewrite_evidence
        if not entries:
            result["model"] = None
            log("no dispatch got faster than IREE's configuration: no spec written; evidence in "
                f"{write_rejected(result, evidence, out, keep)}")
            return result
        bucket = profile.get("bucket")
        where_tuned = f"{bucket['dim']}={bucket['size']}" if bucket else "its only shape"
        header = [f"Dispatch spec of {profile['model_id']} ({where_tuned}) for {profile['target']}, "
                  f"written by `dsa tune-dispatches`; evidence in {evidence.name}.",
                  "Each entry matches a dispatch's root op as IREE configures it and sets the measured lowering_config"
                  " (and, where it says so, the ukernels its dispatch is lowered with)."]
        if rewrites:
            header.append("Its preprocess entries are carried from the spec the profile was taken with "
                          f"({', '.join(r['name'] for r in rewrites)}): their evidence is under carried_rewrites.")
        spec_tmp = work / out.name
        dispatch_spec.write_spec_file(spec_tmp, entries, header, rewrites)
        tuned = work / "tuned.vmfb"
        counts = dispatch_spec.compile_with_spec(
            profile_dir / "executable_sources.mlir", flags, spec_tmp, tuned, where,
            lambda m, f, o: run_iree_compile(m, f, o, where), start_flags=["--compile-from=executable-sources"],
            preprocessed=True)
        unmatched = [n for n, c in counts.items() if not c]
        if unmatched:
            raise DsaError(where, f"the spec's entries {', '.join(unmatched)} match no op of the whole model",
                           "a bug of the tuner: the standalone benchmark configured the op otherwise")
        check = model_check({"untuned": untuned, "tuned": tuned}, params, _input_flags(profile_dir, profile), driver,
                            max(2 * rounds, 10), work, where)
        return _keep_if_faster(result, check, counts, spec_tmp, out, evidence, tuning_file, where, log, keep)


def carried_rewrites(profile: dict, sources: str, tuning_file: Optional[Path], where: str
                     ) -> Tuple[List[dict], Optional[dict]]:
    """The preprocess entries the profile was compiled with and their evidence, read from the spec
    `tuning_file` pins: its executables (`sources`) exist only with them, so the new spec keeps them. None when
    the executables hold no op a rewrite makes. The tune entries of that spec are not carried: the search
    measures their dispatches afresh."""
    rewritten = [kind for kind, product in dispatch_spec.REWRITE_PRODUCTS.items() if product in sources]
    if not rewritten:
        return [], None
    if tuning_file is None:
        raise DsaError(where, f"was profiled with a dispatch spec's {', '.join(rewritten)} entries (its "
                              "executables hold the ops they make)",
                       "pass --tuning with the tuning file that pins that spec: its preprocess entries are kept in "
                       "the new spec (the profiled executables exist only with them)")
    pin = read_json(tuning_file).get("dispatch_spec")
    spec = tuning_file.parent / pin["file"] if pin else None
    rewrites = dispatch_spec.spec_rewrites(spec, str(spec)) if spec else []
    if not rewrites:
        raise DsaError(str(tuning_file), f"pins no dispatch spec with preprocess entries, but the profile's "
                                         f"executables were rewritten ({', '.join(rewritten)})",
                       "profile with the tuning file whose spec made them")
    used = sorted(n for n, c in (profile.get("dispatch_spec") or {}).items() if c)
    stale = [n for n in used if n not in dispatch_spec.spec_entries(spec, str(spec))]
    if stale:
        raise DsaError(where, f"was profiled with entries {', '.join(stale)} that {spec.name} does not have",
                       "profile again with this tuning file")
    old = spec.with_name(spec.name[:-len(".spec.mlir")] + ".spec.evidence.json")
    evidence = read_json(old) if old.is_file() else {}
    carried = evidence.get("carried_rewrites") or {}
    return rewrites, {"entries": [r["name"] for r in rewrites], "from": spec.name, "sha256": sha256_file(spec),
                      "rewrites": evidence["rewrites"] if "rewrites" in evidence else carried.get("rewrites"),
                      "model": evidence.get("model") if "rewrites" in evidence else carried.get("model")}


def _read_profile(profile_dir: Path, params: Optional[Path]) -> Tuple[dict, Path]:
    where = str(profile_dir)
    profile_path = profile_dir / "profile.json"
    for needed in (profile_path, profile_dir / "model.mlir", profile_dir / "executable_sources.mlir"):
        if not needed.is_file():
            raise DsaError(where, f"has no {needed.name}",
                           "profile first: dsa profile ... --keep DIR --json DIR/profile.json")
    params = params or profile_dir / "params.irpa"
    if not params.is_file():
        raise DsaError(str(params), "no parameter archive", "pass the model's built .irpa with --params")
    return read_json(profile_path), params


def _evidence(profile: dict, flags: Sequence[str], rounds: int, keep_below: float, threads: int) -> dict:
    """What every evidence file says of the model, the machine and the method."""
    return {"format": EVIDENCE_FORMAT, "model_id": profile["model_id"], "target": profile["target"],
            "bucket": profile.get("bucket"), "flags": list(flags), "cpu": host_cpu_model(),
            "iree_base_compiler": compiler_version(), "rounds": rounds, "keep_below": keep_below,
            "dispatch_threads": threads,
            "model_timing": "whole model: iree-benchmark-module, the runtime's default threads, 5 calls per "
                            "timing, untuned and tuned alternating, median of the per-round ratios"}


def rejected_evidence(evidence: Path, out: Path, keep: Optional[Path]) -> Path:
    """Where a search that writes no spec puts its evidence: the evidence file when no spec lies at `out`;
    else the work directory (`--keep`, or dsa-tune-dispatches/ in the system's temporary directory), so that
    the spec already there (pinned by its tuning file) keeps the evidence that describes it."""
    if not out.exists():
        return evidence
    where = keep or Path(tempfile.gettempdir()) / "dsa-tune-dispatches"
    where.mkdir(parents=True, exist_ok=True)
    return where / evidence.name


def write_rejected(result: dict, evidence: Path, out: Path, keep: Optional[Path]) -> str:
    """Writes a rejected search's evidence (rejected_evidence) and says where, for the message."""
    path = rejected_evidence(evidence, out, keep)
    write_json_atomic(path, result)
    return str(path) if path == evidence else f"{path} ({out.name} and {evidence.name} are unchanged)"


def _keep_if_faster(result: dict, check: dict, counts: Dict[str, int], spec_tmp: Path, out: Path, evidence: Path,
                    tuning_file: Optional[Path], where: str, log, keep: Optional[Path] = None) -> dict:
    """The whole-model gate: the spec is written (and pinned) only when the module with it computes what the
    one without does and is not slower; the evidence is written either way (write_rejected where no spec is)."""
    result["model"] = dict(check, matched=counts)
    if not check["parity"]:
        raise DsaError(where, f"the tuned module's outputs differ from the untuned one's by "
                              f"{check['max_rel_diff']:.2e} (more than {PARITY_TOLERANCE})",
                       f"no spec written; evidence in {write_rejected(result, evidence, out, keep)}")
    # Slower only when both say so: the median of the per-round ratios and the ratio of the medians (on a
    # 2-core VM a whole call varies ±10% run to run; either statistic alone flips on one noisy round).
    if check["ratio"] > 1.0 and check["tuned_ms"] > check["untuned_ms"]:
        raise DsaError(where, f"the whole model is not faster with the spec ({check['untuned_ms']:.1f} → "
                              f"{check['tuned_ms']:.1f} ms, median ratio {check['ratio']:.2f})",
                       "no spec written (a busy machine? measure again on a quiet one); evidence in "
                       f"{write_rejected(result, evidence, out, keep)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(spec_tmp.read_text())
    write_json_atomic(evidence, result)
    pin = {"file": out.name, "sha256": sha256_file(out)}
    if tuning_file is not None:  # the tuning file pins its spec (dsa.stages.compile.dispatch_spec_path)
        write_json_atomic(tuning_file, dict(read_json(tuning_file), dispatch_spec=pin))
        log(f"pinned it in {tuning_file}")
    else:
        log(f'pin it in the tuning file: "dispatch_spec": {json.dumps(pin)}')
    log(f"whole model: {check['untuned_ms']:.1f} → {check['tuned_ms']:.1f} ms ({check['ratio']:.2f}x), outputs "
        f"within {check['max_rel_diff']:.1e}; wrote {out} and {evidence}")
    return result


def tune_rewrites(profile_dir: Path, out: Path, evidence: Path, *, params: Optional[Path], rounds: int,
                  min_time: float, keep_below: float, keep: Optional[Path], threads: int = 1,
                  tuning_file: Optional[Path] = None, log=print) -> dict:
    """`--winograd`: for each weight shape of the model's 3×3 stride-1 convolutions, IREE's own lowering
    (im2col + data-tiled matmul on x86-64-v3) against Winograd F(6×6, 3×3), standalone; the winners become the
    spec's preprocess entries, then the same whole-model gate as the tile search."""
    where = str(profile_dir)
    profile, params = _read_profile(profile_dir, params)
    flags = list(profile["flags"])
    driver = "local-task"
    model = profile_dir / "model.mlir"
    with tempfile.TemporaryDirectory(prefix="dsa-tune-rewrites-") as tmp:
        work = keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        input_ir = work / "input.mlir"
        run_iree_compile(model, flags + [f"--compile-to={dispatch_spec.INPUT_PHASE}"], input_ir, where)
        candidates, skipped = winograd_candidates(input_ir.read_text())
        log(f"{profile['model_id']} for {profile['target']}: {len(candidates)} weight shape(s) of 3×3 stride-1 "
            "convolutions")
        rows = [tune_winograd(c, flags, work, driver=driver, rounds=rounds, min_time=min_time,
                              keep_below=keep_below, where=f"{where}: {c['name']}", log=log, threads=threads)
                for c in candidates]
        rewrites = [{"name": r["entry"], "rewrite": "winograd", "weight": r["weight"]} for r in rows if "chosen" in r]
        result = dict(_evidence(profile, flags, rounds, keep_below, threads), rewrites=rows, skipped=skipped)
        if not rewrites:
            result["model"] = None
            log("Winograd was faster for no weight shape: no spec written; evidence in "
                f"{write_rejected(result, evidence, out, keep)}")
            return result
        header = [f"Dispatch spec of {profile['model_id']} for {profile['target']}, written by "
                  f"`dsa tune-dispatches --winograd`; evidence in {evidence.name}.",
                  "Each entry rewrites the 3x3 stride-1 convolutions of its weight shape into a zero fill by "
                  "Winograd F(6x6, 3x3)."]
        spec_tmp = work / out.name
        dispatch_spec.write_spec_file(spec_tmp, [], header, rewrites)
        untuned, tuned = work / "untuned.vmfb", work / "tuned.vmfb"
        run_iree_compile(model, flags, untuned, where)
        counts = dispatch_spec.compile_with_spec(model, flags, spec_tmp, tuned, where,
                                                 lambda m, f, o: run_iree_compile(m, f, o, where))
        unmatched = [n for n, c in counts.items() if not c]
        if unmatched:
            raise DsaError(where, f"the spec's entries {', '.join(unmatched)} match no convolution of the whole "
                                  "model (their init is not a zero fill: split the bias off, rewrite split_conv_bias)",
                           "export the model with the default rewrites")
        check = model_check({"untuned": untuned, "tuned": tuned}, params, _input_flags(profile_dir, profile), driver,
                            max(2 * rounds, 10), work, where)
        return _keep_if_faster(result, check, counts, spec_tmp, out, evidence, tuning_file, where, log, keep)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa tune-dispatches", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile-dir", required=True,
                        help="a `dsa profile ... --keep DIR --json DIR/profile.json` directory")
    parser.add_argument("--params", help="the model's .irpa (default: DIR/params.irpa)")
    parser.add_argument("--out", required=True, help="the spec to write (toolchains/tuning/<family>.<target>.spec.mlir)")
    parser.add_argument("--evidence", help="default: the spec's name with .evidence.json")
    parser.add_argument("--top", type=int, default=12, help="how many of the profile's heaviest dispatches to try")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per timing of a standalone dispatch")
    parser.add_argument("--keep-below", type=float, default=0.9,
                        help="keep a candidate whose median time is at most this fraction of IREE's")
    parser.add_argument("--threads", type=int, default=1, help="threads a standalone dispatch is timed with")
    parser.add_argument("--tuning", help="the tuning file to pin the spec in (its dispatch_spec field)")
    parser.add_argument("--keep", help="keep the work directory here")
    parser.add_argument("--winograd", action="store_true",
                        help="instead of tile sizes: Winograd or IREE's lowering, per weight shape of the 3x3 "
                             "stride-1 convolutions (x86-64-v3, where IREE data-tiles no convolution)")
    a = parser.parse_args(argv)
    out = Path(a.out)
    if not out.name.endswith(".spec.mlir"):
        raise DsaError(a.out, "a dispatch spec is named <family>.<target>.spec.mlir")
    evidence = Path(a.evidence) if a.evidence else out.with_name(out.name[:-len(".spec.mlir")] + ".spec.evidence.json")
    common = dict(params=Path(a.params) if a.params else None, rounds=a.rounds, min_time=a.min_time,
                  keep_below=a.keep_below, keep=Path(a.keep) if a.keep else None, threads=a.threads,
                  tuning_file=Path(a.tuning) if a.tuning else None)
    if a.winograd:
        tune_rewrites(Path(a.profile_dir), out, evidence, **common)
    else:
        tune(Path(a.profile_dir), out, evidence, top=a.top, **common)


if __name__ == "__main__":
    run_cli(main, "dsa tune-dispatches")
