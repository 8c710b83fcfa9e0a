"""dsa-compile (no Bazel) runs the same stage code as the rules and gives byte-identical artifacts and lock."""

from dsa.core.fileio import read_json, sha256_file
from dsa.tools.pipeline import run_pipeline
from dsa.tools.testing import runfile


def test_dsa_compile_matches_bazel_build_byte_for_byte(tmp_path):
    indexes = run_pipeline(
        runfile("manifests/pi0.yaml"),
        tmp_path,
        targets_dir=runfile("toolchains/targets"),
        seeded_checkpoint=0,
        pythonpath=[str(runfile("."))],
        requirements_lock=runfile("requirements_lock.txt"),
        tuning={"x86_64-v3": runfile("toolchains/tuning/flow_vla.x86_64-v3.json")},
    )
    assert [i.name for i in indexes] == ["x86_64-v3.modules.json"]
    ours = read_json(indexes[0])
    bazel_index = runfile("models/pi0.modules.json")
    theirs = read_json(bazel_index)
    assert len(ours["modules"]) == len(theirs["modules"]) == 3
    for mine, built in zip(ours["modules"], theirs["modules"]):
        assert sha256_file(tmp_path / mine["vmfb"]) == sha256_file(bazel_index.parent / built["vmfb"])
        assert read_json(tmp_path / mine["record"])["mlir_sha256"] == \
            read_json(bazel_index.parent / built["record"])["mlir_sha256"]
    assert sha256_file(tmp_path / "params.irpa") == sha256_file(bazel_index.parent / theirs["parameter_archive"])
    assert sha256_file(tmp_path / "checkpoint.safetensors") == sha256_file(runfile("models/pi0.safetensors"))
    # The recipe lock: every input and output digest, byte-identical (so, e.g., the same model sources,
    # tool sources, views, toolchain identity and flags were recorded).
    ours_lock, bazel_lock = tmp_path / "x86_64-v3.lock.json", runfile("models/pi0.lock.json")
    assert read_json(ours_lock) == read_json(bazel_lock)
    assert sha256_file(ours_lock) == sha256_file(bazel_lock)
