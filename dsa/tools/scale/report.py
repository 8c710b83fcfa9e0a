"""docs/real-size.{md,png} and bench/RESULTS.md's "Real sizes" section, rendered from docs/real-size.json."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError


BEGIN_MARKER = "<!-- real-size:begin -->"
END_MARKER = "<!-- real-size:end -->"
MISSING = "–"


# -- rendering (pure functions of the data) -------------------------------------------------------------------
def _fmt_bytes(n) -> str:
    from dsa.tools.import_matrix import fmt_bytes

    return fmt_bytes(n)


def _fmt_count(n) -> str:
    from dsa.tools.import_matrix import fmt_count

    return fmt_count(n)


def fmt_rss(kib: Optional[int]) -> str:
    if not kib:
        return MISSING
    mib = kib / 1024
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


def fmt_seconds(s: Optional[float]) -> str:
    if s is None:
        return MISSING
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def fmt_ms(ms: Optional[float]) -> str:
    if ms is None:
        return MISSING
    if ms >= 10_000:
        return f"{ms / 1000:.1f} s"
    if ms >= 1000:
        return f"{ms / 1000:.2f} s"
    return f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def stage_kinds(entry: dict) -> Dict[str, dict]:
    """The subject's stages by kind (stand-in, export, params, bucket export, compile <target>, ...): wall time
    summed, peak the largest, in order."""
    kinds: Dict[str, dict] = {}
    for stage in entry.get("stages", []):
        name = stage["stage"]
        if name.startswith("export "):
            kind = "bucket export"
        elif name.startswith("compile "):
            kind = "compile " + name.rsplit(" ", 1)[-1]
        else:
            kind = name
        k = kinds.setdefault(kind, {"wall_s": 0.0, "peak_rss_kib": 0, "count": 0})
        k["wall_s"] += stage["wall_s"]
        k["peak_rss_kib"] = max(k["peak_rss_kib"], stage["peak_rss_kib"])
        k["count"] += 1
    return kinds


def _cell(stage: Optional[dict]) -> str:
    if not stage:
        return MISSING
    return f"{fmt_seconds(stage['wall_s'])}, {fmt_rss(stage['peak_rss_kib'])}"


def _targets(entries: Sequence[dict]) -> List[str]:
    seen: Dict[str, None] = {}
    for e in entries:
        for t in e.get("targets", []):
            seen[t] = None
    return list(seen)


def _label(entry: dict) -> str:
    if entry.get("size") in (None, "real"):
        return f"`{entry['key']}`"
    return f"`{entry['key']}` ({entry['family']}, {entry['size']})"


def render_build_table(entries: Sequence[dict]) -> str:
    targets = _targets(entries)
    header = (["model", "params (graph / checkpoint)", "checkpoint", "irpa", "vmfb", "stand-in", "export", "params",
               "bucket export"] + [f"compile {t}" for t in targets] + ["dsa compile, all"])
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for e in entries:
        if "not_measured" in e:
            lines.append("| " + " | ".join([_label(e), f"not measured: {e['not_measured'][:300]}"]
                                           + [""] * (len(header) - 2)) + " |")
            continue
        kinds = stage_kinds(e)
        vmfb = ", ".join(_fmt_bytes(e["vmfb_bytes"][t]) for t in e.get("targets", []) if t in e.get("vmfb_bytes", {}))
        peak = max((st for st in e.get("stages", []) if st["stage"] != "stand-in"),
                   key=lambda st: st["peak_rss_kib"], default=None)
        total = (f"{fmt_seconds(e['import_s'])}, peak {fmt_rss(peak['peak_rss_kib'])} ({peak['stage']})"
                 if peak and e.get("import_s") is not None else MISSING)
        cells = [_label(e), f"{_fmt_count(e.get('parameter_count'))} / {_fmt_count(e.get('checkpoint_parameters'))}",
                 _fmt_bytes(e.get("checkpoint_bytes")) + (f" ({e['checkpoint_files']} shards)"
                                                          if (e.get("checkpoint_files") or 1) > 1 else ""),
                 _fmt_bytes(e.get("irpa_bytes")), vmfb or MISSING, _cell(kinds.get("stand-in")),
                 _cell(kinds.get("export")), _cell(kinds.get("params")), _cell(kinds.get("bucket export"))]
        cells += [_cell(kinds.get(f"compile {t}")) for t in targets]
        cells.append(total)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _runtime_rows(entry: dict) -> List[Tuple[str, dict]]:
    rows = [(f"IREE {t}", entry.get("runtime", {}).get(t) or {"not_run": "not measured"})
            for t in entry.get("targets", [])]
    eager = entry.get("eager") or {"not_run": "not measured"}
    rows.append(("eager LeRobot" if entry.get("framework") == "lerobot" else "eager PyTorch", eager))
    return rows


def render_runtime_table(entries: Sequence[dict]) -> str:
    header = ["model", "runtime", "latency (median)", "first call", "load", "peak RSS (VmHWM)", "vs eager",
              "max deviation from eager", "inputs"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for e in entries:
        if "not_measured" in e:
            continue
        eager_ms = (e.get("eager") or {}).get("median_ms")
        for name, r in _runtime_rows(e):
            if "median_ms" not in r:
                why = r.get("not_run") or ("failed: " + r.get("error", "")[:120])
                lines.append(f"| {_label(e)} | {name} | {why} | | | | | | |")
                continue
            ratio = f"{r['median_ms'] / eager_ms:.2f}×" if eager_ms and not name.startswith("eager") else MISSING
            deviation = f"{r['error_vs_eager']:.1e}" if r.get("error_vs_eager") is not None else MISSING
            lines.append(f"| {_label(e)} | {name} | {fmt_ms(r['median_ms'])} (of {r['runs']}) | "
                         f"{fmt_ms(r['first_call_ms'])} | {fmt_seconds(r['load_s'])} | {fmt_rss(r['vmhwm_kib'])} | "
                         f"{ratio} | {deviation} | {r.get('inputs', '')} |")
    return "\n".join(lines) + "\n"


SWEEP_STAGES = ["stand-in", "export", "params", "bucket export", "compile", "runtime", "eager"]


def sweep_series(data: dict, name: str) -> dict:
    """The sweep's points as {"points": [(size, parameter count, entry)], "series": {line: [peak KiB or None]},
    "old": {line: [...]}} for the table and the plot. compile and runtime: the largest over targets."""
    by_key = {e["key"]: e for e in data.get("subjects", [])}
    sweep = data["sweeps"][name]
    points = [(p["size"], by_key[p["key"]]) for p in sweep["points"]
              if p["key"] in by_key and "not_measured" not in by_key[p["key"]]]
    series: Dict[str, List[Optional[int]]] = {k: [] for k in SWEEP_STAGES}
    old: Dict[str, List[Optional[int]]] = {"stand-in": [], "export": []}
    for _, e in points:
        kinds = stage_kinds(e)
        for k in SWEEP_STAGES:
            if k == "compile":
                values = [v["peak_rss_kib"] for kk, v in kinds.items() if kk.startswith("compile ")]
            elif k == "runtime":
                values = [r["vmhwm_kib"] for r in (e.get("runtime") or {}).values() if "vmhwm_kib" in r]
            elif k == "eager":
                values = [(e.get("eager") or {}).get("vmhwm_kib")] if (e.get("eager") or {}).get("vmhwm_kib") else []
            else:
                values = [kinds[k]["peak_rss_kib"]] if k in kinds else []
            series[k].append(max(values) if values else None)
        for k in old:
            value = ((e.get("old_design") or {}).get(k) or {}).get("peak_rss_kib")
            old[k].append(value)
    return {"points": [(size, e.get("parameter_count"), e) for size, e in points], "series": series, "old": old}


def render_sweep_table(data: dict, name: str) -> str:
    s = sweep_series(data, name)
    header = ["size", "params (graph)", "stand-in", "stand-in, old design", "export", "export, old design", "params",
              "bucket export", "compile", "runtime", "eager"]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for i, (size, count, e) in enumerate(s["points"]):
        def old(k):
            o = ((e.get("old_design") or {}).get(k)) or {}
            if "error" in o:
                return "failed"
            if not o:
                return "not run" + (" (OOM-killed before weightless building)" if size == "real" and k == "export"
                                    else "")
            return fmt_rss(o["peak_rss_kib"])
        cells = [f"{size} (`{e['key']}`)", _fmt_count(count), fmt_rss(s["series"]["stand-in"][i]), old("stand-in"),
                 fmt_rss(s["series"]["export"][i]), old("export"), fmt_rss(s["series"]["params"][i]),
                 fmt_rss(s["series"]["bucket export"][i]), fmt_rss(s["series"]["compile"][i]),
                 fmt_rss(s["series"]["runtime"][i]), fmt_rss(s["series"]["eager"][i])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_plot(data: dict, name: str, path: Path) -> bool:
    """Peak RSS per stage against the parameter count, one line per stage (old design dashed). False when the
    sweep has fewer than two measured points."""
    s = sweep_series(data, name)
    if len(s["points"]) < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsa.core.fileio import write_bytes_atomic

    xs = [count for _, count, _ in s["points"]]
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    markers = "osD^v<>p"
    for i, (stage, values) in enumerate(s["series"].items()):
        pts = [(x, v / 2 ** 20) for x, v in zip(xs, values) if v]
        if pts:
            ax.plot(*zip(*pts), marker=markers[i % len(markers)], label=stage)
    for stage, values in s["old"].items():
        pts = [(x, v / 2 ** 20) for x, v in zip(xs, values) if v]
        if pts:
            ax.plot(*zip(*pts), linestyle="--", marker="x", label=f"{stage}, old design")
    memory = memory_of(data) / 2 ** 30 or 23.5
    ax.axhline(memory, color="grey", linewidth=0.8, linestyle=":")
    ax.text(xs[0], memory * 0.98, f"machine memory ({memory:.1f} GiB)", fontsize=8, color="grey", va="top")
    sizes = [size for size, _, _ in s["points"]]
    if "real" in sizes and "real" not in data["sweeps"][name].get("old_design", []):
        ax.annotate("old-design export:\nOOM-killed", (xs[sizes.index("real")], memory), fontsize=8, color="grey",
                    ha="right", va="top", xytext=(-6, -4), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{size}\n{_fmt_count(count)}" for size, count, _ in s["points"]], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel(f"parameters the graph reads ({name.upper()}, LeRobot)")
    ax.set_ylabel("peak RSS (GiB)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    first = s["points"][-1][2].get("machine", {})
    ax.set_title(f"{name.upper()}: peak memory per stage — {first.get('cpu', '')}, {first.get('cores', '')} cores",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plot.png"
        fig.savefig(out, metadata={"Software": None})  # no version or date in the PNG
        write_bytes_atomic(path, out.read_bytes())
    plt.close(fig)
    return True


def memory_of(data: dict) -> int:
    for e in data.get("subjects", []):
        gib = (e.get("machine") or {}).get("memory_gib")
        if gib:
            return int(gib * 2 ** 30)
    return 0


def _notes(entries: Sequence[dict]) -> List[str]:
    return [f"* `{e['key']}`: {note}" for e in entries for note in e.get("notes", [])]


def real_and_points(data: dict) -> Tuple[List[dict], List[dict]]:
    """(real-size subjects, sweep-only points): a sweep's real point is a subject of its own."""
    entries = data.get("subjects", [])
    return [e for e in entries if e.get("size") in (None, "real")], [e for e in entries if e.get("size") not in (None, "real")]


def render_document(data: dict, plot: Optional[str] = None) -> str:
    real, points = real_and_points(data)
    dates = sorted({e["date"] for e in data.get("subjects", [])})
    machines = sorted({f"{e['machine']['cpu']}, {e['machine']['cores']} cores, {e['machine']['memory_gib']} GiB, "
                       f"AVX-512 {'yes' if e['machine'].get('avx512') else 'no'}" for e in data.get("subjects", [])})
    commands = list(dict.fromkeys(e["command"] for e in data.get("subjects", [])))
    lines = [
        "# Real sizes: time and memory per stage, runtime and eager",
        "",
        "<!-- Generated by dsa/tools/scale/ (`bazel run //tools:scale`) from docs/real-size.json: do not edit "
        "by hand. -->",
        "",
        "Every real-size model through the pipeline as a user without Bazel builds it (`dsa compile --no-cache` "
        "from its manifest and a seeded stand-in checkpoint), each stage a process of its own, then the compiled "
        "modules and the framework's own eager model at batch 1. Numbers from one shared machine: rough figures, "
        "not a benchmark.",
        "",
        "## Build: wall time and peak RSS per stage",
        "",
        render_build_table(real),
        "* **params**: what the compiled graph reads (the export record's parameter count) / the values in the "
        "checkpoint (a LeRobot PI0 checkpoint also holds the action expert's unused LM head).",
        "* **stand-in**: the seeded checkpoint made by the rules' own generator (`weights` in the JSON: generator, "
        "dtype, shards); **export**, **params**, **bucket export**, **compile**: the stages of `dsa compile` "
        "(`timings.json`: each stage's process's wall time and peak RSS, wait4's `ru_maxrss`; a bucket export or a "
        "compile per bucket summed, the peak the largest); **dsa compile, all**: its whole run, with the largest "
        "stage peak.",
        "* kB/MB/GB are powers of 1000; MiB/GiB of 1024.",
        "",
        "## Runtime at batch 1",
        "",
        render_runtime_table(real),
        "* **IREE &lt;target&gt;**: the module index in a process of its own (`dsa.runtime.policy.CompiledPolicy`, "
        "no torch); **eager**: LeRobot's own policy class (`load_pretrained_mapped`: one copy of the weights, "
        "widened to float32) or the PyTorch model (`eager_policy`), in the subject's environment, in another "
        "process. Each: the load, the first call (module load, first touch of the weights), then the median of "
        "further calls; **peak RSS** is the process's own VmHWM (`/proc/self/status` at its end), not its "
        "parent's rusage. Both sides use every core (torch threads and IREE's task workers = cores).",
        "* **max deviation from eager**: max |IREE − eager| / max(1, max |eager|) on the same inputs.",
        "",
    ]
    for name in data.get("sweeps", {}):
        sweep = data["sweeps"][name]
        lines += [
            f"## {name.upper()} at three sizes: peak RSS per stage against the parameter count",
            "",
            render_sweep_table(data, name),
            f"Each size is built with {sweep['recipe']}'s recipe (precision, buckets, targets, tuning, the "
            "seeded bf16 stand-in); only the policy config and the inputs it implies differ:",
            "",
        ]
        by_key = {e["key"]: e for e in data.get("subjects", [])}
        for p in sweep["points"]:
            described = by_key[p["key"]]["description"] if p["key"] in by_key else "not measured"
            lines.append(f"* {p['size']} (`{p['key']}`): {described}")
        lines += [
            "",
            "**old design**: the same size built as before weightless building — the stand-in by LeRobot's "
            "own random initialisation and `save_pretrained` (float32, the whole model in memory), the export "
            "with the model's weights materialised (`export_model(..., weightless=False)`); measured at "
            f"{' and '.join(sweep['old_design'])} size only (at real size that export was OOM-killed on this "
            "24 GiB machine). compile and runtime: the largest over the targets.",
            "",
        ]
        if plot:
            lines += [f"![peak RSS per stage against parameter count]({plot})", ""]
        if points:
            lines += ["Build and runtime of the smaller sizes:", "", render_build_table(points),
                      render_runtime_table(points)]
    notes = _notes(data.get("subjects", []))
    if notes:
        lines += ["## Notes", "", *notes, ""]
    toolchain_versions = data.get("toolchain", {})
    lerobot_env = toolchain_versions.get("lerobot environment", {})
    lines += [
        "## How it was made",
        "",
        "```sh",
        *commands,
        "```",
        "",
        f"* dates: {', '.join(dates) or MISSING}",
        f"* machine: {'; '.join(machines) or MISSING}",
        f"* toolchain: iree-base-compiler {toolchain_versions.get('iree-base-compiler', MISSING)}, iree-base-runtime "
        f"{toolchain_versions.get('iree-base-runtime', MISSING)}, iree-turbine {toolchain_versions.get('iree-turbine', MISSING)}, "
        f"torch {toolchain_versions.get('torch', MISSING)}"
        + (f"; LeRobot environment: lerobot {lerobot_env.get('lerobot')}, torch {lerobot_env.get('torch')}, "
           f"transformers {lerobot_env.get('transformers')}" if lerobot_env else ""),
        "* every measured step held the machine's heavy-work lock (`--lock`), so no other heavy job ran beside it;"
        " the per-subject commands are in docs/real-size.json (`compile_command`, `weights.command`).",
        "",
    ]
    return "\n".join(lines)


def render_results_section(data: dict) -> str:
    """bench/RESULTS.md's "Real sizes" section (between the markers)."""
    real, _ = real_and_points(data)
    dates = sorted({e["date"][:10] for e in real})
    return "\n".join([
        "## Real sizes",
        "",
        f"Real-size models built by `dsa compile --no-cache` from a seeded stand-in, each stage a process of its "
        f"own, then run at batch 1 against eager — rendered by `dsa scale` (dsa/tools/scale/) from "
        f"docs/real-size.json ({', '.join(dates) or MISSING}); method, the PI0 size sweep and its plot: "
        "[docs/real-size.md](../docs/real-size.md).",
        "",
        render_build_table(real),
        render_runtime_table(real),
    ])


def replace_marked(text: str, section: str) -> str:
    """`text` with the real-size markers' content replaced by `section`; with no markers, the marked section
    is put before "## Quantised matmuls" (else at the end)."""
    block = f"{BEGIN_MARKER}\n{section.rstrip()}\n{END_MARKER}"
    begin, end = text.find(BEGIN_MARKER), text.find(END_MARKER)
    if begin >= 0 and end > begin:
        return text[:begin] + block + text[end + len(END_MARKER):]
    if begin >= 0 or end >= 0:
        raise DsaError("bench/RESULTS.md", "has only one of the real-size markers",
                       f"put both {BEGIN_MARKER} and {END_MARKER} on lines of their own, or neither")
    anchor = re.search(r"^## Quantised matmuls", text, re.M)
    if anchor:
        return text[:anchor.start()] + block + "\n\n" + text[anchor.start():]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def write_outputs(data: dict, out_dir: Path, results: Optional[Path]) -> List[Path]:
    from dsa.core.fileio import write_bytes_atomic, write_json_atomic

    written = [out_dir / "real-size.json"]
    write_json_atomic(out_dir / "real-size.json", data)
    plot = None
    for name in data.get("sweeps", {}):
        if render_plot(data, name, out_dir / "real-size-rss.png"):
            plot = "real-size-rss.png"
            written.append(out_dir / plot)
    write_bytes_atomic(out_dir / "real-size.md", render_document(data, plot).encode("utf-8"))
    written.append(out_dir / "real-size.md")
    if results is not None:
        text = results.read_text(encoding="utf-8") if results.is_file() else ""
        write_bytes_atomic(results, replace_marked(text, render_results_section(data)).encode("utf-8"))
        written.append(results)
    return written
