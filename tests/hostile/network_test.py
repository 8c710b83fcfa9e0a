"""Build actions run without network (.bazelrc: --nosandbox_default_allow_network): an action that tries to
reach an address outside the machine is refused by the kernel (it sees only the loopback interface), while
the same probe outside Bazel's sandbox connects. The probe is a build action like DsaExport or DsaCompile:
the same sandbox and flag apply to every action of the rule set."""

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from network_probe import probe  # noqa: E402
from dsa.tools.testing import runfile  # noqa: E402


def test_a_build_action_cannot_reach_outside_the_machine():
    control = probe()  # this test is tagged requires-network: it runs with the host's network
    if control["outside"] != "connected":
        pytest.skip(f"this machine has no route outside ({control['outside']}): nothing to compare with")
    seen = json.loads(runfile("tests/hostile/network_probe.json").read_text())
    assert seen["outside"].startswith("refused"), seen
    assert seen["interfaces"] == ["lo"], seen
