"""Host-side runner: loads compiled modules + the parameter archive with iree.runtime and runs a policy.

A model's compiled form is described by a module index (JSON, written by `dsa_vmfb`):

    {"format": 1, "target": ..., "target_spec": "...json" (names the runtime driver),
     "parameter_archive": "pi0_model/params.irpa", "parameter_scope": "model", "runtime_view": ...,
     "modules": [{"vmfb": ..., "record": ...}, ...]}       # paths relative to the index

An index may name `levels`: the same export compiled for further targets of the same machines (x86-64-v4
beside x86-64-v3), their indices beside it. `CompiledPolicy(index)` then runs the most capable of them this
machine executes (`choose_level`: the target needing the most CPU features, among those whose CPU features and
runtime driver the machine has) and says which in `choice`; `target=` runs a given one. Nothing of the build
depends on the machine that runs it: the choice is made here, at load time.

With shape buckets there is one module per bucket; `run` picks the smallest bucket that holds the input,
pads the bucketed axes with each input's recorded pad value, and refuses an input longer than the largest
bucket. Before loading, every archive entry is checked against the export record (name, shape, dtype): the
IREE runtime would accept a tensor of the wrong shape silently.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from dsa.core.errors import DsaError
from dsa.core.fileio import read_json, sha256_bytes
from dsa.runtime import iree_flags
from dsa.runtime.host import capability, check_host, host_arch, host_cpu_features, missing_driver, missing_for

from dsa.core.formats import INDEX_FORMAT, PARAMETER_METADATA_PREFIX, ExportRecord, ModuleIndex  # noqa: F401 (re-exported)


def read_archive_metadata(irpa: Path) -> dict:
    """name → {"dtype", "shape", "nbytes"} for every entry of a parameter archive."""
    import iree.runtime as rt

    index = rt.ParameterIndex()
    index.load(str(irpa))
    entries = {}
    for key, entry in index.items():
        meta = entry.metadata.decode("utf-8") if entry.metadata else ""
        info = json.loads(meta[len(PARAMETER_METADATA_PREFIX):]) if meta.startswith(PARAMETER_METADATA_PREFIX) else {}
        nbytes = len(memoryview(entry.file_view)) if entry.is_file else None
        entries[key] = {"dtype": info.get("dtype"), "shape": info.get("shape"), "nbytes": nbytes}
    return entries


class Module:
    """One compiled entry point and its export record."""

    def __init__(self, record: dict, vmfb: Path):
        self.record = record
        self.vmfb = vmfb
        self.bucket = record.get("bucket")  # {"dim", "size", "slot"} or None for a fully dynamic module
        self._invoker = None

    def holds(self, sizes: Dict[str, int]) -> bool:
        if self.bucket is None:
            return True
        return sizes.get(self.bucket["dim"], 0) <= self.bucket["size"]


def read_module_index(path: Path) -> dict:
    """A module index as JSON, refused unless its format is the one this release reads (ModuleIndex)."""
    return ModuleIndex.read(Path(path)).to_json()


@dataclasses.dataclass(frozen=True)
class LevelChoice:
    """Which of a module index's builds runs: the index file, its target, and why (None: the index has no
    levels, or the caller named the target)."""

    index: Path
    target: str
    why: Optional[str] = None


def builds_of(index_path: Path) -> Dict[str, Path]:
    """target → module index of every build a module index stands for: its own target's, then its levels'."""
    index_path = Path(index_path)
    index = ModuleIndex.read(index_path)
    return {index.target: index_path, **{t: index_path.parent / name for t, name in index.levels}}


def choose_level(index_path: Path, target: Optional[str] = None, *, arch: Optional[str] = None,
                 features: Optional[Sequence[str]] = None) -> LevelChoice:
    """The build of `index_path` to run: `target`'s when given (the index's own or one of its levels; refused
    naming the ones it has otherwise); else, for an index with levels, the most capable one a CPU of `arch`
    with `features` (default: this machine's) executes — the target needing the most CPU features among those
    it runs, with its runtime driver present. A level whose index is missing or is not the same export (another
    parameter archive) is refused, naming the file: running the base instead would hide a broken build."""
    index_path = Path(index_path)
    index = ModuleIndex.read(index_path)
    builds = builds_of(index_path)
    if target is not None:
        if target not in builds:
            raise DsaError(str(index_path), f"has no build for target '{target}' (it has {', '.join(builds)})",
                           "pass one of its targets, or build the policy for that target")
        return LevelChoice(builds[target], target)
    if not index.levels:
        return LevelChoice(index_path, index.target)
    arch = arch or host_arch()
    if features is None:
        features = host_cpu_features()
    runnable, why_not = [], {}
    for name, path in builds.items():
        if not path.is_file():
            raise DsaError(str(path), f"is the {name} build that {index_path.name} lists under `levels`, and it is "
                           "missing", "rebuild the policy (its default build holds every level), or pass "
                           f"target='{index.target}' (dsa run --target) to run this index's own modules")
        level = ModuleIndex.read(path) if path != index_path else index
        if level.target != name or level.parameter_archive != index.parameter_archive:
            raise DsaError(str(path), f"is not a {name} build of {index_path.name}'s export (target "
                           f"{level.target}, parameters {level.parameter_archive})", "rebuild the policy")
        spec = read_json(path.parent / level.target_spec)
        reason = missing_for(spec, arch, features) or missing_driver(spec)
        if reason:
            why_not[name] = reason
        else:
            runnable.append((capability(spec), name, path))
    if not runnable:
        raise DsaError(str(index_path), "has no build this machine can run: " +
                       "; ".join(f"{t}: {why}" for t, why in why_not.items()),
                       "run it on a machine one of its targets names, or build it for this machine's target")
    _, name, path = max(runnable)
    skipped = "".join(f"; {t}: {why}" for t, why in why_not.items())
    return LevelChoice(path, name, f"the most capable of its builds ({', '.join(builds)}) this machine runs{skipped}")


class CompiledPolicy:
    """A model's compiled modules and parameters, run from host arrays. Every input is checked against the
    export record before the module is called (`check_input`): the compiled code trusts its arguments, so a
    token id past the embedding table reads out of bounds or crashes the process. NaN and ±Inf in a float
    input are refused unless `allow_nonfinite`."""

    def __init__(self, index_path: Path, driver: Optional[str] = None, *, allow_nonfinite: bool = False,
                 target: Optional[str] = None):
        # An index with levels: the build this machine runs best, or `target`'s (choose_level).
        self.choice = choose_level(Path(index_path), target)
        index_path = self.choice.index
        self.allow_nonfinite = allow_nonfinite
        index = read_module_index(index_path)
        base = index_path.parent
        self.index = index
        self.target_spec = read_json(base / index["target_spec"])
        # Before the first device (checking the host creates the driver): the runtime flags the modules need.
        iree_flags.require(index.get("runtime_flags", []), str(index_path))
        # Before any module is loaded: code for a CPU this machine lacks would die of SIGILL, not fail.
        check_host(self.target_spec, str(index_path))
        self.driver = driver or self.target_spec["runtime_driver"]
        self.modules = [Module(ExportRecord.read(base / m["record"]), base / m["vmfb"]) for m in index["modules"]]
        self.model_id = self.modules[0].record["model_id"]
        # Smallest bucket first, so the first module that holds an input is the tightest fit.
        self.modules.sort(key=lambda m: (m.bucket is None, m.bucket["size"] if m.bucket else 0))
        self.parameter_archive = base / index["parameter_archive"]
        self.runtime_view = read_json(base / index["runtime_view"])
        self._check_parameters()
        self._load()

    # -- loading ---------------------------------------------------------------------------------
    def _check_parameters(self) -> None:

        entries = read_archive_metadata(self.parameter_archive)
        for module in self.modules:
            for p in module.record["parameters"]:
                got = entries.get(p["name"])
                if got is None:
                    raise DsaError(str(self.parameter_archive), f"has no parameter '{p['name']}'",
                                   "rebuild the parameter archive for this model")
                if got["shape"] != p["shape"] or got["dtype"] != p["dtype"]:
                    raise DsaError(
                        f"{self.parameter_archive}: parameter '{p['name']}'",
                        f"is {got['shape']} {got['dtype']}, the module expects {p['shape']} {p['dtype']}",
                        "rebuild the parameter archive from a checkpoint of this architecture",
                    )

    def _load(self) -> None:
        import iree.runtime as rt

        self._rt = rt
        self._instance = rt.VmInstance()
        self._device = rt.get_device(self.driver)
        params = rt.ParameterIndex()
        params.load(str(self.parameter_archive))
        scope = self.index["parameter_scope"]
        self._param_module = rt.create_io_parameters_module(self._instance, params.create_provider(scope=scope))
        self._hal_module = rt.create_hal_module(self._instance, self._device)

    def _invoker(self, module: Module):
        if module._invoker is None:
            rt = self._rt
            # Copied, not mmapped: VmModule.mmap maps the file writable, which fails on read-only
            # locations such as Bazel's runfiles.
            data = module.vmfb.read_bytes()
            check_vmfb(module.vmfb, data)
            try:
                vm_module = rt.VmModule.copy_buffer(self._instance, data)
                context = rt.VmContext(self._instance, modules=[self._hal_module, self._param_module, vm_module])
                function = vm_module.lookup_function(module.record["function"])
            except (RuntimeError, ValueError, TypeError) as e:
                raise DsaError(str(module.vmfb), f"is not a loadable IREE module for this runtime: "
                               f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__}",
                               "rebuild it, or copy the release again") from None
            if function is None:
                raise DsaError(str(module.vmfb), f"has no function '{module.record['function']}'",
                               "the module and its export record are from different builds: rebuild")
            module._invoker = rt.FunctionInvoker(context, self._device, function)
        return module._invoker

    # -- running ---------------------------------------------------------------------------------
    @property
    def input_specs(self) -> List[dict]:
        return self.modules[-1].record["inputs"]

    def buckets(self) -> Dict[str, List[int]]:
        table: Dict[str, List[int]] = {}
        for m in self.modules:
            if m.bucket:
                table.setdefault(m.bucket["dim"], []).append(m.bucket["size"])
        return table

    def select(self, inputs: Dict[str, np.ndarray]) -> Tuple[Module, Dict[str, int]]:
        """The smallest module whose bucket holds the inputs' bucketed dims."""
        sizes: Dict[str, int] = {}
        first: Dict[str, str] = {}
        for spec in self.input_specs:
            if spec["name"] not in inputs:
                continue  # prepare() names what is missing
            shape = np.shape(inputs[spec["name"]])
            if len(shape) != len(spec["shape"]):
                continue  # prepare() refuses the rank
            for axis, dim in spec.get("dims", {}).items():
                size = int(shape[int(axis)])
                if dim in sizes and sizes[dim] != size:
                    # Inputs that share a dim (a prompt's tokens and mask) have one size: the shorter one
                    # would be padded with tokens the mask says are real, or the reverse.
                    raise DsaError(f"{self.model_id}: input '{spec['name']}'",
                                   f"has {dim} {size}, but input '{first[dim]}' has {sizes[dim]}: the inputs "
                                   f"sharing {dim} must agree", "pass them at one length")
                sizes[dim] = size
                first.setdefault(dim, spec["name"])
        for module in self.modules:
            if module.holds(sizes):
                return module, sizes
        dim = self.modules[-1].bucket["dim"]
        largest = self.modules[-1].bucket["size"]
        raise DsaError(
            f"{self.model_id}: input",
            f"{dim} is {sizes[dim]}, longer than the largest bucket ({largest}; buckets: "
            f"{self.buckets()[dim]})",
            f"shorten the input to at most {largest}, or add a larger bucket to the manifest's buckets.{dim}",
        )

    def prepare(self, module: Module, inputs: Dict[str, np.ndarray]) -> List[np.ndarray]:
        """Inputs in the entry point's order, padded to the module's bucket and cast to recorded dtypes."""
        args = []
        for spec in module.record["inputs"]:
            if spec["name"] not in inputs:
                raise DsaError(f"{self.model_id}: input", f"missing input '{spec['name']}'",
                               f"provide: {', '.join(s['name'] for s in module.record['inputs'])}")
            value = check_input(self.model_id, spec, inputs[spec["name"]], allow_nonfinite=self.allow_nonfinite)
            target = spec["shape"]
            if value.ndim != len(target):
                raise DsaError(f"{self.model_id}: input '{spec['name']}'",
                               f"has rank {value.ndim}, expected shape {target}")
            pad = []
            for axis, (have, want) in enumerate(zip(value.shape, target)):
                if isinstance(want, str):  # dynamic in this module
                    pad.append((0, 0))
                elif str(axis) in spec.get("dims", {}) and have <= want:
                    pad.append((0, want - have))
                elif have != want:
                    raise DsaError(f"{self.model_id}: input '{spec['name']}'",
                                   f"has shape {list(value.shape)}, expected {target}")
                else:
                    pad.append((0, 0))
            if any(p[1] for p in pad):
                value = np.pad(value, pad, constant_values=spec.get("pad_value", 0))
            args.append(value if value.flags.c_contiguous else value.copy(order="C"))
        return args

    def run(self, inputs: Dict[str, np.ndarray]) -> Tuple[List[np.ndarray], Module]:
        module, sizes = self.select(inputs)
        args = self.prepare(module, inputs)
        result = self._invoker(module)(*args)
        # Copied: the host view of a result buffer can be reused by the runtime once the call's buffers are
        # released, and callers keep results across calls (the deployment API's action queue does).
        results = [np.array(r.to_host(), copy=True)
                   for r in (result if isinstance(result, (list, tuple)) else [result])]
        # Outputs along a padded bucket dim (a batch bucket) are cut back to the inputs' size.
        for i, spec in enumerate(module.record["outputs"]):
            for axis, dim in spec.get("dims", {}).items():
                if dim in sizes and results[i].shape[int(axis)] > sizes[dim]:
                    results[i] = results[i].take(range(sizes[dim]), axis=int(axis))
        return results, module

    def timed_run(self, inputs: Dict[str, np.ndarray], repeats: int = 10):
        """Runs once to warm up, then `repeats` times; returns (outputs, module, latencies in ms)."""
        outputs, module = self.run(inputs)
        latencies = []
        for _ in range(repeats):
            start = time.perf_counter()
            outputs, module = self.run(inputs)
            latencies.append((time.perf_counter() - start) * 1e3)
        return outputs, module, latencies


def check_vmfb(vmfb: Path, data: bytes) -> None:
    """A vmfb is the one its compile report (X.compile_report.json beside X.vmfb, written by the same build)
    names by sha256: another bucket's module, another build's, or garbage is refused before IREE loads it
    (native code; a module of another bucket would be called with arguments of the wrong shapes)."""
    report = vmfb.with_name(vmfb.name[: -len(".vmfb")] + ".compile_report.json") if vmfb.name.endswith(".vmfb") \
        else None
    if report is None or not report.is_file():
        return
    from dsa.core.formats import CompileReport

    want = CompileReport.read(report).get("vmfb_sha256")
    got = sha256_bytes(data)
    if want is not None and got != want:
        raise DsaError(str(vmfb), f"has sha256 {got}: it is not the vmfb its compile report names ({want})",
                       "the module was replaced or damaged: rebuild it, or copy the release again")


def check_input(model_id: str, spec: dict, given, *, allow_nonfinite: bool = False) -> np.ndarray:
    """One input as the array the module takes (its recorded dtype), or a DsaError naming the input: a value
    that is not numbers (strings, objects), a fractional or out-of-range value for an integer input (outside
    `value_domain` — token ids in [0, vocab), a mask in [0, 1] — or a scalar's `value_range`, the step count),
    NaN/±Inf in a float input unless `allow_nonfinite`. Shapes are checked by the caller (buckets pad them)."""
    where = f"{model_id}: input '{spec['name']}'"
    want = np.dtype(spec["dtype"])
    try:
        array = np.asarray(given)
    except (ValueError, TypeError) as e:
        raise DsaError(where, f"is not an array of numbers ({e})", f"pass a {spec['dtype']} array") from None
    if array.dtype.kind not in "biuf":
        raise DsaError(where, f"holds {array.dtype} values, not numbers", f"pass a {spec['dtype']} array")
    if want.kind in "iub":
        if array.dtype.kind == "f":
            if not np.all(np.isfinite(array)) or np.any(array != np.round(array)):
                raise DsaError(where, "holds non-integer values", f"pass integer {spec['dtype']} values")
            if array.size and (array.min() < np.iinfo(np.int64).min or array.max() > np.iinfo(np.int64).max):
                raise DsaError(where, "holds values outside the int64 range", f"pass {spec['dtype']} values")
        bounds = spec.get("value_domain") or spec.get("value_range")
        if bounds is not None and array.size:
            lo, hi = int(bounds[0]), int(bounds[1])
            low, high = array.min(), array.max()
            if low < lo or high > hi:
                bad = low if low < lo else high
                what = "vocabulary" if "value_domain" in spec and hi > 1 else "range"
                size = f" (size {hi + 1})" if what == "vocabulary" and lo == 0 else ""
                raise DsaError(where, f"holds {int(bad)}, outside the supported {what} [{lo}, {hi}]{size}",
                               f"pass values in [{lo}, {hi}]")
        return np.asarray(array, dtype=want)
    value = np.asarray(array, dtype=want)
    if not allow_nonfinite and value.size and not np.all(np.isfinite(value)):
        count = int(value.size - np.count_nonzero(np.isfinite(value)))
        raise DsaError(where, f"holds {count} NaN or infinite value{'s' if count != 1 else ''}",
                       "check the sensor and preprocessing that produced it (or opt in: allow_nonfinite / "
                       "--allow-nonfinite)")
    return value


def sample_inputs(record: dict, sizes: Dict[str, int], rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """A deterministic sample observation for an export record: named dims at `sizes`, else bucketed dims at the
    record's own size and dynamic dims (batch) at their smallest size; floats standard-normal, integers within
    their recorded sample range."""
    dynamic = record.get("dynamic_dims") or {}
    values = {}
    for spec in record["inputs"]:
        shape = []
        for axis, dim in enumerate(spec["shape"]):
            named = spec.get("dims", {}).get(str(axis))
            size = sizes.get(named, dim) if named else dim
            if not isinstance(size, int):  # a dynamic dim the record names, not a size
                size = max(1, int(dynamic.get(named, {}).get("min", 1)))
            shape.append(size)
        if "value_range" in spec:
            values[spec["name"]] = np.array(spec["value_range"][0], dtype=spec["dtype"]).reshape(shape)
        elif spec["dtype"].startswith("float"):
            values[spec["name"]] = rng.standard_normal(shape).astype(spec["dtype"])
        else:
            lo, hi = spec.get("sample_range", (0, 1))
            values[spec["name"]] = rng.integers(lo, hi + 1, size=shape).astype(spec["dtype"])
    return values
