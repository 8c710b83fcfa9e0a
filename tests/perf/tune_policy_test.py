"""The tuner on a LeRobot policy as built (//models:pi05, LeRobot's PI0.5 at the repository's small size), in
the LeRobot environment: every candidate is compiled from the policy's own MLIR, checked against eager LeRobot
and timed with it; one that does not compile (a 1-byte stack limit) is disqualified with the compiler's message; the winner is written
with its evidence. No timing is asserted: only what was measured and written."""

import json

from dsa.tools import tune
from dsa.core.fileio import read_json
from dsa.tools.testing import runfile

CANDIDATES = {
    "format": 1,
    "candidates": [{"name": "baseline", "flags": []}],
    "families": {"lerobot": [
        {"name": "baseline", "flags": []},
        {"name": "O3", "flags": ["--iree-opt-level=O3"]},
        {"name": "tiny-stack", "flags": ["--iree-llvmcpu-stack-allocation-limit=1"]},
        {"name": "v4-only", "flags": ["--iree-opt-level=O2"], "targets": ["x86_64-v4"]},
    ]},
}


def _checkout(tmp_path):
    """A checkout whose policies index lists pi05 as built (its runfiles) and whose candidates are the above."""
    root = tmp_path / "checkout"
    (root / "models").mkdir(parents=True)
    (root / "toolchains" / "tuning").mkdir(parents=True)
    (root / "toolchains" / "targets").symlink_to(runfile("toolchains/targets"))
    (root / "toolchains" / "tuning" / "candidates.json").write_text(json.dumps(CANDIDATES))
    (root / "models" / "policies_index.json").write_text(json.dumps({"format": 1, "pipelines": [], "policies": [
        {"name": "pi05", "label": "//models:pi05", "index": str(runfile("models/pi05.modules.json")),
         "manifest": "manifests/pi05.yaml", "checkpoint": str(runfile("models/pi05_policy/model.safetensors")),
         "policy_config": str(runfile("models/pi05_policy/config.json")), "model_file": None, "python": None,
         "test": ""}]}))
    return root


def test_a_lerobot_policy_is_tuned_from_its_own_mlir_against_eager_lerobot(tmp_path):
    root = _checkout(tmp_path)
    evidence = tune.tune(["pi05"], root=root, target_name="x86_64-v3", runs=3, warmup=1, threads=2,
                         work=tmp_path / "work", write_root=root)
    by_name = {c["name"]: c for c in evidence["candidates"]}
    # The v4-only candidate is not tried for x86-64-v3.
    assert list(by_name) == ["baseline", "O3", "tiny-stack"]
    for name in ("baseline", "O3"):
        result = by_name[name]["models"]["pi05"]
        [case] = result["cases"].values()
        assert result["qualified"] and case["parity"]["ok"], (name, case["parity"])
        assert result["vs_eager"] > 0 and result["vmfb_bytes"] > 0
    broken = by_name["tiny-stack"]
    assert not broken["qualified"] and "pi05: does not compile" in broken["reason"]
    assert "candidate tiny-stack: iree-compile failed" in broken["reason"]
    assert evidence["eager_lerobot"]["pi05"]["median_ms"] > 0 and "steps=" in evidence["eager_lerobot"]["pi05"]["case"]
    written = read_json(root / "toolchains" / "tuning" / "lerobot.x86_64-v3.json")
    assert evidence["winner"] in ("baseline", "O3") and written["flags"] == by_name[evidence["winner"]]["flags"]
    assert "against eager LeRobot" in written["chosen"] and "pi05" in written["chosen"]
    assert read_json(root / "toolchains" / "tuning" / "lerobot.x86_64-v3.evidence.json") == evidence
