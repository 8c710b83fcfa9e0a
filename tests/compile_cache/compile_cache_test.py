"""dsa compile's cache (dsa.tools.compile_cache): a second run takes every finished stage from the cache and
gives the same bytes; a changed target, tuning file or checkpoint reruns only the stages that read it; a
corrupt entry is refused by name and rebuilt; a failed compile keeps the export and the archive; --no-cache
and DSA_COMPILE_CACHE=off run everything; a deleted cache is rebuilt.

One tiny bucketed policy (tiny_policy.py: two bucket exports, one compile per bucket) is built once into a
warm cache; each test works on its own copy of that cache. Which stages ran is seen twice: the stage runner
(what started a stage's process) and the stage report (stderr, timings.json)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from dsa.core.errors import DsaError
from dsa.core.fileio import read_json, sha256_file
from dsa.tools import compile_cache, pipeline
from dsa.tools.compile_cache import CompileCache, cache_from_environment
from dsa.tools.stage_process import StageRunner
from dsa.tools.testing import runfile

HERE = Path(__file__).resolve().parent
TARGETS = runfile("toolchains/targets")
REQUIREMENTS_LOCK = runfile("requirements_lock.txt")
EXPORTS = ["export", "export prompt_len_0", "export prompt_len_1"]
COMPILES_V3 = ["compile prompt_len_0 x86_64-v3", "compile prompt_len_1 x86_64-v3"]
COMPILES_V4 = ["compile prompt_len_0 x86_64-v4", "compile prompt_len_1 x86_64-v4"]
EVERY_STAGE = ["checkpoint", "export", "params", "export prompt_len_0", "export prompt_len_1", *COMPILES_V3]


def _manifest_data(pin: str) -> dict:
    return {
        "schema_version": "1.3.0",
        "model_id": "tiny",
        "framework": "pytorch",
        "model": {"entry_point": "tiny_policy:export_spec", "config": {"width": 8}},
        "checkpoint": {"path": "checkpoint.safetensors", "sha256": pin},
        "inputs": {"state": {"dim": 3}, "cameras": [], "prompt": {"vocab_size": 16, "pad_id": 0}},
        "outputs": {"action": {"dim": 2}},
        "chunk_size": 1,
        "n_action_steps": 1,
        "flow_steps": 1,
        "buckets": {"prompt_len": [4, 8]},
        "quant_scheme": {"kind": "none"},
        "targets": ["x86_64-v3", "x86_64-v4"],
        "power_profile": "balanced",
    }


def _write_manifest(directory: Path, pin: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tiny.yaml"
    path.write_text(yaml.safe_dump(_manifest_data(pin)))
    return path


@pytest.fixture(scope="session", autouse=True)
def stage_code(tmp_path_factory):
    """The stage code (a part of every key and of the lock), read once: a copy taken when the session starts.
    Work going on in the same checkout while this test runs (an edit of dsa/stages/) would otherwise change
    every key and lock between two builds of one test. The stages themselves run the checkout's code."""
    import dsa
    from dsa.stages.lock import stage_source_files

    copy = tmp_path_factory.mktemp("stage_code")
    frozen = {}
    for rel, path in stage_source_files(Path(dsa.__file__).parent, "tiny_policy:export_spec").items():
        frozen[rel] = copy / rel
        frozen[rel].parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, frozen[rel])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "stage_source_files", lambda package_dir, entry_point="": dict(frozen))
        yield frozen


@pytest.fixture(scope="session")
def pins(tmp_path_factory):
    """The sha256 of the seeded checkpoints 0 and 1 (a manifest pins the one it is built with)."""
    from dsa.manifest.contract import load_manifest, project
    from dsa.stages.checkpoint import make_checkpoint

    work = tmp_path_factory.mktemp("pins")
    view = project(load_manifest(_write_manifest(work, "0" * 64)), "export")
    digests = {}
    for seed in (0, 1):
        make_checkpoint(view, work / f"{seed}.safetensors", seed=seed, pythonpath=[str(HERE)])
        digests[seed] = sha256_file(work / f"{seed}.safetensors")
    assert digests[0] != digests[1]
    return digests


class Ran:
    """The stages whose process started (pipeline's StageRunner, recorded)."""

    def __init__(self, monkeypatch):
        self.stages = []
        ran = self

        class Recording(StageRunner):
            def __call__(self, stage, fn, *args, **kwargs):
                ran.stages.append(stage)
                return super().__call__(stage, fn, *args, **kwargs)

        monkeypatch.setattr(pipeline, "StageRunner", Recording)

    def take(self):
        stages, self.stages = self.stages, []
        return stages


def build(manifest: Path, out: Path, cache, *, seed=0, targets=("x86_64-v3",), tuning=None, targets_dir=TARGETS):
    return pipeline.run_pipeline(manifest, out, targets_dir=targets_dir, seeded_checkpoint=seed,
                                 pythonpath=[str(HERE)], requirements_lock=REQUIREMENTS_LOCK,
                                 targets=list(targets), tuning=tuning or {}, cache=cache)


def artifacts(out: Path) -> dict:
    """{relative path: sha256} of every file of a build but timings.json (numbers that differ run to run)."""
    return {str(p.relative_to(out)): sha256_file(p) for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != "timings.json"}


def cached_stages(out: Path) -> dict:
    return {t["stage"]: t["cached"] for t in read_json(out / "timings.json")["stages"]}


def entry_of(cache_dir: Path, label: str) -> Path:
    """The cache entry a stage (by its label) was stored in."""
    found = [p.parent for p in cache_dir.glob("v1/entries/*/*/entry.json") if read_json(p)["label"] == label]
    assert len(found) == 1, found
    return found[0]


def flip_a_byte(path: Path, keep_mtime: bool = False) -> None:
    st = path.stat()
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    with open(path, "r+b") as f:  # in place: the same inode, as a write into a hardlinked output would be
        f.write(bytes(data))
    path.chmod(0o444)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture(scope="session")
def warm(tmp_path_factory, pins):
    """One full build into an empty cache: (the manifest, the build's output, the cache directory)."""
    work = tmp_path_factory.mktemp("warm")
    manifest = _write_manifest(work / "manifest", pins[0])
    cache = CompileCache.open(work / "cache")
    build(manifest, work / "out", cache)
    assert not any(cached_stages(work / "out").values())
    return manifest, work / "out", work / "cache"


@pytest.fixture
def cache_dir(warm, tmp_path):
    """This test's own copy of the warm cache."""
    copy = tmp_path / "cache"
    shutil.copytree(warm[2], copy)
    return copy


def test_a_second_compile_takes_every_stage_from_the_cache_with_the_same_bytes(warm, cache_dir, tmp_path,
                                                                                monkeypatch, capsys):
    manifest, first, _ = warm
    ran = Ran(monkeypatch)
    out = tmp_path / "second"
    indexes = build(manifest, out, CompileCache.open(cache_dir))
    assert ran.take() == []  # no stage's process started
    assert cached_stages(out) == {stage: True for stage in EVERY_STAGE}
    err = capsys.readouterr().err
    for stage in EVERY_STAGE:
        assert f"dsa compile: {stage}: cached (" in err
    assert f"dsa compile: 7 of 7 stages from the compile cache {cache_dir}" in err
    timings = read_json(out / "timings.json")
    assert timings["peak_stage"] is None and timings["peak_rss_kib"] == 0
    assert [i.name for i in indexes] == ["x86_64-v3.modules.json"]
    # Byte-identical: vmfbs, MLIR, records, archive, checkpoint, views, index and lock.
    assert artifacts(out) == artifacts(first)
    # Not copied: the archive is the cache entry's file (one inode), read-only.
    entry = entry_of(cache_dir, "params")
    assert os.stat(out / "params.irpa").st_ino == os.stat(entry / "params.irpa").st_ino
    assert not os.stat(out / "params.irpa").st_mode & 0o222
    assert read_json(entry / "entry.json")["files"]["params.irpa"]["sha256"] == sha256_file(out / "params.irpa")


def test_another_target_or_tuning_file_reruns_only_the_compiles(warm, cache_dir, tmp_path, monkeypatch):
    manifest, first, _ = warm
    cache = CompileCache.open(cache_dir)
    ran = Ran(monkeypatch)
    build(manifest, tmp_path / "v4", cache, targets=["x86_64-v4"])
    assert ran.take() == COMPILES_V4
    assert [s for s, cached in cached_stages(tmp_path / "v4").items() if not cached] == COMPILES_V4

    tuning = tmp_path / "tiny.x86_64-v3.json"
    tuning.write_text('{"format": 1, "family": "tiny", "target": "x86_64-v3", "flags": ["--iree-opt-data-tiling"]}')
    build(manifest, tmp_path / "tuned", cache, tuning={"x86_64-v3": tuning})
    assert ran.take() == COMPILES_V3
    report = read_json(tmp_path / "tuned" / "x86_64-v3" / "prompt_len_0.compile_report.json")
    assert "--iree-opt-data-tiling" in report["flags"]
    # The tuning file's bytes are the key, not its name: a changed file compiles again, the same one does not.
    tuning.write_text('{"format": 1, "family": "tiny", "target": "x86_64-v3", "flags": []}')
    build(manifest, tmp_path / "retuned", cache, tuning={"x86_64-v3": tuning})
    assert ran.take() == COMPILES_V3
    build(manifest, tmp_path / "again", cache, tuning={"x86_64-v3": tuning})
    assert ran.take() == []
    assert artifacts(tmp_path / "again") == artifacts(tmp_path / "retuned")


def test_another_checkpoint_reruns_only_the_checkpoint_and_the_archive(warm, pins, cache_dir, tmp_path, monkeypatch):
    manifest, first, _ = warm
    # Another manifest file elsewhere (its path is no part of any key), pinning seed 1's checkpoint: the
    # params view changes, the export, bucket and compile views do not.
    other = _write_manifest(tmp_path / "elsewhere", pins[1])
    ran = Ran(monkeypatch)
    out = tmp_path / "seed1"
    build(other, out, CompileCache.open(cache_dir), seed=1)
    assert ran.take() == ["checkpoint", "params"]
    ours, theirs = artifacts(out), artifacts(first)
    changed = sorted(name for name in ours if ours[name] != theirs[name])
    assert changed == ["checkpoint.safetensors", "params.irpa", "views/params_view.json", "x86_64-v3.lock.json"]


def test_each_key_is_the_inputs_of_the_stages_action_and_nothing_else(warm, stage_code):
    """What each entry was keyed by (its entry.json records it; the key is its sha256): the digests of the
    files the stage's Bazel action reads, the stage code and the environment's identity; no path, no time."""
    manifest, first, cache_dir = warm
    expected = {
        "checkpoint": {"export_view", "seed", "model_sources"},
        "export": {"export_view", "model_sources", "policy_config", "model_file", "bucket_view", "reference_record"},
        "params": {"params_view", "checkpoint", "shards", "export_record"},
        "compile": {"mlir", "compile_view", "target_spec", "tuning"},
    }
    environment = pipeline.identity(str(REQUIREMENTS_LOCK))
    entries = [read_json(p) for p in cache_dir.glob("v1/entries/*/*/entry.json")]
    assert sorted(e["label"] for e in entries) == sorted(EVERY_STAGE)
    for entry in entries:
        inputs = entry["inputs"]
        assert set(inputs) == expected[entry["stage"]] | {"stage_code", "identity"}
        assert entry["key"] == CompileCache.key(entry["stage"], inputs)
        assert inputs["stage_code"] == {rel: sha256_file(path) for rel, path in stage_code.items()}
        assert inputs["identity"] == environment
        assert str(first.parent) not in json.dumps(inputs) and "/" not in json.dumps(inputs["identity"])
    params = next(e["inputs"] for e in entries if e["stage"] == "params")
    assert params["params_view"] == sha256_file(first / "views" / "params_view.json")
    assert params["checkpoint"] == sha256_file(first / "checkpoint.safetensors")
    assert params["export_record"] == sha256_file(first / "export_record.json")
    compiled = next(e["inputs"] for e in entries if e["label"] == COMPILES_V3[1])
    assert compiled["mlir"] == sha256_file(first / "buckets" / "prompt_len_1.mlir")
    assert compiled["target_spec"] == sha256_file(TARGETS / "x86_64-v3.json") and compiled["tuning"] is None


def test_edited_stage_code_reruns_every_stage(warm, stage_code, cache_dir, tmp_path, monkeypatch):
    manifest, first, _ = warm
    edited = tmp_path / "compile.py"
    edited.write_text(stage_code["dsa/stages/compile.py"].read_text() + "\n# an edit\n")
    monkeypatch.setattr(pipeline, "stage_source_files",
                        lambda package_dir, entry_point="": dict(stage_code, **{"dsa/stages/compile.py": edited}))
    ran = Ran(monkeypatch)
    build(manifest, tmp_path / "edited", CompileCache.open(cache_dir))
    assert ran.take() == EVERY_STAGE


@pytest.mark.parametrize("label, name, reruns", [
    ("export", "model.mlir", ["export"]),
    ("export prompt_len_1", "export_record.json", ["export prompt_len_1"]),
    ("params", "params.irpa", ["params"]),
    ("compile prompt_len_0 x86_64-v3", "module.vmfb", ["compile prompt_len_0 x86_64-v3"]),
])
def test_a_corrupt_entry_is_refused_by_name_discarded_and_rebuilt(warm, cache_dir, tmp_path, monkeypatch, capsys,
                                                                 label, name, reruns):
    manifest, first, _ = warm
    entry = entry_of(cache_dir, label)
    flip_a_byte(entry / name)
    ran = Ran(monkeypatch)
    out = tmp_path / "out"
    build(manifest, out, CompileCache.open(cache_dir))
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(warning) == 1
    assert warning[0].startswith(f"dsa compile: warning: compile cache entry {entry} is corrupt ({name} has sha256 ")
    assert warning[0].endswith(f"discarded, {label} runs again")
    assert ran.take() == reruns  # the stage ran again, and only it: what it rebuilt is the same bytes
    assert artifacts(out) == artifacts(first)  # the corrupt byte reached no output
    # The entry was rebuilt whole, from the stage's new output.
    rebuilt = read_json(entry / "entry.json")["files"][name]["sha256"]
    assert sha256_file(entry / name) == rebuilt


def test_a_large_file_is_stat_checked_and_confirmed_by_the_locks_digest(warm, cache_dir, tmp_path, monkeypatch,
                                                                       capsys):
    """Files of LARGE_FILE_BYTES and more (the archive at real size) are hashed again only when their stat
    changed; a corruption that keeps size, mtime and inode is still caught before --out (the lock hashes the
    archive), and the stage reruns."""
    manifest, first, _ = warm
    monkeypatch.setattr(compile_cache, "LARGE_FILE_BYTES", 1)  # every file is "large"
    cache = CompileCache.open(cache_dir)
    ran = Ran(monkeypatch)
    build(manifest, tmp_path / "fingerprinted", cache)  # hashes each file once more, records its stat
    entry = entry_of(cache_dir, "params")
    assert read_json(entry / "entry.json")["files"]["params.irpa"]["stat"][0] == (entry / "params.irpa").stat().st_size

    hashed = []
    real_sha256_file = compile_cache.sha256_file
    monkeypatch.setattr(compile_cache, "sha256_file", lambda p: hashed.append(Path(p)) or real_sha256_file(p))
    build(manifest, tmp_path / "stat-checked", cache)
    assert ran.take() == []
    assert [p for p in hashed if cache_dir in p.parents] == []  # no entry's file hashed: every stat matched

    # A write that moves the mtime: hashed again, refused, rebuilt.
    flip_a_byte(entry / "params.irpa")
    build(manifest, tmp_path / "written", cache)
    assert ran.take() == ["params"]
    assert f"compile cache entry {entry} is corrupt (params.irpa has sha256 " in capsys.readouterr().err

    # A flip that keeps size, mtime and inode: not seen by the stat, seen by the lock's digest of the archive.
    flip_a_byte(entry / "params.irpa", keep_mtime=True)
    out = tmp_path / "kept-mtime"
    hashed.clear()
    build(manifest, out, cache)
    assert entry / "params.irpa" not in hashed  # the stat matched: the cache did not hash it, the lock did
    assert ran.take() == ["params"]
    err = capsys.readouterr().err
    assert f"compile cache entry {entry} is corrupt (params.irpa has sha256 " in err
    assert artifacts(out) == artifacts(first)
    assert read_json(out / "x86_64-v3.lock.json")["artifacts"]["params.irpa"] == sha256_file(first / "params.irpa")

    # The same for a generated checkpoint: the pin check hashes it; a mismatch has the entry hashed, refused and
    # the checkpoint generated again (a good entry would have been the manifest's error, as without a cache).
    entry = entry_of(cache_dir, "checkpoint")
    flip_a_byte(entry / "checkpoint.safetensors", keep_mtime=True)
    out = tmp_path / "checkpoint-kept-mtime"
    build(manifest, out, cache)
    assert ran.take() == ["checkpoint"]
    assert f"compile cache entry {entry} is corrupt (checkpoint.safetensors has sha256 " in capsys.readouterr().err
    assert artifacts(out) == artifacts(first)


def test_a_failed_compile_keeps_export_and_params_even_in_a_deleted_cache(warm, cache_dir, tmp_path, monkeypatch):
    """The cache directory is deleted between runs (safe: it is made again); then a compile fails (a target
    spec naming a CPU that iree-compile does not know): --out is not written, but the finished stages are in
    the cache, and the next run with the good spec compiles and nothing else."""
    manifest, first, _ = warm
    cache = CompileCache.open(cache_dir)
    shutil.rmtree(cache_dir)
    ran = Ran(monkeypatch)
    bad_targets = tmp_path / "targets"
    shutil.copytree(TARGETS, bad_targets, ignore=shutil.ignore_patterns("*.bzl", "BUILD*"))
    spec = read_json(bad_targets / "x86_64-v3.json")
    spec["flags"] = [f.replace("x86-64-v3", "no-such-cpu") for f in spec["flags"]]
    (bad_targets / "x86_64-v3.json").write_text(json.dumps(spec))
    out = tmp_path / "out"
    with pytest.raises(DsaError, match="iree-compile failed"):
        build(manifest, out, cache, targets_dir=bad_targets)
    assert not out.exists()
    assert ran.take() == ["checkpoint", "export", "params", "export prompt_len_0", "export prompt_len_1",
                          "compile prompt_len_0 x86_64-v3"]
    labels = sorted(read_json(p)["label"] for p in cache_dir.glob("v1/entries/*/*/entry.json"))
    assert labels == sorted(["checkpoint", "export", "params", "export prompt_len_0", "export prompt_len_1"])

    build(manifest, out, cache)
    assert ran.take() == COMPILES_V3
    assert artifacts(out)["params.irpa"] == artifacts(first)["params.irpa"]
    assert list(cache_dir.glob("v1/tmp/*")) == []  # no half-written entry left behind


@pytest.mark.parametrize("how", ["--no-cache", "DSA_COMPILE_CACHE=off"])
def test_no_cache_runs_every_stage_and_gives_the_same_bytes(warm, cache_dir, tmp_path, monkeypatch, how):
    manifest, first, _ = warm
    monkeypatch.setenv("DSA_COMPILE_CACHE", "off" if how.endswith("off") else str(cache_dir))
    before = sorted(p.relative_to(cache_dir) for p in cache_dir.rglob("*"))
    ran = Ran(monkeypatch)
    out = tmp_path / "out"
    pipeline.main(["--manifest", str(manifest), "--out", str(out), "--seeded-checkpoint", "0",
                   "--pythonpath", str(HERE), "--targets-dir", str(TARGETS),
                   "--requirements-lock", str(REQUIREMENTS_LOCK), "--target", "x86_64-v3"]
                  + (["--no-cache"] if how == "--no-cache" else []))
    assert ran.take() == EVERY_STAGE
    assert not any(cached_stages(out).values())
    assert artifacts(out) == artifacts(first)  # with and without the cache: the same bytes
    assert sorted(p.relative_to(cache_dir) for p in cache_dir.rglob("*")) == before  # not read, not written


def test_where_the_cache_is(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_from_environment(environ={}).root == tmp_path / "home" / ".cache" / "rules_dsa" / "compile-cache"
    assert cache_from_environment(environ={"DSA_COMPILE_CACHE": str(tmp_path / "c")}).root == tmp_path / "c"
    assert cache_from_environment(environ={"DSA_COMPILE_CACHE": "off"}) is None
    assert cache_from_environment(disabled=True, environ={"DSA_COMPILE_CACHE": str(tmp_path / "c")}) is None
    # An unusable directory (here: under a regular file) warns and builds without a cache; it never fails.
    (tmp_path / "file").write_text("")
    assert cache_from_environment(environ={"DSA_COMPILE_CACHE": str(tmp_path / "file" / "cache")}) is None
    err = capsys.readouterr().err
    assert f"dsa compile: warning: the compile cache {tmp_path / 'file' / 'cache'} is not usable" in err
