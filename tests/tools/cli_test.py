"""The one `dsa` command (bin/dsa, python -m dsa) runs the tools from a checkout, without Bazel, and reports errors
as the tools do."""

import os
import subprocess
import sys

from dsa.tools.testing import runfile


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
    proc = _run(runfile("bin/dsa"), "manifest", "validate", bad)
    assert proc.returncode == 2
    assert "unknown field 'flow_step' (did you mean 'flow_steps'?)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dsa_without_a_command_prints_usage():
    proc = _run(runfile("bin/dsa"))
    assert proc.returncode == 2 and "usage: dsa COMMAND" in proc.stderr
    for command in ("run", "compile", "manifest", "bundle", "diff", "link", "profile", "bench", "execlog"):
        assert f"dsa {command}" in proc.stderr, command


def test_dsa_refuses_an_unknown_command_naming_the_known_ones():
    proc = _run(runfile("bin/dsa"), "compiel", "--manifest", "manifests/pi0.yaml")
    assert proc.returncode == 2 and proc.stderr.startswith("dsa: error: unknown command 'compiel'"), proc.stderr
    assert "compile" in proc.stderr and "Traceback" not in proc.stderr


def test_python_dash_m_dsa_is_the_same_command():
    env = dict(os.environ, PYTHONPATH=str(runfile(".")))
    proc = subprocess.run([sys.executable, "-m", "dsa", "manifest", "explain", "manifests/pi0.yaml"],
                          capture_output=True, text=True, env=env, cwd=runfile("."))
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint: params" in proc.stdout and "power_profile: runtime" in proc.stdout


def test_each_command_names_itself_in_its_errors(tmp_path):
    """`dsa diff` with a missing bundle: the tool's own one-line error, prefixed with the command's name."""
    proc = _run(runfile("bin/dsa"), "diff", tmp_path / "a.tar", tmp_path / "b.tar")
    assert proc.returncode == 2 and proc.stderr.startswith("dsa diff: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
