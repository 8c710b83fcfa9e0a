import copy
import sys
from pathlib import Path

import pytest

from dsa.manifest.contract import load_manifest, project
from dsa.tools.testing import runfile

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # tiny_models is imported by entry point name
    sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def pi0_manifest():
    return load_manifest(runfile("manifests/pi0.yaml"))


@pytest.fixture
def tiny_view(pi0_manifest):
    """The pi0 export view, pointed at the tiny pooled model."""
    view = copy.deepcopy(project(pi0_manifest, "export"))
    view["model"] = {"entry_point": "tiny_models:pooled", "config": {"width": 8}}
    return view


@pytest.fixture(scope="session")
def target_spec():
    import json

    return json.loads(runfile("toolchains/targets/x86_64-v3.json").read_text())
