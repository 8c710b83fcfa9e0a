"""Fixtures of the bundle tests: the built π0 bundle, a writable copy of it, and it opened."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # bundle_testlib sits beside the tests
    sys.path.insert(0, str(HERE))

from bundle_testlib import BUILT  # noqa: E402
from dsa.runtime import bundle as B  # noqa: E402
from dsa.tools.testing import runfile  # noqa: E402


@pytest.fixture(scope="session")
def built() -> Path:
    return runfile(BUILT)


@pytest.fixture
def built_copy(tmp_path, built) -> Path:
    """A writable copy of the built bundle and its .sha256, in a directory of its own."""
    directory = tmp_path / "copy"
    directory.mkdir()
    shutil.copyfile(built, directory / built.name)
    shutil.copyfile(B.sidecar_path(built), directory / B.sidecar_path(built).name)
    return directory / built.name


@pytest.fixture(scope="session")
def opened(tmp_path_factory, built):
    return B.extract_bundle(built, tmp_path_factory.mktemp("opened"))
