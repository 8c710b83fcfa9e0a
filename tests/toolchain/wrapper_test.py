"""The environment's interpreter wrapper (dsa_python_env's bin/python3) away from its venv: under remote
execution the worker stages the wrapper without the venv beside it (docs/remote-execution.md).

Runs the generated wrapper itself, copied where no venv lies beside it (as a worker stages it): it must run
the environment the worker's image holds at <DSA_ENV_IMAGE_ROOT>/<lock sha256>/venv, and without one fail
naming the environment's lock digest and what to do, with no Python traceback.
"""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest


def _runfile(name: str) -> str:
    found = glob.glob(os.path.join(os.environ["TEST_SRCDIR"], "*dsa_python", name))
    assert found, f"{name} of @dsa_python is not in the test's runfiles"
    return found[0]


@pytest.fixture
def staged(tmp_path):
    """The wrapper as a worker stages it: a plain file under external/dsa_python/bin, no venv beside it."""
    bin_dir = tmp_path / "input-root" / "external" / "dsa_python" / "bin"
    bin_dir.mkdir(parents=True)
    wrapper = bin_dir / "python3"
    shutil.copyfile(os.path.realpath(_runfile("bin/python3")), wrapper)
    wrapper.chmod(0o755)
    with open(_runfile("identity.json")) as f:
        return wrapper, json.load(f)["lock_sha256"]


def _run(wrapper, image_root):
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "DSA_ENV_IMAGE_ROOT": str(image_root)}
    return subprocess.run([str(wrapper), "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                          env=env, timeout=120)


def test_without_a_venv_beside_it_the_wrapper_runs_the_image_environment_of_its_lock_digest(staged, tmp_path):
    wrapper, lock_sha = staged
    image = tmp_path / "image"
    (image / lock_sha).mkdir(parents=True)
    # The image's environment: this test's own interpreter's venv stands for it (same lock).
    os.symlink(sys.prefix, image / lock_sha / "venv")
    proc = _run(wrapper, image)
    assert proc.returncode == 0, proc.stderr
    assert os.path.realpath(proc.stdout.strip()) == os.path.realpath(sys.prefix)


def test_an_image_without_the_environment_fails_naming_the_lock_digest_and_what_to_do(staged, tmp_path):
    wrapper, lock_sha = staged
    image = tmp_path / "image"
    (image / ("0" * 64) / "venv").mkdir(parents=True)  # another environment only
    proc = _run(wrapper, image)
    assert proc.returncode == 127
    assert f"sha256 {lock_sha}" in proc.stderr and "is not on this machine" in proc.stderr
    assert f"{image}/{lock_sha}/venv" in proc.stderr
    assert "docs/remote-execution.md" in proc.stderr and "no-remote-exec" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_the_wrapper_names_no_absolute_path_of_this_machine(staged):
    wrapper, _ = staged
    text = wrapper.read_text()
    assert os.path.expanduser("~") not in text and "/work" not in text and "output_base" not in text
    # The one absolute path: the documented default image root.
    assert "/opt/rules_dsa/python-envs" in text
