"""LeRobot's policy processor pipelines in numpy: a compiled policy's pre/post-processing without torch.

    from dsa.runtime.processors import ProcessorPipeline, prepare_observation

    pre = ProcessorPipeline.load(model_dir / "policy_preprocessor.json", tokenizer_file=model_dir / "tokenizer.json")
    post = ProcessorPipeline.load(model_dir / "policy_postprocessor.json")
    batch = pre(prepare_observation(frames_and_state, task="pick up the cube"))
    action = post({"action": chunk_or_action})["action"]

`ProcessorPipeline.load` reads the JSON that LeRobot 0.4.4's `PolicyProcessorPipeline.save_pretrained` writes
(`{"name", "steps": [{"registry_name", "config", "state_file"?}]}`) and the `*_step_N_*.safetensors` state
files beside it, and rebuilds each step from the numpy implementations below: the same formulas in the same
float order as LeRobot's torch code, so a float32 input gives bit-identical float32 output
(tests/runtime/processors_test.py compares against LeRobot's own pipeline objects). A step this module does not
know is refused at load time, never skipped.

Data convention. A pipeline takes and returns one flat dict, as LeRobot's preprocessor does (batch_to_transition
/ transition_to_batch): keys starting with "observation." are the observation; "action" is the action; "task",
"subtask", "index", "task_index", "episode_index" and any "*_is_pad" key are complementary data; every other key
is dropped (LeRobot drops them too, e.g. "robot_type"). The result holds the observation keys, the
complementary keys and "action" when there is one; LeRobot's bookkeeping keys ("next.reward", "next.done",
"next.truncated", "info", and "action": None) are not added. The postprocessor, which LeRobot calls on a bare
tensor, is called here as `post({"action": array})` and returns `{"action": array}`.

Arrays are numpy arrays; the preprocessor's outputs: images and state in their input float dtype (float32 from
`prepare_observation`), "observation.language.tokens" int64 [B, L] and "observation.language.attention_mask"
bool [B, L] (the subtask pair likewise when a "subtask" is given), "task" a list of strings.

Imports numpy and the standard library only; `tokenizers` is imported when a pipeline has a tokenizer step."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from dsa.core.errors import DsaError
# The bounded file readers (processor_files.py) stay importable from here.
from dsa.runtime.processor_files import (  # noqa: F401
    MAX_PIPELINE_JSON_BYTES, MAX_PIPELINE_STEPS, MAX_RENAMES, MAX_STATE_FILE_BYTES, MAX_STAT_MAGNITUDE,
    MAX_TASK_CHARS, MAX_TOKENIZER_BYTES, MAX_TOKENIZER_LENGTH, check_statistics, nest_stats, pipeline_member,
    read_bounded_json, read_safetensors)


OBS_PREFIX = "observation."
OBS_STATE = "observation.state"
OBS_ENV_STATE = "observation.environment_state"
OBS_IMAGE = "observation.image"
OBS_IMAGES = "observation.images"
ACTION = "action"
LANGUAGE_TOKENS = "observation.language.tokens"
LANGUAGE_MASK = "observation.language.attention_mask"
SUBTASK_TOKENS = "observation.subtask.tokens"
SUBTASK_MASK = "observation.subtask.attention_mask"
_COMPLEMENTARY = ("task", "subtask", "index", "task_index", "episode_index")


# -- the observation, as LeRobot's prepare_observation_for_inference makes it ----------------------------------

def prepare_observation(raw: Dict[str, Any], task: Optional[str] = None,
                        robot_type: Optional[str] = None) -> Dict[str, Any]:
    """LeRobot's `prepare_observation_for_inference` in numpy: every array gets a batch dimension of 1; a key
    containing "image" must be a uint8 HWC frame (C of 1, 3 or 4) and becomes float32 CHW in [0, 1] (x / 255);
    "task" and "robot_type" are added ("" when not given). `raw` is not modified."""
    out: Dict[str, Any] = {}
    for name, value in raw.items():
        array = np.asarray(value)
        if "image" in name:
            if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] not in (1, 3, 4):
                raise DsaError(f"observation {name!r}", f"is a {array.dtype} array of shape {list(array.shape)}; a "
                               "camera frame must be uint8 HWC (height, width, 1/3/4 channels)",
                               "pass the camera's raw uint8 frame; the scaling to [0, 1] and CHW happen here")
            array = np.ascontiguousarray((array.astype(np.float32) / np.float32(255)).transpose(2, 0, 1))
        out[name] = array[None]
    out["task"] = task if task else ""
    out["robot_type"] = robot_type if robot_type else ""
    return out


# -- steps ------------------------------------------------------------------------------------------------------
# Each step maps a transition {"observation": dict | None, "action": array | None, "complementary": dict} to a
# new one, as LeRobot's EnvTransition steps do.

Transition = Dict[str, Any]


class _Step:
    implementation = "numpy"
    reads: List[str] = []
    writes: List[str] = []

    def __init__(self, where: str, config: Dict[str, Any]):
        self.where = where
        self.config = config

    def __call__(self, t: Transition) -> Transition:
        raise NotImplementedError


class _Rename(_Step):
    def __init__(self, where, config):
        super().__init__(where, config)
        rename_map = config.get("rename_map") or {}
        if not isinstance(rename_map, dict) or len(rename_map) > MAX_RENAMES or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in rename_map.items()):
            raise DsaError(where, f"rename_map is not an object of at most {MAX_RENAMES} name: name entries")
        self.rename_map = dict(rename_map)
        self.reads, self.writes = list(self.rename_map), list(self.rename_map.values())
        if not self.rename_map:
            self.implementation = "none"

    def __call__(self, t):
        obs = _observation_of(t, self.where)
        return {**t, "observation": {self.rename_map.get(k, k): v for k, v in obs.items()}}


class _ToBatch(_Step):
    """AddBatchDimensionProcessorStep: a 1-D action, 1-D state / environment state and 3-D images
    ("observation.image", "observation.images.*") get a leading 1; a task string becomes a list; 0-d
    index / task_index get a dimension."""

    reads = writes = [ACTION, OBS_STATE, OBS_ENV_STATE, OBS_IMAGE, OBS_IMAGES + ".*", "task", "index", "task_index"]

    def __call__(self, t):
        t = dict(t)
        action = t.get("action")
        if isinstance(action, np.ndarray) and action.ndim == 1:
            t["action"] = action[None]
        if t.get("observation") is not None:
            obs = dict(t["observation"])
            for key, value in obs.items():
                if not isinstance(value, np.ndarray):
                    continue
                if (key in (OBS_STATE, OBS_ENV_STATE) and value.ndim == 1) or (
                        (key == OBS_IMAGE or key.startswith(OBS_IMAGES + ".")) and value.ndim == 3):
                    obs[key] = value[None]
            t["observation"] = obs
        comp = dict(t["complementary"])
        if isinstance(comp.get("task"), str):
            comp["task"] = [comp["task"]]
        for key in ("index", "task_index"):
            if isinstance(comp.get(key), np.ndarray) and comp[key].ndim == 0:
                comp[key] = comp[key][None]
        t["complementary"] = comp
        return t


class _Device(_Step):
    """DeviceProcessorStep: placement is the caller's business here; a float_dtype of float32 casts floating
    arrays as LeRobot does, any other dtype is refused (the compiled modules take float32)."""

    def __init__(self, where, config):
        super().__init__(where, config)
        dtype = config.get("float_dtype")
        if dtype not in (None, "float32", "float"):
            raise DsaError(where, f"device_processor has float_dtype {dtype!r}; this runtime casts to float32 only",
                           "rebuild the pipeline with float_dtype null or 'float32'")
        self.cast = dtype is not None
        self.implementation = "numpy" if self.cast else "none"
        self.reads = self.writes = ["*"] if self.cast else []

    def __call__(self, t):
        if not self.cast:
            return t

        def cast(v):
            return v.astype(np.float32) if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating) else v

        t = dict(t)
        if t.get("action") is not None:
            t["action"] = cast(t["action"])
        for part in ("observation", "complementary"):
            if t.get(part) is not None:
                t[part] = {k: cast(v) for k, v in t[part].items()}
        return t


_NORM_MODES = ("MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10", "IDENTITY")
_MODE_STATS = {"MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"),
               "QUANTILE10": ("q10", "q90")}


class _Normalize(_Step):
    """NormalizerProcessorStep / UnnormalizerProcessorStep. Every feature of `features` whose type is not ACTION
    and that is in the observation, and the action (always under the stats key "action", with the ACTION mode),
    is transformed by its type's mode in `norm_map`. As in LeRobot: a type missing from norm_map is IDENTITY; a
    key with no stats in the state file passes through unchanged (so does everything when the step was saved
    without stats: it then has no state file); a key whose stats lack the mode's pair is an error. The arithmetic
    runs in the input's float dtype with the stats cast to it, in LeRobot's operation order."""

    def __init__(self, where, config, stats: Dict[str, Dict[str, np.ndarray]], inverse: bool):
        super().__init__(where, config)
        self.inverse = inverse
        eps = config.get("eps", 1e-8)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps <= 1e-2:
            raise DsaError(where, f"eps {str(eps)[:40]} is not a number from 0 to 0.01", "LeRobot's default is 1e-8")
        self.eps = float(eps)
        features, norm_map = config.get("features"), config.get("norm_map")
        features = {} if features is None else features
        norm_map = {} if norm_map is None else norm_map
        if not isinstance(features, dict) or not all(isinstance(v, dict) and "type" in v for v in features.values()):
            raise DsaError(where, "features is not an object of {name: {type, shape}}")
        if not isinstance(norm_map, dict):
            raise DsaError(where, "norm_map is not an object of {feature type: mode}")
        self.features = {k: str(v["type"]) for k, v in features.items()}
        self.norm_map = {str(k): str(v) for k, v in norm_map.items()}
        for mode in self.norm_map.values():
            if mode not in _NORM_MODES:
                raise DsaError(where, f"norm_map has unknown normalization mode {mode!r}",
                               f"supported: {', '.join(_NORM_MODES)}")
        keys = config.get("normalize_observation_keys")
        self.only = set(keys) if keys is not None else None
        self.stats = stats
        self.obs_keys = [k for k, ftype in self.features.items()
                         if ftype != "ACTION" and (self.only is None or k in self.only)]
        self.reads = self.writes = self.obs_keys + [ACTION]

    def __call__(self, t):
        t = dict(t)
        if t.get("observation") is not None:
            obs = dict(t["observation"])
            for key in self.obs_keys:
                if key in obs:
                    obs[key] = self._apply(obs[key], key, self.features[key])
            t["observation"] = obs
        if t.get("action") is not None:
            t["action"] = self._apply(t["action"], ACTION, "ACTION")
        return t

    def uncovered(self) -> List[Tuple[str, str]]:
        """(feature, mode) for each feature this step transforms at inference (the observation's before the
        network, the action's after it) whose mode is not IDENTITY but which has no statistics: LeRobot passes
        such a feature through unchanged, without a word."""
        keys = [ACTION] if self.inverse else self.obs_keys
        modes = [(k, self.norm_map.get("ACTION" if k == ACTION else self.features[k], "IDENTITY")) for k in keys]
        return [(k, m) for k, m in modes if m != "IDENTITY" and k not in self.stats]

    def _apply(self, value, key: str, ftype: str):
        mode = self.norm_map.get(ftype, "IDENTITY")
        if mode == "IDENTITY" or key not in self.stats:
            return value
        x = np.asarray(value)
        if x.dtype not in (np.float32, np.float64):
            raise DsaError(self.where, f"{key!r} is {x.dtype}; normalisation takes float32 or float64",
                           "cast it to float32 first (LeRobot would cast the stats to this dtype)")
        lo_name, hi_name = _MODE_STATS[mode]
        stats = self.stats[key]
        if lo_name not in stats or hi_name not in stats:
            raise DsaError(self.where, f"{mode} normalisation of {key!r} needs the stats {lo_name!r} and "
                           f"{hi_name!r}; the state file has {sorted(stats)}", "recompute the dataset stats")
        f = x.dtype.type
        lo, hi = stats[lo_name].astype(x.dtype), stats[hi_name].astype(x.dtype)
        one, two, eps = f(1), f(2), f(self.eps)
        if mode == "MEAN_STD":
            mean, std = lo, hi
            out = x * std + mean if self.inverse else (x - mean) / (std + eps)
        else:
            denom = hi - lo
            denom = np.where(denom == 0, eps, denom).astype(x.dtype)
            if mode == "MIN_MAX":
                out = (x + one) / two * denom + lo if self.inverse else two * (x - lo) / denom - one
            else:  # QUANTILES, QUANTILE10: LeRobot multiplies before dividing here
                out = (x + one) * denom / two + lo if self.inverse else two * (x - lo) / denom - one
        return np.asarray(out, dtype=x.dtype)


class _NewLine(_Step):
    """SmolVLANewLineProcessor / Pi0NewLineProcessor: the task (a string or a list of strings) ends in "\\n"."""

    reads = writes = ["task"]

    def __call__(self, t):
        comp = t["complementary"]
        task = comp.get("task")
        if isinstance(task, str):
            task = task if task.endswith("\n") else task + "\n"
        elif isinstance(task, list) and all(isinstance(s, str) for s in task):
            task = [s if s.endswith("\n") else s + "\n" for s in task]
        else:
            return t
        return {**t, "complementary": {**comp, "task": task}}


class _Pi05StatePrompt(_Step):
    """Pi05PrepareStateTokenizerProcessorStep: the (normalised) state, zero-padded to max_state_dim, discretised
    into 256 bins over [-1, 1], written into the prompt "Task: {task}, State: {bins};\\nAction: ". LeRobot does
    not save max_state_dim, so a reloaded pipeline uses its default 32, as here."""

    def __init__(self, where, config):
        super().__init__(where, config)
        max_state_dim = config.get("max_state_dim", 32)
        if isinstance(max_state_dim, bool) or not isinstance(max_state_dim, int) or not 0 < max_state_dim <= 4096:
            raise DsaError(where, f"max_state_dim {str(max_state_dim)[:40]} is not a width from 1 to 4096")
        self.max_state_dim = max_state_dim
        self.task_key = config.get("task_key", "task")
        self.reads, self.writes = [OBS_STATE, self.task_key], [self.task_key]

    def __call__(self, t):
        state = (t.get("observation") or {}).get(OBS_STATE)
        if state is None:
            raise DsaError(self.where, f"PI0.5's state prompt needs {OBS_STATE!r}; the observation has none")
        tasks = t["complementary"].get(self.task_key)
        if tasks is None:
            raise DsaError(self.where, f"PI0.5's state prompt needs a {self.task_key!r}; none was given")
        if isinstance(tasks, str):
            tasks = [tasks]
        if not isinstance(tasks, list) or not all(isinstance(task, str) for task in tasks):
            raise DsaError(self.where, f"{self.task_key!r} is not a string or a list of strings")
        check_task_text(tasks, self.where)
        state = np.asarray(state)
        batch = state.shape[0] if state.ndim > 1 else 1
        if len(tasks) != batch:
            raise DsaError(self.where, f"{len(tasks)} task texts for a batch of {batch} states",
                           "give one task text per observation")
        if state.shape[-1] < self.max_state_dim:
            pad = [(0, 0)] * (state.ndim - 1) + [(0, self.max_state_dim - state.shape[-1])]
            state = np.pad(state, pad)
        bins = np.digitize(state, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
        prompts = []
        for i, task in enumerate(tasks):
            cleaned = task.strip().replace("_", " ").replace("\n", " ")
            prompts.append(f"Task: {cleaned}, State: {' '.join(map(str, bins[i]))};\nAction: ")
        return {**t, "complementary": {**t["complementary"], self.task_key: prompts}}


# transformers' Llama / Gemma fast tokenizers rebuild the post-processor from tokenizer_config.json's
# add_bos_token / add_eos_token when they load (update_post_processor); the same is done here for them.
_BOS_EOS_CLASSES = {"LlamaTokenizer", "LlamaTokenizerFast", "GemmaTokenizer", "GemmaTokenizerFast",
                    "CodeLlamaTokenizer", "CodeLlamaTokenizerFast"}


def _token_text(value) -> Optional[str]:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class _Tokenize(_Step):
    """TokenizerProcessorStep with `tokenizers.Tokenizer` on the pinned tokenizer.json, set up as transformers'
    fast tokenizer sets it up for `tokenizer(texts, max_length, truncation, padding, padding_side)`: special
    tokens from the post-processor, truncation longest-first on the tokenizer's truncation side, padding with
    the pad token (tokenizer_config.json / special_tokens_map.json beside tokenizer.json, else tokenizer.json's
    own padding section). Tokens are int64, the attention mask bool, both [B, L]."""

    implementation = "tokenizers"

    def __init__(self, where, config, tokenizer_file: Optional[Path], lazy: bool = False):
        super().__init__(where, config)
        if tokenizer_file is None:
            raise DsaError(where, "tokenizer_processor needs the policy's tokenizer, and no tokenizer_file was given",
                           "the tokenizer.json must be pinned: pass tokenizer_file=<path to tokenizer.json>")
        tokenizer_file = Path(tokenizer_file)
        tokenizer_file = pipeline_member(tokenizer_file.parent, tokenizer_file.name, where, "tokenizer file",
                                         MAX_TOKENIZER_BYTES)
        self.files = [tokenizer_file]
        self.task_key = config.get("task_key", "task")
        max_length = config.get("max_length", 512)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or not 0 < max_length <= MAX_TOKENIZER_LENGTH:
            raise DsaError(where, f"tokenizer_processor max_length {str(max_length)[:40]} is not a token count from 1 "
                           f"to {MAX_TOKENIZER_LENGTH}", "a policy's prompt is at most a few hundred tokens")
        self.max_length = max_length
        padding = config.get("padding", "max_length")
        self.padding = {True: "longest", False: "do_not_pad"}.get(padding, padding)
        if self.padding not in ("max_length", "longest", "do_not_pad"):
            raise DsaError(where, f"tokenizer_processor has padding {padding!r}",
                           "supported: 'max_length', 'longest', 'do_not_pad'")
        truncation = config.get("truncation", True)
        truncation = {True: "longest_first", False: "do_not_truncate"}.get(truncation, truncation)
        if truncation not in ("longest_first", "only_first", "do_not_truncate"):
            raise DsaError(where, f"tokenizer_processor has truncation {truncation!r}",
                           "supported: true, false, 'longest_first', 'only_first'")
        self.padding_side = config.get("padding_side", "right")
        if self.padding_side not in ("left", "right"):
            raise DsaError(where, f"tokenizer_processor has padding_side {self.padding_side!r}")
        self.reads = [self.task_key, "subtask"]
        self.writes = [LANGUAGE_TOKENS, LANGUAGE_MASK, SUBTASK_TOKENS, SUBTASK_MASK]

        self._tokenizer_file = tokenizer_file
        self._truncation = truncation
        # Read now (so that files() lists them), used by _setup.
        self._tok_config = self._read_json(tokenizer_file.parent / "tokenizer_config.json")
        self._special_map = self._read_json(tokenizer_file.parent / "special_tokens_map.json")
        self.tokenizer = None
        if not lazy:
            self._setup()

    def _setup(self) -> None:
        """Loads the tokenizer with the `tokenizers` library, set up as transformers' fast tokenizer is."""
        where, tokenizer_file, truncation = self.where, self._tokenizer_file, self._truncation
        tok_config, special_map = self._tok_config, self._special_map
        try:  # only a pipeline with a tokenizer step needs it
            from tokenizers import Tokenizer, processors
        except ImportError:
            raise DsaError(where, "tokenizer_processor needs the `tokenizers` package, which is not installed",
                           "pip install tokenizers") from None

        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the tokenizers library raises its own Exception type
            raise DsaError(str(tokenizer_file), f"is not a tokenizers tokenizer.json ({e})") from None
        own_padding = json.loads(tokenizer_file.read_text(encoding="utf-8")).get("padding") or {}

        if tok_config.get("tokenizer_class") in _BOS_EOS_CLASSES:
            self._rebuild_post_processor(processors, tok_config, special_map, tokenizer_file)

        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        if truncation != "do_not_truncate":
            side = tok_config.get("truncation_side", "right")
            self.tokenizer.enable_truncation(self.max_length, stride=0, strategy="longest_first", direction=side)
        if self.padding != "do_not_pad":
            pad = (_token_text(tok_config.get("pad_token")) or _token_text(special_map.get("pad_token"))
                   or own_padding.get("pad_token"))
            pad_id = self.tokenizer.token_to_id(pad) if pad is not None else None
            if pad_id is None:
                raise DsaError(where, f"tokenizer_processor pads ({self.padding}) but the tokenizer's pad token "
                               f"{'is not set' if pad is None else repr(pad) + ' is not in its vocabulary'}",
                               "pin tokenizer_config.json (with pad_token) beside tokenizer.json")
            self.tokenizer.enable_padding(direction=self.padding_side, pad_id=pad_id, pad_type_id=0, pad_token=pad,
                                          length=self.max_length if self.padding == "max_length" else None)

    def _rebuild_post_processor(self, processors, tok_config, special_map, tokenizer_file: Path) -> None:
        """transformers' Llama/Gemma update_post_processor: "<bos>:0 $A:0 <eos>:0" as add_bos/add_eos say."""
        flags = {"bos_token": tok_config.get("add_bos_token", True),
                 "eos_token": tok_config.get("add_eos_token", False)}
        tokens: Dict[str, str] = {}
        for name, wanted in flags.items():
            token = _token_text(tok_config.get(name)) or _token_text(special_map.get(name))
            if wanted and (token is None or self.tokenizer.token_to_id(token) is None):
                raise DsaError(str(tokenizer_file), f"tokenizer_config.json sets add_{name} but the {name} "
                               f"{token!r} is not in the vocabulary")
            if wanted:
                tokens[name] = token
        bos, eos = tokens.get("bos_token"), tokens.get("eos_token")
        single = f"{(bos + ':0 ') if bos else ''}$A:0{(' ' + eos + ':0') if eos else ''}"
        pair = f"{single}{(' ' + bos + ':1') if bos else ''} $B:1{(' ' + eos + ':1') if eos else ''}"
        special = [(tok, self.tokenizer.token_to_id(tok)) for tok in dict.fromkeys((bos, eos)) if tok]
        self.tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                                      special_tokens=special)

    def _read_json(self, path: Path) -> Dict[str, Any]:
        if not path.is_file():
            return {}
        self.files.append(path)
        data = read_bounded_json(path, self.where, MAX_PIPELINE_JSON_BYTES)
        if not isinstance(data, dict):
            raise DsaError(str(path), "is not a JSON object")
        return data

    def _encode(self, texts: List[str], key: str) -> Tuple[np.ndarray, np.ndarray]:
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        lengths = {len(e.ids) for e in encodings}
        if len(lengths) > 1:
            raise DsaError(self.where, f"the {key} token sequences have different lengths {sorted(lengths)}",
                           "the pipeline neither pads nor truncates them to one length")
        ids = np.array([e.ids for e in encodings], dtype=np.int64).reshape(len(texts), -1)
        mask = np.array([e.attention_mask for e in encodings], dtype=bool).reshape(len(texts), -1)
        return ids, mask

    def _texts(self, value) -> Optional[List[str]]:
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not texts or not all(isinstance(s, str) for s in texts):
            return None
        check_task_text(texts, self.where)
        return texts

    def __call__(self, t):
        obs = _observation_of(t, self.where)
        comp = t["complementary"]
        if comp.get(self.task_key) is None:
            raise DsaError(self.where, f"tokenizer_processor needs a {self.task_key!r} string; none was given")
        texts = self._texts(comp[self.task_key])  # bounded before the tokenizer is loaded or sees them
        if texts is None:
            raise DsaError(self.where, f"{self.task_key!r} is a {type(comp[self.task_key]).__name__}, not a string "
                           "or a list of strings")
        subtask = self._texts(comp.get("subtask"))
        if self.tokenizer is None:
            self._setup()
        obs = dict(obs)
        obs[LANGUAGE_TOKENS], obs[LANGUAGE_MASK] = self._encode(texts, self.task_key)
        if subtask is not None:
            obs[SUBTASK_TOKENS], obs[SUBTASK_MASK] = self._encode(subtask, "subtask")
        return {**t, "observation": obs}


def check_task_text(texts, where: str) -> None:
    """A task (or subtask) text, or a batch of them: at most MAX_TASK_CHARS characters each and MAX_PIPELINE_STEPS
    texts, refused before the tokenizer sees it (a 50 MB text aborted the process)."""
    texts = [texts] if isinstance(texts, str) else texts
    if len(texts) > MAX_PIPELINE_STEPS:
        raise DsaError(where, f"{len(texts)} task texts in one call, over the limit of {MAX_PIPELINE_STEPS}")
    for text in texts:
        if len(text) > MAX_TASK_CHARS:
            raise DsaError(where, f"the task text is {len(text)} characters, over the limit of {MAX_TASK_CHARS}",
                           "a task is an instruction of a sentence or two")


def _observation_of(t: Transition, where: str) -> Dict[str, Any]:
    if not isinstance(t.get("observation"), dict):
        raise DsaError(where, "this step needs an observation (keys starting with 'observation.'); there is none")
    return t["observation"]


# registry_name -> factory(where, config, stats from the state file, tokenizer_file)
_STEPS: Dict[str, Callable[..., _Step]] = {
    "rename_observations_processor": lambda w, c, s, tf: _Rename(w, c),
    "to_batch_processor": lambda w, c, s, tf: _ToBatch(w, c),
    "device_processor": lambda w, c, s, tf: _Device(w, c),
    "normalizer_processor": lambda w, c, s, tf: _Normalize(w, c, s, inverse=False),
    "unnormalizer_processor": lambda w, c, s, tf: _Normalize(w, c, s, inverse=True),
    "smolvla_new_line_processor": lambda w, c, s, tf: _NewLine(w, c),
    "pi0_new_line_processor": lambda w, c, s, tf: _NewLine(w, c),
    "pi05_prepare_state_tokenizer_processor_step": lambda w, c, s, tf: _Pi05StatePrompt(w, c),
    "tokenizer_processor": lambda w, c, s, tf: _Tokenize(w, c, tf),
}
SUPPORTED_STEPS = tuple(_STEPS)


class ProcessorPipeline:
    """One LeRobot processor pipeline (policy_preprocessor.json or policy_postprocessor.json) in numpy."""

    def __init__(self, json_path: Path, name: str, steps: List[_Step], entries: List[Dict[str, Any]],
                 files: List[Path]):
        self.json_path = json_path
        self.name = name
        self.steps = steps
        self._entries = entries
        self._files = files

    @classmethod
    def load(cls, json_path: Path, tokenizer_file: Optional[Path] = None, *,
             lazy_tokenizer: bool = False) -> "ProcessorPipeline":
        """Reads a pipeline JSON; state files are resolved beside it. A tokenizer_processor step needs
        `tokenizer_file` (the policy's tokenizer.json; tokenizer_config.json beside it is read too).
        `lazy_tokenizer`: the `tokenizers` library loads the tokenizer at the first call, not now (a build
        step that only describes the pipeline runs where `tokenizers` is not installed)."""
        json_path = Path(json_path)
        config = read_bounded_json(json_path, str(json_path), MAX_PIPELINE_JSON_BYTES)
        if not isinstance(config, dict) or not isinstance(config.get("steps"), list):
            raise DsaError(str(json_path), "is not a LeRobot processor pipeline (no 'steps' list)")
        if len(config["steps"]) > MAX_PIPELINE_STEPS:
            raise DsaError(f"{json_path}: steps", f"lists {len(config['steps'])} steps, over the limit of "
                           f"{MAX_PIPELINE_STEPS}", "a LeRobot policy's pipeline has under ten")
        steps: List[_Step] = []
        files: List[Path] = []
        for i, entry in enumerate(config["steps"]):
            name = entry.get("registry_name") if isinstance(entry, dict) else None
            where = f"{json_path}: step {i}"
            if name not in _STEPS:
                seen = name if name is not None else (entry.get("class") if isinstance(entry, dict) else entry)
                raise DsaError(where, f"registry_name {seen!r} is not a step this runtime implements "
                               f"(supported: {', '.join(SUPPORTED_STEPS)})",
                               "the pipeline must be rebuilt with supported steps")
            where = f"{where} ({name})"
            step_config = entry.get("config") or {}
            if not isinstance(step_config, dict):
                raise DsaError(where, f"config is a {type(step_config).__name__}, not an object")
            stats: Dict[str, Dict[str, np.ndarray]] = {}
            state_file = entry.get("state_file")
            if state_file is not None:
                state_path = pipeline_member(json_path.parent, state_file, where, "state file",
                                             MAX_STATE_FILE_BYTES)
                files.append(state_path)
                stats = nest_stats(read_safetensors(state_path))
                features = step_config.get("features")
                shapes = {k: v["shape"] for k, v in (features if isinstance(features, dict) else {}).items()
                          if isinstance(v, dict) and isinstance(v.get("shape"), list)
                          and all(isinstance(d, int) and 0 < d <= 1 << 20 for d in v["shape"])}
                check_statistics(stats, f"{state_path} ({where})", shapes)
            if name == "tokenizer_processor":
                step = _Tokenize(where, step_config, tokenizer_file, lazy=lazy_tokenizer)
            else:
                step = _STEPS[name](where, step_config, stats, tokenizer_file)
            files.extend(getattr(step, "files", []))
            steps.append(step)
        return cls(json_path, str(config.get("name", json_path.stem)), steps, config["steps"], files)

    def __call__(self, data: Dict[str, Any], timings: Optional[Dict[str, float]] = None,
                 prefix: str = "") -> Dict[str, Any]:
        """Runs the steps in order on a flat dict (see the module docstring for which keys are kept). With
        `timings`, each step's seconds are added under `<prefix>[<i>] <registry_name>` (the pipeline node's
        name in policy_pipeline.json)."""
        observation = {k: v for k, v in data.items() if k.startswith(OBS_PREFIX)}
        complementary = {k: v for k, v in data.items() if k in _COMPLEMENTARY or "_is_pad" in k}
        action = data.get(ACTION)
        if action is not None:
            action = np.asarray(action)
        t: Transition = {"observation": observation or None, "action": action, "complementary": complementary}
        for i, step in enumerate(self.steps):
            if timings is None:
                t = step(t)
                continue
            start = time.perf_counter()
            t = step(t)
            name = f"{prefix}[{i}] {self._entries[i].get('registry_name')}"
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
        out: Dict[str, Any] = {}
        if t["action"] is not None:
            out[ACTION] = t["action"]
        out.update(t["complementary"])
        out.update(t["observation"] or {})
        return out

    def describe(self) -> List[Dict[str, Any]]:
        """One JSON-able dict per step: what runs it, which keys it reads and writes, its saved config."""
        return [{"step": i, "registry_name": entry["registry_name"], "implementation": step.implementation,
                 "reads": list(step.reads), "writes": list(step.writes), "config": entry.get("config") or {},
                 "state_file": entry.get("state_file")}
                for i, (step, entry) in enumerate(zip(self.steps, self._entries))]

    def files(self) -> List[Path]:
        """The state files and tokenizer files this pipeline read."""
        return list(self._files)

    def uncovered_features(self) -> List[Tuple[str, str, str]]:
        """(node, feature, mode) for each feature a (un)normaliser step would pass through un-normalised for
        want of statistics (`_Normalize.uncovered`)."""
        return [(f"{self.json_path.name} step {i} ({self._entries[i].get('registry_name')})", key, mode)
                for i, step in enumerate(self.steps) if isinstance(step, _Normalize)
                for key, mode in step.uncovered()]


# -- ACT's temporal ensembling ----------------------------------------------------------------------------------

class TemporalEnsembler:
    """LeRobot's ACTTemporalEnsembler in numpy: an online exponentially weighted average of the actions that
    successive chunks predicted for the same time step (w_i = exp(-coeff * i), w_0 the oldest).

    The weights are float32 exp(-coeff * i) (exp evaluated in float64 and rounded; torch's float32 exp may
    differ from that by one ulp for some i), their running sums accumulate in float64 as torch's CPU cumsum does;
    the update is LeRobot's float32 arithmetic step by step."""

    def __init__(self, temporal_ensemble_coeff: float, chunk_size: int):
        self.chunk_size = int(chunk_size)
        arg = np.float32(-temporal_ensemble_coeff) * np.arange(self.chunk_size, dtype=np.float32)
        self.ensemble_weights = np.exp(arg.astype(np.float64)).astype(np.float32)
        self.ensemble_weights_cumsum = np.cumsum(self.ensemble_weights.astype(np.float64)).astype(np.float32)
        self.reset()

    def reset(self) -> None:
        """Forgets the running averages (call at the start of every episode)."""
        self.ensembled_actions: Optional[np.ndarray] = None
        self.ensembled_actions_count: Optional[np.ndarray] = None

    def update(self, actions: np.ndarray) -> np.ndarray:
        """Takes a [batch, chunk_size, action dim] chunk, folds it into the running averages and returns the
        next time step's action, [batch, action dim]."""
        actions = np.asarray(actions)
        if actions.ndim != 3 or actions.shape[1] != self.chunk_size:
            raise DsaError("TemporalEnsembler.update", f"takes [batch, {self.chunk_size}, action dim] actions, "
                           f"got shape {list(actions.shape)}")
        if self.ensembled_actions is None:
            self.ensembled_actions = actions.copy()
            self.ensembled_actions_count = np.ones((self.chunk_size, 1), dtype=np.int64)
        else:
            count = self.ensembled_actions_count
            ens = self.ensembled_actions * self.ensemble_weights_cumsum[count - 1]
            ens = ens + actions[:, :-1] * self.ensemble_weights[count]
            ens = ens / self.ensemble_weights_cumsum[count]
            count = np.minimum(count + 1, self.chunk_size)
            self.ensembled_actions = np.concatenate([ens.astype(self.ensembled_actions.dtype, copy=False),
                                                     actions[:, -1:]], axis=1)
            self.ensembled_actions_count = np.concatenate([count, np.ones_like(count[-1:])])
        action = self.ensembled_actions[:, 0]
        self.ensembled_actions = self.ensembled_actions[:, 1:]
        self.ensembled_actions_count = self.ensembled_actions_count[1:]
        return action
