"""Smoke test of @dsa_python: the environment matches requirements_lock.txt."""

import glob
import hashlib
import importlib
import importlib.metadata
import json
import os
import re
import sys

import pytest

# A test runs in its workspace's directory of the runfiles tree.
LOCK = "requirements_lock.txt"


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins():
    with open(LOCK) as f:
        pins = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", f.read(), re.M)
    return {canonical(name): version for name, version in pins}


def identity_path():
    # The repository's directory name in runfiles is "dsa_python" under
    # WORKSPACE and a canonical name ending in "dsa_python" under Bzlmod.
    found = glob.glob(os.path.join(os.environ["TEST_SRCDIR"], "*dsa_python", "identity.json"))
    assert len(found) == 1, found
    return found[0]


def test_lock_pins_the_direct_dependencies():
    pins = lock_pins()
    for name in ["torch", "iree-turbine", "iree-base-compiler", "iree-base-runtime",
                 "pyyaml", "safetensors", "jsonschema", "numpy", "pytest"]:
        assert name in pins, name
    assert pins["torch"] == "2.13.0+cpu"


@pytest.mark.parametrize("module, distribution", [
    ("torch", "torch"),
    ("iree.compiler", "iree-base-compiler"),
    ("iree.runtime", "iree-base-runtime"),
    ("iree.turbine.aot", "iree-turbine"),
    ("safetensors", "safetensors"),
    ("yaml", "pyyaml"),
    ("jsonschema", "jsonschema"),
    ("numpy", "numpy"),
])
def test_imports_at_locked_version(module, distribution):
    importlib.import_module(module)
    assert importlib.metadata.version(distribution) == lock_pins()[distribution]


def test_torch_reports_the_cpu_build():
    import torch

    assert torch.__version__ == lock_pins()["torch"]


def test_every_pin_installed_at_its_version():
    installed = {canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    for name, version in lock_pins().items():
        assert installed.get(name) == version, name


def test_runs_in_the_venv_without_user_site():
    assert sys.prefix != sys.base_prefix, "not running in dsa_python's venv"
    assert sys.version_info[:2] == (3, 11)
    assert sys.flags.no_user_site
    assert os.environ.get("PYTHONHASHSEED") == "0"


def test_identity_names_the_lock():
    with open(identity_path()) as f:
        identity = json.load(f)
    with open(LOCK, "rb") as f:
        assert identity["lock_sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert identity["schema"] == 1
    assert identity["python_version"] == "%d.%d.%d" % sys.version_info[:3]
    assert identity["installed"] == sorted("%s==%s" % pin for pin in lock_pins().items())


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def test_identity_has_no_absolute_paths():
    with open(identity_path()) as f:
        text = f.read()
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"
    for s in strings(json.loads(text)):
        assert not s.startswith("/"), s
