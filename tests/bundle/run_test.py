"""`dsa run BUNDLE`: runs the built π0 bundle after verifying it; refuses a damaged or mismatched one (exit 2,
one message, no traceback)."""

from __future__ import annotations

import re

import pytest

from bundle_testlib import cli, flip_byte, member_offset, rebundle, repack
from dsa.core.fileio import canonical_json, read_json
from dsa.tools.testing import runfile


def _action_lines(stdout: str):
    return [line for line in stdout.splitlines() if line.startswith("flow_steps=")]


@pytest.mark.parametrize("steps", [1, 10])
def test_run_bundle_prints_an_action_chunk(built, steps):
    proc = cli("dsa.runtime.run", "--bundle", built, "--steps", steps, "--repeats", "3")
    assert proc.returncode == 0, proc.stderr
    assert "matches pi0_bundle.sha256" in proc.stdout and "17 files verified" in proc.stdout
    (line,) = _action_lines(proc.stdout)
    assert re.match(rf"flow_steps={steps}\s+bucket prompt_len=\d+\s+action chunk \(1, 16, 14\) "
                    r"\(execute the first 8\); latency p50 [\d.]+ ms, p90 [\d.]+ ms over 3 runs", line), line
    assert "first action:" in proc.stdout


def test_run_bundle_picks_the_bucket_and_matches_the_build_tree(built):
    args = ["--prompt-len", "100", "--steps", "1", "10", "--repeats", "1"]
    from_bundle = cli("dsa.runtime.run", "--bundle", built, *args)
    from_index = cli("dsa.runtime.run", "--index", runfile("models/pi0.modules.json"), *args)
    assert from_bundle.returncode == 0, from_bundle.stderr
    assert from_index.returncode == 0, from_index.stderr
    assert all("bucket prompt_len=128" in line for line in _action_lines(from_bundle.stdout))

    def actions(stdout):  # the printed first actions, without the latencies
        return re.findall(r"first action: (\[[^\]]*\])", stdout)

    assert actions(from_bundle.stdout) == actions(from_index.stdout) and len(actions(from_bundle.stdout)) == 2


def test_run_bundle_relative_to_bazel_run_directory(built, tmp_path):
    proc = cli("dsa.runtime.run", "--bundle", "pi0_bundle.tar", "--steps", "1", "--repeats", "1",
               cwd=tmp_path, env={"BUILD_WORKING_DIRECTORY": str(built.parent)})
    assert proc.returncode == 0, proc.stderr


def _refused(proc, *fragments):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and not _action_lines(proc.stdout)
    assert proc.stderr.startswith("dsa run: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def test_flipped_byte_is_refused(built_copy):
    flip_byte(built_copy, member_offset(built_copy, "prompt_len_0.vmfb") + 4096)
    _refused(cli("dsa.runtime.run", "--bundle", built_copy, "--steps", "1"), "pi0_bundle.tar: sha256 is",
             "pi0_bundle.sha256 records")
    built_copy.with_suffix(".sha256").unlink()
    _refused(cli("dsa.runtime.run", "--bundle", built_copy, "--steps", "1"), "prompt_len_0.vmfb: has sha256",
             "bundle.json records")


def test_truncated_is_refused(built_copy):
    built_copy.write_bytes(built_copy.read_bytes()[:-20000])
    _refused(cli("dsa.runtime.run", "--bundle", built_copy, "--steps", "1"), "pi0_bundle.sha256 records")
    built_copy.with_suffix(".sha256").unlink()
    _refused(cli("dsa.runtime.run", "--bundle", built_copy, "--steps", "1"), "not a readable bundle archive",
             "truncated")


def test_a_format_newer_than_this_reader_is_refused(opened, tmp_path):
    newer = repack(opened.root, tmp_path / "newer.tar", lambda meta: meta.update(format=4))
    _refused(cli("dsa.runtime.run", "--bundle", newer, "--steps", "1"), "bundle format 4 is not supported",
             "reads formats 1, 2 and 3")


def test_missing_bundle_is_refused(tmp_path):
    _refused(cli("dsa.runtime.run", "--bundle", tmp_path / "nothing.tar"), "no such bundle archive")


def test_parameter_shape_mismatch_is_refused_before_loading(opened, tmp_path):
    """A bundle whose export record expects another shape than the parameter archive holds (consistent digests
    throughout, so only the parameter check can catch it)."""
    name = "prompt_len_0.export_record.json"
    record = read_json(opened.root / name)
    param = record["parameters"][0]
    param["shape"] = list(reversed(param["shape"])) + [1]
    bad = rebundle(opened, tmp_path / "bad.tar", files={name: canonical_json(record).encode()})
    _refused(cli("dsa.runtime.run", "--bundle", bad, "--steps", "1"), f"parameter '{param['name']}'",
             "the module expects")
