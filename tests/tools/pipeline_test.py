"""dsa-compile (no Bazel) runs the same stage code as the rules and gives byte-identical artifacts."""

from dsa.fileio import read_json, sha256_file
from dsa.pipeline import run_pipeline
from dsa.testing import runfile


def test_dsa_compile_matches_bazel_build_byte_for_byte(tmp_path):
    indexes = run_pipeline(
        runfile("manifests/pi0.yaml"),
        tmp_path,
        targets_dir=runfile("toolchains/targets"),
        seeded_checkpoint=0,
        pythonpath=[str(runfile("."))],
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
