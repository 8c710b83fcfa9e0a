"""Property-based fuzzing (Hypothesis) of the three readers of untrusted data: the manifest loader, the bundle
reader and the observation loader. The property is the same for each: whatever the input, the reader either
accepts it or raises its one-line error (ManifestError / DsaError) — never another exception, never a hang
(each example runs under Hypothesis's deadline). Derandomized, so CI runs the same examples every time."""

from __future__ import annotations

import io
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from dsa.core.errors import DsaError  # noqa: E402
from dsa.manifest.contract import ManifestError, load_manifest  # noqa: E402
from dsa.core import tarfiles as T  # noqa: E402
from dsa.runtime import bundle as B  # noqa: E402
from dsa.runtime.policy import CompiledPolicy, check_input  # noqa: E402
from dsa.runtime.run import load_observation  # noqa: E402
from dsa.tools.testing import bounded_memory, runfile  # noqa: E402

@pytest.fixture(autouse=True)
def _case_memory_limit():
    """Every case runs under a memory limit: at most 1 GiB more address space than the process holds."""
    with bounded_memory():
        yield


SETTINGS = settings(max_examples=120, deadline=10_000, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
MANIFEST = runfile("manifests/pi0.yaml")
BUNDLE = runfile("models/pi0_bundle.tar")
INDEX = runfile("models/pi0.modules.json")

# -- manifests ------------------------------------------------------------------------------------------------

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-10 ** 12, max_value=10 ** 12) | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, prefix + (i,))


BASE = yaml.safe_load(MANIFEST.read_text())
FIELDS = [p for p in _paths(BASE) if p]


def _load(text: str, tmp: Path):
    path = tmp / "manifest.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_manifest(path)
    except ManifestError as e:
        assert "manifest.yaml" in str(e), str(e)  # the message names the file


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(FIELDS), JSONISH), min_size=1, max_size=4))
def test_a_manifest_with_any_fields_replaced_loads_or_is_refused_with_a_manifest_error(edits):
    import copy

    document = copy.deepcopy(BASE)
    for path, value in edits:
        node = document
        try:
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue
    with tempfile.TemporaryDirectory() as tmp:
        _load(yaml.safe_dump(document, allow_unicode=True), Path(tmp))


@SETTINGS
@given(st.text(max_size=400) | st.binary(max_size=400))
def test_any_text_or_bytes_as_a_manifest_is_refused_with_a_manifest_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "manifest.yaml"
        path.write_bytes(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
        try:
            load_manifest(path)
        except ManifestError:
            pass


# -- bundles --------------------------------------------------------------------------------------------------

ORIGINAL = BUNDLE.read_bytes()


def _members():
    with tarfile.open(BUNDLE) as tar:
        return [(m.name, m.offset, m.offset_data, m.size) for m in tar]


MEMBERS = _members()
# Offsets worth hitting: every header and the first bytes of every member's data (bundle.json, the JSON files).
HOT = sorted({o for _, header, data, size in MEMBERS for o in range(header, min(data + 512, data + size))})


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(HOT) | st.integers(0, len(ORIGINAL) - 1), st.integers(1, 255)),
                min_size=1, max_size=6),
       st.none() | st.integers(0, len(ORIGINAL)))
def test_a_damaged_bundle_is_refused_with_a_dsa_error_and_never_crashes(flips, cut):
    data = bytearray(ORIGINAL)
    for offset, xor in flips:
        data[offset] ^= xor
    if cut is not None:
        data = data[:cut]
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "pi0_bundle.tar"
        archive.write_bytes(bytes(data))
        try:
            B.extract_bundle(archive, Path(tmp) / "out")
            assert bytes(data) == ORIGINAL  # a changed archive is never accepted
        except DsaError:
            pass


@SETTINGS
@given(st.dictionaries(st.sampled_from(["files", "index", "format", "kind", "stages", "lock", "manifest",
                                        "index_file", "build_report", "provenance", "model_id"]),
                       JSONISH, max_size=4))
def test_a_bundle_json_with_fields_replaced_is_refused_with_a_dsa_error(fields):
    import json

    with tarfile.open(BUNDLE) as tar:
        contents = {m.name: tar.extractfile(m).read() for m in tar}
    meta = json.loads(contents[B.BUNDLE_JSON])
    meta.update(fields)
    contents[B.BUNDLE_JSON] = json.dumps(meta, allow_nan=True).encode()
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "pi0_bundle.tar"
        with tarfile.open(archive, "w", format=T.TAR_FORMAT) as tar:
            for name in sorted(contents):
                tar.addfile(T.tarinfo(name, len(contents[name])), io.BytesIO(contents[name]))
        try:
            B.extract_bundle(archive, Path(tmp) / "out")
        except DsaError:
            pass


# -- observations -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy():
    return CompiledPolicy(INDEX)


NAMES = ["base_rgb", "wrist_rgb", "prompt_tokens", "prompt_mask", "state", "noise", "steps", "other"]
ARRAYS = st.one_of(
    st.lists(st.integers(-10 ** 20, 10 ** 20), max_size=8).map(lambda v: np.array(v, dtype=object)),
    st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=8).map(np.array),
    st.lists(st.integers(-2 ** 63, 2 ** 63 - 1), max_size=8).map(lambda v: np.array(v, dtype=np.int64)),
    st.lists(st.text(max_size=3), max_size=4).map(np.array),
    st.lists(st.booleans(), max_size=4).map(np.array),
    st.tuples(st.integers(0, 3), st.integers(0, 40)).map(lambda s: np.zeros(s, np.float32)),
)


@SETTINGS
@given(st.dictionaries(st.sampled_from(NAMES), ARRAYS, max_size=5))
def test_any_npz_observation_is_loaded_and_checked_or_refused_with_a_dsa_error(policy, arrays):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "obs.npz"
        np.savez(path, allow_pickle=True, **arrays)  # object arrays are written pickled: the reader must refuse
        try:
            values = load_observation(path, policy)
            for spec in policy.input_specs:
                if spec["name"] in values:
                    check_input(policy.model_id, spec, values[spec["name"]])
        except DsaError:
            pass


@SETTINGS
@given(st.binary(max_size=600))
def test_any_bytes_as_an_observation_file_are_refused_with_a_dsa_error(policy, data):
    with tempfile.TemporaryDirectory() as tmp:
        for suffix in (".npz", ".safetensors"):
            path = Path(tmp) / f"obs{suffix}"
            path.write_bytes(data)
            try:
                load_observation(path, policy)
            except DsaError:
                pass
