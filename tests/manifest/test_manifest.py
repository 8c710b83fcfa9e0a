"""Tests of dsa.manifest.contract: the reference manifest, projections, and a corpus of malformed manifests.

corpus/*.yaml are manifests/pi0.yaml with one defect each; corpus/expected.json maps each file to the exact
line the CLI must print on stderr.
"""

import copy
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

import dsa.manifest.contract
from dsa.manifest.contract import (
    MAX_MANIFEST_BYTES,
    SCHEMA,
    ManifestError,
    dump_json,
    explain,
    load_manifest,
    project,
)

CORPUS = Path(__file__).parent / "corpus"
EXPECTED = json.loads((CORPUS / "expected.json").read_text(encoding="utf-8"))
# The directory that contains the dsa package, for CLI subprocesses.
PACKAGE_ROOT = Path(dsa.manifest.contract.__file__).parents[2]
MIN_BUCKET = {"prompt_len": 2}


def _reference_manifest() -> Path:
    """manifests/pi0.yaml, from Bazel runfiles when run under `bazel test`, else from the source tree."""
    if "TEST_SRCDIR" in os.environ and "TEST_WORKSPACE" in os.environ:
        return Path(os.environ["TEST_SRCDIR"]) / os.environ["TEST_WORKSPACE"] / "manifests/pi0.yaml"
    return Path(__file__).resolve().parents[2] / "manifests/pi0.yaml"


PI0 = _reference_manifest()


def _pi0_targets():
    import yaml

    return set(yaml.safe_load(PI0.read_text(encoding="utf-8"))["targets"])


# The targets manifests/pi0.yaml lists (π0 deploys to every rule set target but one; docs/targets.md) are the
# known ones for the reference manifest; the corpus is checked against x86_64-v3 alone (`targets_dir`), and
# target_unknown.yaml proves the check refuses a name it does not know.
KNOWN_TARGETS = _pi0_targets() | {"x86_64-v3"}


@pytest.fixture(scope="module")
def pi0():
    return load_manifest(PI0, known_targets=KNOWN_TARGETS, min_bucket=MIN_BUCKET)


@pytest.fixture(scope="module")
def targets_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("targets")
    (directory / "x86_64-v3.json").write_text("{}\n")
    return directory


# Each CLI case runs under a time and an address-space limit: a manifest that makes the loader hang or
# allocate fails its case instead of the machine.
CLI_TIME_LIMIT_S = 60
CLI_MEMORY_LIMIT_BYTES = 2 << 30


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (CLI_MEMORY_LIMIT_BYTES, CLI_MEMORY_LIMIT_BYTES))


def run_cli(*args, cwd=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT)] + [p for p in sys.path if p])
    return subprocess.run(
        [sys.executable, "-m", "dsa.manifest.contract", *map(str, args)], capture_output=True, text=True, cwd=cwd,
        env=env, timeout=CLI_TIME_LIMIT_S, preexec_fn=_limit_memory,
    )


def all_views(manifest):
    """Every projection a build makes of `manifest`: view key → view."""
    views = {name: project(manifest, name) for name in ("export", "params", "runtime")}
    for target in manifest["targets"]:
        views[f"compile:{target}"] = project(manifest, "compile", target=target)
    for dim, sizes in manifest["buckets"].items():
        for slot in range(len(sizes)):
            views[f"bucket:{dim}:{slot}"] = project(manifest, "bucket", bucket=(dim, slot))
    return views


def changed_views(before, after):
    a, b = all_views(before), all_views(after)
    return {key for key in a.keys() | b.keys() if a.get(key) != b.get(key)}


# --- schema and reference manifest -----------------------------------------------------------------------


def test_schema_is_valid_draft_2020_12():
    Draft202012Validator.check_schema(SCHEMA)


def test_every_property_is_described():
    def walk(schema, where):
        for name, sub in schema.get("properties", {}).items():
            assert sub.get("description"), f"{where}.{name} has no description"
            walk(sub, f"{where}.{name}")
        for key in ("items", "additionalProperties", "propertyNames"):
            if isinstance(schema.get(key), dict):
                assert schema[key].get("description"), f"{where} {key} has no description"
                walk(schema[key], f"{where}[{key}]")

    walk(SCHEMA, "manifest")


def test_reference_manifest_loads(pi0):
    assert pi0["model_id"] == "pi0"
    assert pi0["buckets"] == {"prompt_len": [32, 64, 128]}
    assert [c["name"] for c in pi0["inputs"]["cameras"]] == ["base_rgb", "wrist_rgb"]


def test_reference_manifest_cli(tmp_path):
    for name in KNOWN_TARGETS:
        (tmp_path / f"{name}.json").write_text("{}\n")
    result = run_cli("validate", PI0, "--known-targets-dir", tmp_path, "--min-bucket", "prompt_len=2")
    assert result.returncode == 0, result.stderr


def test_extension_fields_are_ignored(tmp_path, pi0):
    text = PI0.read_text(encoding="utf-8")
    text = text.replace("model_id: pi0\n", "model_id: pi0\nx-owner: robotics\n")
    text = text.replace("  kind: none\n", "  kind: none\n  x-note: {anything: [1, 2]}\n")
    text = text.replace("  prompt_len: [32, 64, 128]\n", "  prompt_len: [32, 64, 128]\n  x-planned: [256]\n")
    path = tmp_path / "ext.yaml"
    path.write_text(text, encoding="utf-8")
    assert load_manifest(path) == pi0


def test_newer_minor_version_without_new_fields_loads(tmp_path, pi0):
    path = tmp_path / "minor.yaml"
    path.write_text(PI0.read_text(encoding="utf-8").replace('"1.3.0"', '"1.4.2"'), encoding="utf-8")
    assert 'schema_version: "1.4.2"' in path.read_text(encoding="utf-8")
    assert load_manifest(path)["model_id"] == pi0["model_id"]


def test_python_tag_is_never_executed(tmp_path):
    marker = tmp_path / "executed"
    path = tmp_path / "evil.yaml"
    path.write_text(
        PI0.read_text(encoding="utf-8") + f'x-evil: !!python/object/apply:os.system ["touch {marker}"]\n',
        encoding="utf-8",
    )
    with pytest.raises(ManifestError, match="python/object/apply:os.system' is not allowed"):
        load_manifest(path)
    assert not marker.exists()


# --- projections -------------------------------------------------------------------------------------------


def test_views(pi0):
    assert project(pi0, "export") == {
        "schema_major": 1,
        "model_id": "pi0",
        "framework": "pytorch",
        "model": pi0["model"],
        "inputs": pi0["inputs"],
        "outputs": pi0["outputs"],
        "chunk_size": 16,
        "bucket_dims": ["prompt_len"],
        "quant_scheme": {"kind": "none"},
    }
    assert project(pi0, "params") == {
        "model_id": "pi0",
        "checkpoint": pi0["checkpoint"],
        "quant_scheme": {"kind": "none"},
    }
    assert project(pi0, "compile", target="x86_64-v3") == {
        "model_id": "pi0",
        "quant_scheme": {"kind": "none"},
        "target": "x86_64-v3",
        "tuning": "flow_vla",
    }
    # A manifest without `tuning` keeps the compile view it had before the field existed (same bytes).
    untuned = {k: v for k, v in pi0.items() if k != "tuning"}
    assert "tuning" not in project(untuned, "compile", target="x86_64-v3")
    assert project(pi0, "bucket", bucket=("prompt_len", 1)) == {
        "dim": "prompt_len",
        "slot": 1,
        "size": 64,
        "count": 3,
    }
    runtime = project(pi0, "runtime")
    assert runtime["power_profile"] == "balanced"
    assert runtime["normalization"] == {"stats": "pi0_norm_stats.json"}


def test_power_profile_changes_only_runtime(pi0):
    changed = copy.deepcopy(pi0)
    changed["power_profile"] = "efficiency"
    assert changed_views(pi0, changed) == {"runtime"}


def test_bucket_size_changes_only_its_slot(pi0):
    changed = copy.deepcopy(pi0)
    changed["buckets"]["prompt_len"][1] = 96
    # The runtime view carries the bucket table, so it changes too; the export and other slots do not.
    assert changed_views(pi0, changed) == {"bucket:prompt_len:1", "runtime"}


def test_sha256_changes_only_params(pi0):
    changed = copy.deepcopy(pi0)
    changed["checkpoint"]["sha256"] = "f" * 64
    assert changed_views(pi0, changed) == {"params"}


def _mutations():
    """Top-level field → a change to it (views are not validated, so any change will do)."""

    def set_(field, value):
        def mutate(m):
            m[field] = value

        return mutate

    def update(field, key, value):
        def mutate(m):
            m[field][key] = value

        return mutate

    return {
        "schema_version": set_("schema_version", "2.0.0"),
        "model_id": set_("model_id", "pi1"),
        "framework": set_("framework", "onnx"),  # the compile view reads it for the file front ends
        "model": update("model", "entry_point", "models.other:export_spec"),
        "checkpoint": update("checkpoint", "path", "other.safetensors"),
        "inputs": update("inputs", "state", {"dim": 7}),
        "outputs": update("outputs", "action", {"dim": 7}),
        "chunk_size": set_("chunk_size", 32),
        "n_action_steps": set_("n_action_steps", 4),
        "flow_steps": set_("flow_steps", 20),
        "buckets": update("buckets", "image_len", [8]),
        "quant_scheme": set_("quant_scheme", {"kind": "int8"}),
        "targets": set_("targets", ["x86_64-v3", "arm64"]),
        "tuning": set_("tuning", "other_family"),
        "power_profile": set_("power_profile", "performance"),
        "normalization": set_("normalization", {"stats": "other.json"}),
    }


def test_explain_matches_projections(pi0):
    mutations = _mutations()
    explained = explain(pi0)
    assert [field for field, _ in explained] == list(mutations)
    for field, views in explained:
        changed = copy.deepcopy(pi0)
        mutations[field](changed)
        assert {key.split(":")[0] for key in changed_views(pi0, changed)} == set(views), field


def test_compile_view_refuses_unlisted_target(pi0):
    with pytest.raises(ManifestError) as err:
        project(pi0, "compile", target="arm64")
    assert err.value.field == "targets"
    assert f"target 'arm64' is not one of the manifest's targets ({', '.join(pi0['targets'])})" in str(err.value)


def test_bucket_view_refuses_missing_slot(pi0):
    with pytest.raises(ManifestError) as err:
        project(pi0, "bucket", bucket=("prompt_len", 3))
    assert str(err.value) == (
        "buckets.prompt_len: no bucket slot 3: the manifest lists 3 buckets for prompt_len "
        "(use a slot from 0 to 2)"
    )
    with pytest.raises(ManifestError, match="no buckets for dim 'image_len'; bucketed dims: prompt_len"):
        project(pi0, "bucket", bucket=("image_len", 0))


@pytest.mark.parametrize(
    "view, kwargs",
    [("nope", {}), ("compile", {}), ("export", {"target": "x86_64-v3"}), ("bucket", {}),
     ("runtime", {"bucket": ("prompt_len", 0)})],
)
def test_project_misuse_is_a_value_error(pi0, view, kwargs):
    with pytest.raises(ValueError):
        project(pi0, view, **kwargs)


def test_dump_json_is_canonical_and_atomic(tmp_path):
    out = tmp_path / "view.json"
    dump_json({"b": [1, 2], "a": "π"}, out)
    assert out.read_text(encoding="utf-8") == '{\n  "a": "π",\n  "b": [\n    1,\n    2\n  ]\n}\n'
    with pytest.raises(ValueError):
        dump_json({"nan": float("nan")}, out)
    assert out.read_text(encoding="utf-8").startswith('{\n  "a"')  # the old content survives a failed write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.json"]  # no temporary files left behind


# --- command line ------------------------------------------------------------------------------------------


def test_cli_project_writes_the_view(tmp_path, pi0):
    out = tmp_path / "bucket.json"
    result = run_cli("project", PI0, "--view", "bucket", "--bucket", "prompt_len:2", "--out", out)
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text(encoding="utf-8")) == project(pi0, "bucket", bucket=("prompt_len", 2))


def test_cli_project_error_leaves_no_output(tmp_path):
    out = tmp_path / "compile.json"
    out.write_text("stale\n")
    result = run_cli("project", PI0, "--view", "compile", "--target", "arm64", "--out", out)
    assert result.returncode == 2
    listed = ", ".join(load_manifest(PI0)["targets"])
    assert result.stderr == (
        f"{PI0}: targets: target 'arm64' is not one of the manifest's targets ({listed}) "
        "(add it to targets, or compile for a listed one)\n"
    )
    assert not out.exists()


def test_cli_explain():
    result = run_cli("explain", PI0)
    assert result.returncode == 0, result.stderr
    assert "power_profile: runtime\n" in result.stdout
    assert "buckets: export, bucket, runtime\n" in result.stdout


def test_corpus_is_complete():
    assert len(EXPECTED) >= 30
    assert sorted(EXPECTED) == sorted(p.name for p in CORPUS.glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus(name, targets_dir):
    result = run_cli(
        "validate", name, "--known-targets-dir", targets_dir, "--min-bucket", "prompt_len=2", cwd=CORPUS
    )
    assert "Traceback" not in result.stderr
    assert result.returncode == 2
    assert result.stderr == EXPECTED[name] + "\n"


def test_a_manifest_over_the_size_cap_is_refused_by_its_size_before_parsing(tmp_path):
    big = tmp_path / "big.yaml"
    text = PI0.read_text()
    big.write_text(text + "# padding\n" * ((MAX_MANIFEST_BYTES // 10) + 1))
    result = run_cli("validate", big)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"a manifest is at most {MAX_MANIFEST_BYTES} bytes" in result.stderr


def test_a_fifo_or_device_manifest_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "manifest.yaml"
    os.mkfifo(fifo)  # reading it would block until a writer comes
    for path in (fifo, Path("/dev/zero")):
        result = subprocess.run([sys.executable, "-m", "dsa.manifest.contract", "validate", str(path)],
                                capture_output=True, text=True, timeout=60,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE_ROOT)] + sys.path)))
        assert result.returncode == 2 and "not a regular file" in result.stderr, result.stderr


def test_a_model_config_over_its_size_limit_is_refused_naming_it(tmp_path):
    """model.config is hyper-parameters (MAX_MODEL_CONFIG_BYTES): a 100 KB list in it is refused by `validate`,
    naming the field and the limit, though the manifest is within its own size cap."""
    from dsa.manifest.contract import MAX_MODEL_CONFIG_BYTES

    big = tmp_path / "big_config.yaml"
    big.write_text(PI0.read_text().replace("    expert_depth: 3\n", "    expert_depth: 3\n    table: ["
                                           + ", ".join(["12345"] * 20_000) + "]\n", 1))
    assert big.stat().st_size < MAX_MANIFEST_BYTES
    result = run_cli("validate", big)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"model.config: is {len(json.dumps(_config_of(big)))} bytes as JSON, over the " \
           f"{MAX_MODEL_CONFIG_BYTES}-byte limit" in result.stderr, result.stderr


def _config_of(path):
    import yaml

    return yaml.safe_load(path.read_text())["model"]["config"]


def test_a_1x_manifest_naming_a_renamed_entry_point_validates_and_says_the_new_name(tmp_path):
    old = tmp_path / "act_1_2.yaml"
    text = (PI0.parent / "act.yaml").read_text()
    assert "entry_point: dsa.frontends.lerobot:export_spec" in text
    old.write_text(text.replace("entry_point: dsa.frontends.lerobot:export_spec", "entry_point: dsa.lerobot:export_spec"))
    result = run_cli("validate", old)
    assert result.returncode == 0 and result.stdout == f"{old}: ok\n", result
    assert "model.entry_point 'dsa.lerobot:export_spec' is now named 'dsa.frontends.lerobot:export_spec'" in result.stderr
