"""The one `dsa` command (bin/dsa, python -m dsa) runs the tools from a checkout, without Bazel, and reports errors
as the tools do."""

import json
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
    for command in ("run", "compile", "manifest", "bundle", "diff", "link", "profile", "bench", "execlog", "lerobot"):
        assert f"dsa {command}" in proc.stderr, command
    assert "dsa lerobot init --config-file" in proc.stderr  # writing a policy directory: found from the usage


def test_dsa_lerobot_outside_the_lerobot_environment_says_which_environment_has_it(tmp_path):
    """This test's environment is the main one (no LeRobot): `dsa lerobot init` names the package and the lock
    of the environment that has it, in one line (it was an 'unexpected ModuleNotFoundError')."""
    proc = _run(runfile("bin/dsa"), "lerobot", "init", "--type", "act", "--out-dir", tmp_path / "policy")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "needs the Python package 'lerobot'" in proc.stderr and "requirements_lerobot_lock.txt" in proc.stderr


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


def test_dsa_compile_checks_its_file_arguments_before_any_work(tmp_path):
    """A wrong --checkpoint (or --policy-config, --requirements-lock, ...) is refused at once, naming the flag."""
    proc = subprocess.run(
        [str(runfile("bin/dsa")), "compile", "--manifest", str(runfile("manifests/pi0.yaml").absolute()),
         "--out", str(tmp_path / "out"), "--checkpoint", str(tmp_path / "missing.safetensors")],
        capture_output=True, text=True, env=dict(os.environ, DSA_PYTHON=sys.executable), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("dsa compile: error: --checkpoint: no file at "), proc.stderr
    assert not (tmp_path / "out").exists()


def test_dsa_compile_runs_from_another_directory(tmp_path):
    """From a directory outside the checkout, the model code is found in the workspace that holds the manifest,
    and the lock names the model's sources workspace-relative, as from the checkout's root."""
    proc = subprocess.run(
        [str(runfile("bin/dsa")), "compile", "--manifest", str(runfile("manifests/transformer.yaml").absolute()),
         "--out", str(tmp_path / "out"), "--seeded-checkpoint", "0"],
        capture_output=True, text=True, env=dict(os.environ, DSA_PYTHON=sys.executable), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lock = json.loads((tmp_path / "out" / "x86_64-v3.lock.json").read_text())
    assert "models/transformer/transformer.py" in lock["model_sources"], sorted(lock["model_sources"])
    assert (tmp_path / "out" / "x86_64-v3" / "model.vmfb").is_file()
