"""The bin/ commands run the tools from a checkout, without Bazel, and report errors as the tools do."""

import os
import subprocess
import sys

from dsa.testing import runfile


def _run(*args):
    env = dict(os.environ, DSA_PYTHON=sys.executable)
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, cwd=runfile("."))


def test_dsa_manifest_validates_the_flagship_manifest():
    proc = _run(runfile("bin/dsa"), "manifest", "validate", "manifests/pi0.yaml",
                "--known-targets-dir", "toolchains/targets")
    assert proc.returncode == 0 and "manifests/pi0.yaml: ok" in proc.stdout, proc.stderr


def test_dsa_manifest_refuses_a_bad_manifest_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(runfile("manifests/pi0.yaml").read_text().replace("flow_steps: 10", "flow_step: 10"))
    proc = _run(runfile("bin/dsa-manifest"), "validate", bad)
    assert proc.returncode == 2
    assert "unknown field 'flow_step' (did you mean 'flow_steps'?)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dsa_without_a_command_prints_usage():
    proc = _run(runfile("bin/dsa"))
    assert proc.returncode == 2 and "usage: dsa run|diff|compile|manifest" in proc.stderr
