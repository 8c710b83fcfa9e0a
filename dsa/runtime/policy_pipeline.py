"""A LeRobot policy's whole pipeline — camera frame to motor command — as data, and its torch-free runner.

A bundle built with `dsa_bundle(module = ..., processors = ..., policy_config = ...)` holds, beside the
compiled network, LeRobot's own processor files (policy_preprocessor.json, policy_postprocessor.json, their
statistics .safetensors, the tokenizer.json), the policy's config.json, and `policy_pipeline.json`: the
pipeline's nodes in run order, each with its implementation (numpy in the runtime, the `tokenizers`
library, or the compiled IREE module) and the digests of what it reads, and the typed edges between them
(name, shape, dtype, raw or normalised). `describe` writes it at bundle time (DsaBundle), checking that the
processors, the config and the network agree; `PolicyPipeline` runs it (dsa.runtime.load on such a bundle):

    observation (raw: uint8 HWC frames, raw state, task text)
      → prepare_observation (frames to float CHW in [0, 1], batch of 1: LeRobot's prepare_observation_for_inference)
      → preprocessor steps (LeRobot's pipeline: batching, normalisation with the dataset statistics, tokenizer)
      → [observation_history: Diffusion Policy's n_obs_steps queue]
      → network (the compiled module; noise drawn by the runtime for flow / diffusion policies)
      → action_queue (n_action_steps) | temporal_ensembler (ACT with temporal_ensemble_coeff)
      → postprocessor steps (un-normalisation) → action (raw motor command, [action dim])

The statistics and the tokenizer are data in the bundle, not in the module: a new dataset's statistics
rebuild the bundle (DsaLock, DsaBundle), never the export or the modules. Imports numpy (and `tokenizers`
when the preprocessor tokenises); never torch.
"""

from __future__ import annotations

import collections
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from dsa.core.errors import DsaError
from dsa.core.fileio import sha256_file
from dsa.core.formats import POLICY_PIPELINE_FORMAT
from dsa.core.lerobot_types import LEROBOT_TYPE_NAMES, LEROBOT_TYPES
POLICY_PIPELINE_JSON = "policy_pipeline.json"
POLICY_CONFIG_JSON = "policy_config.json"
PREPROCESSOR_JSON = "policy_preprocessor.json"
POSTPROCESSOR_JSON = "policy_postprocessor.json"
TOKENIZER_JSON = "tokenizer.json"
# Inputs of a network that the runtime makes itself (not from the observation).
NOISE_INPUT = "noise"
# The LeRobot policy types a pipeline is built for: those of the one table, dsa.core.lerobot_types.
POLICY_TYPES = LEROBOT_TYPE_NAMES


def _is_image(key: str) -> bool:
    return "image" in key  # LeRobot's own test (prepare_observation_for_inference)


# -- bundle time ---------------------------------------------------------------------------------------------

def pinned_files(manifest: Mapping[str, Any], manifest_path: str, given: Sequence[Path],
                 policy_config: Path) -> Dict[str, Path]:
    """The processor files of the manifest's `processors`, matched by file name among `given` (the files the
    build passes) and checked against their pins; plus the policy config against model.policy_config.
    `manifest` is the manifest's runtime view (it carries both); `manifest_path` names the manifest in
    errors. Returns bundle member name → file."""
    procs = manifest.get("processors")
    if procs is None:
        raise DsaError(f"{manifest_path}: processors", "is missing: the bundle is asked to ship processors the "
                       "manifest does not pin", "add processors (schema 1.6) or drop the bundle's processors")
    by_name: Dict[str, Path] = {}
    for path in given:
        path = Path(path)
        if path.name in by_name and sha256_file(by_name[path.name]) != sha256_file(path):
            raise DsaError(f"processors: {path.name}", "two different files have this name", "pass one of them")
        by_name[path.name] = path
    entries: List[Tuple[str, Mapping[str, str]]] = [("processors.preprocessor", procs["preprocessor"]),
                                                     ("processors.postprocessor", procs["postprocessor"])]
    entries += [(f"processors.files[{i}]", e) for i, e in enumerate(procs.get("files", []))]
    if "tokenizer" in procs:
        entries.append(("processors.tokenizer", procs["tokenizer"]))
    members: Dict[str, Path] = {}
    for field, entry in entries:
        name = Path(entry["path"]).name
        if field.endswith("preprocessor") and name != PREPROCESSOR_JSON or \
                field.endswith("postprocessor") and name != POSTPROCESSOR_JSON or \
                field.endswith("tokenizer") and name != TOKENIZER_JSON:
            want = {"preprocessor": PREPROCESSOR_JSON, "postprocessor": POSTPROCESSOR_JSON,
                    "tokenizer": TOKENIZER_JSON}[field.rsplit(".", 1)[1]]
            raise DsaError(f"{manifest_path}: {field}.path", f"names '{name}', not {want}",
                           "pin the file LeRobot's save_pretrained wrote under its own name")
        if name not in by_name:
            raise DsaError(f"{manifest_path}: {field}.path", f"'{entry['path']}' is not among the bundle's "
                           f"processor files ({', '.join(sorted(by_name)) or 'none'})",
                           "pass the policy directory's processor files to the bundle (dsa_bundle processors)")
        got = sha256_file(by_name[name])
        if got != entry["sha256"]:
            raise DsaError(f"{manifest_path}: {field}.sha256", f"pins {entry['sha256']}, but {by_name[name]} has "
                           f"sha256 {got}", "these are other processor files (another dataset's statistics?): "
                           "pin the new digest in the manifest if they are the intended ones")
        members[name] = by_name[name]
    config_pin = manifest.get("policy_config")
    got = sha256_file(policy_config)
    if config_pin is None or got != config_pin["sha256"]:
        raise DsaError(f"{manifest_path}: model.policy_config.sha256", f"does not pin {policy_config} (sha256 {got})",
                       "pass the policy directory's config.json the model was built from")
    members[POLICY_CONFIG_JSON] = Path(policy_config)
    return members


def describe(manifest: Mapping[str, Any], manifest_path: str, members: Mapping[str, Path],
             records: Mapping[str, dict], module_digests: Mapping[str, str]) -> dict:
    """policy_pipeline.json for the bundle: checks that LeRobot's processor files, the policy's config.json and
    the compiled network agree (features, shapes, n_action_steps) and describes the pipeline's nodes and
    edges. `manifest`: the manifest's runtime view; `records`: module name → export record;
    `module_digests`: module name → the vmfb's sha256."""
    from dsa.runtime.processors import ProcessorPipeline

    config = json.loads(Path(members[POLICY_CONFIG_JSON]).read_text(encoding="utf-8"))
    where = f"{manifest_path}: model.policy_config"
    policy_type = config.get("type")
    if policy_type not in POLICY_TYPES:
        raise DsaError(f"{where}: type", f"is {policy_type!r}", f"a policy pipeline is built for {', '.join(POLICY_TYPES)}")
    facts = LEROBOT_TYPES[policy_type]
    tokenizer = members.get(TOKENIZER_JSON)
    pre = ProcessorPipeline.load(Path(members[PREPROCESSOR_JSON]), tokenizer_file=tokenizer, lazy_tokenizer=True)
    post = ProcessorPipeline.load(Path(members[POSTPROCESSOR_JSON]))
    read = {p.name for p in list(pre.files()) + list(post.files())}
    listed = {n for n in members if n not in (PREPROCESSOR_JSON, POSTPROCESSOR_JSON, POLICY_CONFIG_JSON)}
    unlisted = sorted(read - listed)
    if unlisted:
        raise DsaError(f"{manifest_path}: processors.files", f"does not pin {', '.join(unlisted)}, which the "
                       "processor pipelines read", "add each file with its sha256")
    extra = sorted(listed - read)
    if extra:
        raise DsaError(f"{manifest_path}: processors", f"pins {', '.join(extra)}, which no processor step reads",
                       "remove it, or pin the processor files that read it")
    uncovered = pre.uncovered_features() + post.uncovered_features()
    if uncovered:
        node, key, mode = uncovered[0]
        raise DsaError(f"{manifest_path}: processors: {node}",
                       f"normalises {key!r} ({mode}) but its statistics file has no {key!r} entry; LeRobot would "
                       f"pass it through un-normalised"
                       + (f" (and {len(uncovered) - 1} more)" if len(uncovered) > 1 else ""),
                       "save the processors with the dataset's statistics for every feature (or map its type to "
                       "IDENTITY in norm_map)")

    # The network: the first module's record (every bucket takes the same inputs).
    first = records[sorted(records)[0]]
    for field, high in (("n_action_steps", MAX_CHUNK), ("n_obs_steps", MAX_OBS_STEPS), ("chunk_size", MAX_CHUNK)):
        if field in config and not _count(config[field], 1, high):
            raise DsaError(f"{where}: {field}", f"is {str(config[field])[:40]}, not a count from 1 to {high}")
    n_action_steps = int(config.get("n_action_steps", 1))
    if n_action_steps != int(manifest["n_action_steps"]):
        raise DsaError(f"{manifest_path}: n_action_steps", f"is {manifest['n_action_steps']}, the policy's "
                       f"config.json says {n_action_steps}", "make them agree: LeRobot's select_action keeps the "
                       "config's n_action_steps")
    observation: Dict[str, dict] = {}
    for key, feature in config.get("input_features", {}).items():
        shape = list(feature["shape"])
        if feature["type"] == "VISUAL":
            observation[key] = {"dtype": "uint8", "shape": [shape[1], shape[2], shape[0]], "layout": "HWC",
                                "space": "raw"}
        else:
            observation[key] = {"dtype": "float32", "shape": shape, "space": "raw"}
    tokenises = any(s["registry_name"] == "tokenizer_processor" for s in pre.describe())
    if tokenises:
        observation["task"] = {"dtype": "str", "shape": [], "space": "text"}
    action_dim = list(config["output_features"]["action"]["shape"])

    noise = None
    steps = None
    network_inputs = []
    for spec in first["inputs"]:
        shape = [1] + list(spec["shape"][1:]) if spec.get("dims", {}).get("0") == "batch" else list(spec["shape"])
        entry = {"name": spec["name"], "dtype": spec["dtype"], "shape": shape}
        if spec["name"] == NOISE_INPUT:
            noise = {"input": spec["name"], "shape": shape, "dtype": spec["dtype"]}
            entry["space"] = "noise"
        elif "value_range" in spec:
            steps = {"input": spec["name"], "value": int(manifest["flow_steps"])}
            entry["space"] = "constant"
        else:
            entry["space"] = "normalised"
            written = set(observation).union(*(set(s["writes"]) for s in pre.describe()))
            if spec["name"] not in written:
                raise DsaError(f"{manifest_path}: processors.preprocessor", f"the network takes "
                               f"'{spec['name']}', which neither the observation nor any preprocessor step gives",
                               "the processors are another policy's: pin this policy's processor files")
        network_inputs.append(entry)
    out = first["outputs"][0]
    chunk = int(out["shape"][1])
    loop = {
        "n_action_steps": n_action_steps,
        "chunk_size": chunk,
        "n_obs_steps": int(config.get(facts.obs_steps_field, 1)) if facts.obs_steps_field else 1,
        "temporal_ensemble_coeff": config.get("temporal_ensemble_coeff") if facts.temporal_ensemble else None,
        "noise": noise,
        "steps": steps,
        # The manifest's prompt pad id: what pads a prompt shorter than the module's (see _as_input).
        "prompt_pad_id": (manifest["inputs"].get("prompt") or {}).get("pad_id"),
    }

    def step_nodes(pipeline, prefix: str) -> List[dict]:
        nodes = []
        for step in pipeline.describe():
            node = {"name": f"{prefix}[{step['step']}] {step['registry_name']}",
                    "implementation": step["implementation"], "reads": step["reads"], "writes": step["writes"]}
            if step.get("state_file"):
                node["state_file"] = {"file": step["state_file"],
                                      "sha256": sha256_file(Path(members[step["state_file"]]))}
            if step["registry_name"] == "tokenizer_processor":
                node["tokenizer"] = {"file": TOKENIZER_JSON, "sha256": sha256_file(Path(members[TOKENIZER_JSON]))}
            nodes.append(node)
        return nodes

    pre_file = {"file": PREPROCESSOR_JSON, "sha256": sha256_file(Path(members[PREPROCESSOR_JSON]))}
    post_file = {"file": POSTPROCESSOR_JSON, "sha256": sha256_file(Path(members[POSTPROCESSOR_JSON]))}
    nodes: List[dict] = [
        {"name": "observation", "implementation": "input", "writes": sorted(observation)},
        {"name": "prepare_observation", "implementation": "numpy",
         "does": "frames uint8 HWC → float32 CHW / 255; a batch of 1 (LeRobot's prepare_observation_for_inference)"},
    ]
    nodes += [dict(n, pipeline=pre_file) for n in step_nodes(pre, "preprocessor")]
    if loop["n_obs_steps"] > 1:
        nodes.append({"name": "observation_history", "implementation": "numpy",
                      "does": f"the last {loop['n_obs_steps']} observations per input, stacked on axis 1"})
    if noise is not None:
        nodes.append({"name": "noise", "implementation": "numpy",
                      "does": f"standard normal {noise['shape']} float32 per network call (numpy Generator)"})
    nodes.append({"name": "network", "implementation": "iree-module", "model_id": manifest["model_id"],
                  "modules": {name: module_digests[name] for name in sorted(records)},
                  "inputs": network_inputs, "outputs": [{"name": out["name"], "dtype": out["dtype"],
                                                         "shape": [1] + list(out["shape"][1:]),
                                                         "space": "normalised"}]})
    if loop["temporal_ensemble_coeff"] is not None:
        nodes.append({"name": "temporal_ensembler", "implementation": "numpy",
                      "does": f"ACT's temporal ensembling, coefficient {loop['temporal_ensemble_coeff']}"})
    else:
        nodes.append({"name": "action_queue", "implementation": "numpy",
                      "does": f"the first {n_action_steps} actions of each chunk, one per control step"})
    nodes += [dict(n, pipeline=post_file) for n in step_nodes(post, "postprocessor")]
    nodes.append({"name": "action", "implementation": "output", "reads": ["action"]})

    names = [n["name"] for n in nodes]
    pre_names = [n for n in names if n.startswith("preprocessor")]
    post_names = [n for n in names if n.startswith("postprocessor")]
    before_network = "observation_history" if "observation_history" in names else (
        pre_names[-1] if pre_names else "prepare_observation")
    queue = "temporal_ensembler" if "temporal_ensembler" in names else "action_queue"
    prepared = [{"name": k, "dtype": "float32", "space": "raw" if not _is_image(k) else "unit",
                 "shape": [1] + ([v["shape"][2], v["shape"][0], v["shape"][1]] if v.get("layout") else v["shape"])}
                for k, v in sorted(observation.items()) if k != "task"]
    normalised = [i for i in network_inputs if i["space"] == "normalised"]
    edges = [
        {"from": "observation", "to": "prepare_observation",
         "tensors": [{"name": k, **v} for k, v in sorted(observation.items())]},
        {"from": "prepare_observation", "to": pre_names[0] if pre_names else before_network, "tensors": prepared},
    ]
    if "observation_history" in names:
        edges.append({"from": pre_names[-1] if pre_names else "prepare_observation", "to": "observation_history",
                      "tensors": [dict(i, shape=[1] + i["shape"][2:]) for i in normalised]})
    edges.append({"from": before_network, "to": "network", "tensors": normalised})
    if noise is not None:
        edges.append({"from": "noise", "to": "network",
                      "tensors": [{"name": noise["input"], "dtype": noise["dtype"], "shape": noise["shape"],
                                   "space": "noise"}]})
    edges += [
        {"from": "network", "to": queue, "tensors": nodes[names.index("network")]["outputs"]},
        {"from": queue, "to": post_names[0] if post_names else "action",
         "tensors": [{"name": "action", "dtype": "float32", "shape": [1] + action_dim, "space": "normalised"}]},
        {"from": post_names[-1] if post_names else queue, "to": "action",
         "tensors": [{"name": "action", "dtype": "float32", "shape": action_dim, "space": "raw"}]},
    ]
    return {
        "format": POLICY_PIPELINE_FORMAT,
        "policy_type": policy_type,
        "model_id": manifest["model_id"],
        "policy_config": POLICY_CONFIG_JSON,
        "preprocessor": PREPROCESSOR_JSON,
        "postprocessor": POSTPROCESSOR_JSON,
        "tokenizer": TOKENIZER_JSON if tokenizer is not None else None,
        "observation": observation,
        "action": {"dtype": "float32", "shape": action_dim, "space": "raw"},
        "loop": loop,
        "nodes": nodes,
        "edges": edges,
    }


# -- run time ------------------------------------------------------------------------------------------------

# Bounds of policy_pipeline.json's loop (every size it states is checked before anything is allocated): the
# manifest schema's chunk bound, Diffusion Policy's observation history (2 in LeRobot's configs), a noise
# tensor of at most 2^24 elements (64 MiB of float32; a π0 chunk of 50 x 32 is 1600).
MAX_CHUNK = 4096
MAX_OBS_STEPS = 64
MAX_NOISE_ELEMENTS = 1 << 24
MAX_FLOW_STEPS = 10000
MAX_SPEC_BYTES = 4 << 20


def _count(value: Any, low: int, high: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and low <= value <= high


def check_spec(spec: Any, where: str) -> dict:
    """policy_pipeline.json as the runtime takes it: the files it names are the bundle's own members under their
    fixed names, and every size of its loop is bounded (refused naming the field and the limit)."""
    if not isinstance(spec, dict) or spec.get("format") != POLICY_PIPELINE_FORMAT:
        raise DsaError(where, f"is not a policy pipeline of format {POLICY_PIPELINE_FORMAT}",
                       "rebuild the bundle with this release")
    for field, name in (("preprocessor", PREPROCESSOR_JSON), ("postprocessor", POSTPROCESSOR_JSON),
                        ("policy_config", POLICY_CONFIG_JSON)):
        if spec.get(field) != name:
            raise DsaError(f"{where}: {field}", f"names {str(spec.get(field))[:100]!r}, not the bundle's {name}",
                           "a policy pipeline names only the bundle's own members")
    if spec.get("tokenizer") not in (None, TOKENIZER_JSON):
        raise DsaError(f"{where}: tokenizer", f"names {str(spec.get('tokenizer'))[:100]!r}, not the bundle's "
                       f"{TOKENIZER_JSON}", "a policy pipeline names only the bundle's own members")
    if spec.get("policy_type") not in POLICY_TYPES:
        raise DsaError(f"{where}: policy_type", f"is {str(spec.get('policy_type'))[:40]!r}",
                       f"one of {', '.join(POLICY_TYPES)}")
    loop = spec.get("loop")
    if not isinstance(loop, dict):
        raise DsaError(f"{where}: loop", "is missing or not an object")
    for field, high in (("chunk_size", MAX_CHUNK), ("n_action_steps", MAX_CHUNK), ("n_obs_steps", MAX_OBS_STEPS)):
        if not _count(loop.get(field), 1, high):
            raise DsaError(f"{where}: loop.{field}", f"is {str(loop.get(field))[:40]}, not a count from 1 to {high}")
    if loop["n_action_steps"] > loop["chunk_size"]:
        raise DsaError(f"{where}: loop.n_action_steps", f"{loop['n_action_steps']} is more than the chunk's "
                       f"{loop['chunk_size']} actions", "rebuild with n_action_steps <= chunk_size")
    coeff = loop.get("temporal_ensemble_coeff")
    if coeff is not None and (isinstance(coeff, bool) or not isinstance(coeff, (int, float))
                              or not math.isfinite(coeff) or abs(coeff) > 1):
        raise DsaError(f"{where}: loop.temporal_ensemble_coeff", f"is {str(coeff)[:40]}, not a number from -1 to 1",
                       "LeRobot's ACT uses 0.01")
    pad = loop.get("prompt_pad_id")
    if pad is not None and not _count(pad, 0, (1 << 31) - 1):
        raise DsaError(f"{where}: loop.prompt_pad_id", f"is {str(pad)[:40]}, not a token id")
    noise = loop.get("noise")
    if noise is not None:
        shape = noise.get("shape") if isinstance(noise, dict) else None
        if (not isinstance(shape, list) or not 0 < len(shape) <= 8 or not all(_count(d, 1, MAX_NOISE_ELEMENTS)
                                                                             for d in shape)
                or math.prod(shape) > MAX_NOISE_ELEMENTS or not isinstance(noise.get("input"), str)):
            raise DsaError(f"{where}: loop.noise", f"shape {str(shape)[:80]} is not a shape of at most "
                           f"{MAX_NOISE_ELEMENTS} elements with a named input")
    steps = loop.get("steps")
    if steps is not None and (not isinstance(steps, dict) or not isinstance(steps.get("input"), str)
                              or not _count(steps.get("value"), 1, MAX_FLOW_STEPS)):
        raise DsaError(f"{where}: loop.steps", f"is {str(steps)[:80]}, not {{input, value 1..{MAX_FLOW_STEPS}}}")
    nodes = spec.get("nodes")
    network = [n for n in nodes if isinstance(n, dict) and n.get("name") == "network"] \
        if isinstance(nodes, list) else []
    if len(network) != 1 or not isinstance(network[0].get("inputs"), list):
        raise DsaError(f"{where}: nodes", "has no single network node with its inputs")
    if not isinstance(spec.get("observation"), dict):
        raise DsaError(f"{where}: observation", "is missing or not an object")
    return spec


def read_spec(root: Path, name: str) -> dict:
    """A bundle's policy_pipeline.json (`name`, from bundle.json), confined to the bundle and bounded, checked."""
    from dsa.runtime.processors import pipeline_member, read_bounded_json

    where = f"{root}: bundle.json policy_pipeline"
    if name != POLICY_PIPELINE_JSON:
        raise DsaError(where, f"names {str(name)[:100]!r}, not {POLICY_PIPELINE_JSON}",
                       "a bundle's policy pipeline is its policy_pipeline.json member")
    path = pipeline_member(root, name, where, "policy pipeline", MAX_SPEC_BYTES)
    return check_spec(read_bounded_json(path, str(path), MAX_SPEC_BYTES), str(path))


def _as_input(spec: Mapping[str, Any], value: Any, pad_id: int) -> np.ndarray:
    """A preprocessor output as the network input `spec` takes it: LeRobot's bool attention mask as the module's
    0/1 int64, float64 as float32; a prompt the tokenizer padded to its longest text (SmolVLA's
    `pad_language_to: longest`) padded on the right to the module's prompt length (`pad_id`, mask 0: the
    policy attends to no padded token, so the actions are those of the shorter prompt); any other difference
    is refused."""
    value = np.asarray(value)
    want = np.dtype(spec["dtype"])
    shape = spec["shape"]
    if value.ndim == 2 == len(shape) and value.dtype.kind in "biu" and value.shape[1] < shape[1]:
        fill = 0 if value.dtype == np.bool_ else pad_id
        value = np.pad(value, ((0, 0), (0, shape[1] - value.shape[1])), constant_values=fill)
    if value.dtype == want:
        return value
    if (want.kind in "iu" and value.dtype.kind in "biu") or (want.kind == "f" and value.dtype.kind == "f"):
        return value.astype(want)
    raise DsaError(f"network input {spec['name']}", f"the preprocessor gives {value.dtype}, the module takes {want}",
                   "the processors are not this network's: pin the policy's own processor files")


class PolicyPipeline:
    """Runs a bundle's policy pipeline: raw observation → raw action, one control step per `select_action`.

    `run_network(inputs) -> action chunk` is the compiled module (dsa.runtime.deploy). Noise for flow /
    diffusion policies is drawn from `np.random.default_rng(seed)` when the network runs (one draw per call,
    float32 standard normal of the network's noise shape): the same seed gives the same episode.
    `temporal_ensemble_coeff` (ACT) overrides the config's, as LeRobot lets a deployment set it (with
    n_action_steps 1, as LeRobot's ACTConfig requires): the pipeline then runs the network every step and
    ensembles the overlapping chunks."""

    def __init__(self, root: Path, spec: dict, run_network: Callable[[Dict[str, np.ndarray]], np.ndarray], *,
                 seed: int = 0, temporal_ensemble_coeff: Optional[float] = None):
        from dsa.runtime.processors import ProcessorPipeline, TemporalEnsembler

        self.root = Path(root)
        self.spec = spec = check_spec(spec, str(self.root / POLICY_PIPELINE_JSON))
        tokenizer = self.root / TOKENIZER_JSON if spec.get("tokenizer") else None
        self.preprocessor = ProcessorPipeline.load(self.root / PREPROCESSOR_JSON, tokenizer_file=tokenizer)
        self.postprocessor = ProcessorPipeline.load(self.root / POSTPROCESSOR_JSON)
        self._run_network = run_network
        loop = spec["loop"]
        self.n_action_steps = int(loop["n_action_steps"])
        self.n_obs_steps = int(loop["n_obs_steps"])
        coeff = temporal_ensemble_coeff if temporal_ensemble_coeff is not None else loop["temporal_ensemble_coeff"]
        self.ensembler = None
        if coeff is not None:
            if not LEROBOT_TYPES[spec["policy_type"]].temporal_ensemble:
                raise DsaError("temporal_ensemble_coeff", f"is ACT's; this bundle's policy is {spec['policy_type']}")
            self.n_action_steps = 1  # LeRobot's ACT: ensembling runs the network every step
            self.ensembler = TemporalEnsembler(float(coeff), int(loop["chunk_size"]))
        self.pad_id = int(loop.get("prompt_pad_id") or 0)
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self._queue: Deque[np.ndarray] = collections.deque()
        self._history: Dict[str, Deque[np.ndarray]] = {}
        self.timings: Dict[str, float] = {}
        self.network_inputs = [i for i in next(n for n in spec["nodes"] if n["name"] == "network")["inputs"]]

    def reset(self) -> None:
        """Start of an episode: empties the action queue, the observation history and the ensembler; the noise
        generator restarts from the seed."""
        self._queue.clear()
        self._history.clear()
        if self.ensembler is not None:
            self.ensembler.reset()
        self._rng = np.random.default_rng(self.seed)

    def _timed(self, node: str, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        self.timings[node] = self.timings.get(node, 0.0) + time.perf_counter() - start
        return result

    def _check_observation(self, observation: Mapping[str, Any], task: Optional[str]) -> Dict[str, Any]:
        raw: Dict[str, Any] = {}
        for key, spec in self.spec["observation"].items():
            if key == "task":
                continue
            if key not in observation:
                raise DsaError(f"observation: {key}", "is missing", f"the policy reads {', '.join(sorted(self.spec['observation']))}")
            value = np.asarray(observation[key])
            if list(value.shape) != list(spec["shape"]) or value.dtype != np.dtype(spec["dtype"]):
                raise DsaError(f"observation: {key}", f"is {value.dtype} {list(value.shape)}, the policy reads "
                               f"{spec['dtype']} {spec['shape']}" + (" (H, W, C)" if spec.get("layout") else ""),
                               "pass the camera frame / state as the robot gives it")
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                raise DsaError(f"observation: {key}", "holds NaN or an infinity", "a sensor reading must be finite: "
                               "check the robot's driver (the policy would turn it into NaN motor commands)")
            raw[key] = value
        if "task" in self.spec["observation"] and not isinstance(task, str):
            raise DsaError("task", "is missing: this policy's preprocessor tokenises the task text",
                           "pass task='...'")
        if isinstance(task, str):
            from dsa.runtime.processors import check_task_text

            check_task_text(task, "task")
        return raw

    def select_action(self, observation: Mapping[str, Any], task: Optional[str] = None) -> np.ndarray:
        """One control step: the raw action (float32 [action dim]) for the raw observation."""
        from dsa.runtime.processors import prepare_observation

        self.timings = {}
        raw = self._check_observation(observation, task)
        batch = self._timed("prepare_observation", prepare_observation, raw, task)
        batch = self.preprocessor(batch, self.timings, "preprocessor")
        inputs = {i["name"]: _as_input(i, batch[i["name"]], self.pad_id) for i in self.network_inputs
                  if i["space"] == "normalised"}
        if self.n_obs_steps > 1:
            self._timed("observation_history", self._remember, inputs)
        if self.ensembler is not None:
            chunk = self._network(inputs)
            action = self._timed("temporal_ensembler", self.ensembler.update, chunk)
        else:
            if not self._queue:
                chunk = self._network(inputs)
                if chunk.shape[1] < self.n_action_steps:
                    raise DsaError("n_action_steps", f"{self.n_action_steps} is more than the chunk's "
                                   f"{chunk.shape[1]} actions", "rebuild with n_action_steps <= chunk_size")
                self._queue.extend(np.array(chunk[:, i], copy=True) for i in range(self.n_action_steps))
            action = self._timed("action_queue", self._queue.popleft)
        result = self.postprocessor({"action": action}, self.timings, "postprocessor")
        return np.asarray(result["action"], dtype=np.float32).reshape(-1)

    def _remember(self, inputs: Dict[str, np.ndarray]) -> None:
        """Diffusion Policy's observation queues (LeRobot's populate_queues): the first observation of an episode
        fills the history, later ones push the oldest out."""
        for name, value in inputs.items():
            queue = self._history.setdefault(name, collections.deque(maxlen=self.n_obs_steps))
            while len(queue) < self.n_obs_steps - 1:
                queue.append(value)
            queue.append(value)

    def _network(self, inputs: Dict[str, np.ndarray]) -> np.ndarray:
        feeds = dict(inputs)
        if self.n_obs_steps > 1:
            feeds = {name: np.stack(list(self._history[name]), axis=1) for name in inputs}
        noise = self.spec["loop"].get("noise")
        if noise is not None:
            feeds[noise["input"]] = self._timed("noise", lambda: self._rng.standard_normal(
                noise["shape"], dtype=np.float32))
        steps = self.spec["loop"].get("steps")
        if steps is not None:
            feeds[steps["input"]] = np.array(steps["value"], dtype=np.int64)
        feeds = {k: np.ascontiguousarray(v, dtype=np.float32) if v.dtype == np.float64 else v
                 for k, v in feeds.items()}
        return self._timed("network", self._run_network, feeds)
