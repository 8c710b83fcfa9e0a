"""Stand-in processor files for a LeRobot policy directory: LeRobot's own pre- and post-processor pipelines
(`make_pre_post_processors`, as `lerobot-train` saves them beside a trained policy) with seeded dataset
statistics, written by LeRobot's own `save_pretrained`.

    python -m dsa.frontends.lerobot_processors processors --policy-dir act_policy --seed 0 --out-dir act_processors
    python -m dsa.frontends.lerobot_processors tokenizer --out-dir vla_tokenizer

writes `policy_preprocessor.json`, `policy_postprocessor.json` and their statistics
(`policy_*processor_step_<i>_*.safetensors`), byte-identical on every run and in any directory. The statistics
are those a dataset's `meta/stats.json` holds (mean, std, min, max and the 1/10/90/99 % quantiles per feature;
images per channel, shape (C, 1, 1)), drawn from `seed`: trained policies' statistics cannot be downloaded
here. A real policy directory already holds these files; rules_dsa reads them as they are
(dsa.runtime.processors).

The policies whose preprocessor tokenises the task (SmolVLA, PI0, PI0.5) take `--tokenizer DIR`: a tokenizer
directory as `transformers` saves one (tokenizer.json + tokenizer_config.json), which LeRobot's
TokenizerProcessorStep loads by name; the saved pipeline names it by `tokenizer_name` only, so the bundle
pins and ships the tokenizer.json itself (the manifest's processors.tokenizer). `tokenizer` writes a stand-in:
a BPE tokenizer trained here with the `tokenizers` library on a fixed corpus of robot task texts (a BOS token
first, `<pad>` id 0, at most TOKENIZER_VOCAB ids: below every stand-in VLA's vocabulary), saved by
transformers' PreTrainedTokenizerFast as a Hub tokenizer directory is — SmolVLM's and PaliGemma's tokenizers
cannot be downloaded here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Optional

from dsa.core.determinism import pin_math_libraries
from dsa.core.errors import DsaError, run_cli
from dsa.core.lerobot_types import LEROBOT_TYPES

TOKENIZER_VOCAB = 512
TOKENIZER_FILES = ("special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")
# What the stand-in tokenizer is trained on: task texts as LeRobot datasets phrase them, and the prompt PI0.5's
# preprocessor writes (the task, the binned state as integers, "Action:").
_CORPUS = [
    "pick up the red cube and place it in the bin", "open the top drawer", "close the drawer",
    "fold the towel in half", "push the block to the goal", "insert the peg into the hole",
    "stack the green cube on the blue cube", "put the cup on the plate", "pour water into the glass",
    "hang the mug on the rack", "wipe the table with the sponge", "sort the screws into the tray",
    "transfer the cube to the other arm", "grasp the handle and pull", "turn the knob to the left",
] + ["Task: %s, State: %s;\nAction: " % (t, " ".join(str((7 * i + 3 * j) % 256) for j in range(8)))
     for i, t in enumerate(["pick up the cube", "open the drawer", "fold the towel"])]

POSTPROCESSOR_JSON = "policy_postprocessor.json"


def seeded_stats(cfg, seed: int) -> Dict[str, Dict[str, "object"]]:
    """Dataset statistics for every input and output feature of `cfg`, drawn from `seed` (float32 tensors):
    VISUAL features per channel (C, 1, 1) in [0, 1]; STATE / ENV / ACTION per dimension."""
    import torch

    g = torch.Generator().manual_seed(seed)
    features = {**cfg.input_features, **cfg.output_features}
    stats: Dict[str, Dict[str, object]] = {}
    for name in sorted(features):
        feature = features[name]
        kind = getattr(feature.type, "value", str(feature.type))
        if kind == "VISUAL":
            shape = (feature.shape[0], 1, 1)
            mean = 0.3 + 0.3 * torch.rand(shape, generator=g)
            std = 0.15 + 0.15 * torch.rand(shape, generator=g)
            low, high = torch.zeros(shape), torch.ones(shape)
        else:
            shape = tuple(feature.shape)
            mean = 0.5 * torch.randn(shape, generator=g)
            std = 0.5 + 1.5 * torch.rand(shape, generator=g)
            low, high = mean - 2.5 * std, mean + 2.5 * std
        stats[name] = {
            "mean": mean, "std": std, "min": low, "max": high,
            "q01": mean - 2.33 * std, "q10": mean - 1.28 * std, "q90": mean + 1.28 * std, "q99": mean + 2.33 * std,
        }
    return stats


def write_processors(policy_dir: Path, seed: int, out_dir: Path, tokenizer: Optional[Path] = None) -> None:
    """LeRobot's processor pipelines for the policy in `policy_dir` (its config.json), with seeded statistics,
    saved into `out_dir` by LeRobot's `save_pretrained`."""
    from dsa.frontends.lerobot import make_config, policy_module

    policy_dir, out_dir = Path(policy_dir), Path(out_dir)
    where = str(policy_dir / "config.json")
    try:
        config = json.loads((policy_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DsaError(where, f"cannot read the policy's config: {e}") from None
    policy_type = config.pop("type", None)
    policy_module(policy_type, f"{where}: type")
    config.pop("device", None)
    cfg = make_config(policy_type, config, where)
    stats = seeded_stats(cfg, seed)

    from lerobot.policies.factory import make_pre_post_processors

    tokenises = LEROBOT_TYPES[policy_type].tokenises
    if tokenises and tokenizer is None:
        raise DsaError("--tokenizer", f"a {policy_type} preprocessor tokenises the task: it needs a tokenizer "
                       "directory", "pass --tokenizer DIR (tokenizer.json + tokenizer_config.json)")
    try:
        if tokenises:
            pre, post = _with_tokenizer(cfg, stats, Path(tokenizer))
        else:
            pre, post = make_pre_post_processors(cfg, dataset_stats=stats)
    except DsaError:
        raise
    except Exception as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DsaError(where, f"LeRobot cannot make the {policy_type} processors: {type(e).__name__}: {text}") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".processors-", dir=out_dir))
    try:
        pre.save_pretrained(tmp)
        post.save_pretrained(tmp)
        for path in sorted(tmp.iterdir()):
            os.chmod(path, 0o644)
            os.replace(path, out_dir / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _with_tokenizer(cfg, stats, tokenizer_dir: Path):
    """The factory's pipelines, its tokenizer loaded from `tokenizer_dir` instead of the Hub name it names
    (LeRobot's TokenizerProcessorStep loads `tokenizer_name` with AutoTokenizer)."""
    import lerobot.processor.tokenizer_processor as tokenizer_processor
    from lerobot.policies.factory import make_pre_post_processors

    auto = tokenizer_processor.AutoTokenizer
    original = auto.from_pretrained

    def from_local(name, *args, **kwargs):
        return original(str(tokenizer_dir), *args, **kwargs)

    auto.from_pretrained = from_local
    try:
        return make_pre_post_processors(cfg, dataset_stats=stats)
    finally:
        auto.from_pretrained = original



def write_tokenizer(out_dir: Path) -> None:
    """The stand-in tokenizer directory (TOKENIZER_FILES), the same bytes on every run."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<pad>", "<unk>", "<bos>", "<eos>"],
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=out_dir))
    try:
        fast.save_pretrained(tmp)
        written = sorted(p.name for p in tmp.iterdir())
        if written != sorted(TOKENIZER_FILES):
            raise DsaError("PreTrainedTokenizerFast.save_pretrained", f"wrote {written}, expected "
                           f"{sorted(TOKENIZER_FILES)}", "update dsa/frontends/lerobot_processors.py")
        for name in written:
            os.chmod(tmp / name, 0o644)
            os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> None:
    pin_math_libraries()  # before any computation: dsa.core.determinism
    parser = argparse.ArgumentParser(prog="dsa-lerobot-processors", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    procs = sub.add_parser("processors", help="LeRobot's processor pipelines of a policy, seeded statistics")
    procs.add_argument("--policy-dir", required=True, help="the policy directory (its config.json)")
    procs.add_argument("--seed", type=int, default=0)
    procs.add_argument("--tokenizer", help="tokenizer directory (SmolVLA, PI0, PI0.5)")
    procs.add_argument("--out-dir", required=True)
    tok = sub.add_parser("tokenizer", help="the stand-in tokenizer directory")
    tok.add_argument("--out-dir", required=True)
    a = parser.parse_args(argv)
    if a.command == "tokenizer":
        write_tokenizer(Path(a.out_dir))
        return
    write_processors(Path(a.policy_dir), a.seed, Path(a.out_dir), Path(a.tokenizer) if a.tokenizer else None)


if __name__ == "__main__":
    run_cli(main, "dsa-lerobot-processors")
