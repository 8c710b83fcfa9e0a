"""A module index's levels: the same export compiled for richer CPUs of the same machines (x86_64-v4 beside
x86_64-v3). A runner without an explicit target takes the most capable build the machine executes — chosen
at load time from the target specs' `host` requirements, so nothing of the build depends on the machine that
built it — and says which; a missing, foreign or hostile level is refused, never silently replaced by the
base. `dsa compile` links its builds the same way (dsa.tools.pipeline.add_levels), and the DsaLock action
writes the levels it is given (dsa.stages.lock --index-level)."""

import json
import shutil

import pytest

from dsa.core.errors import DsaError
from dsa.core.fileio import read_json
from dsa.core.formats import ModuleIndex
from dsa.runtime.policy import builds_of, choose_level
from dsa.stages import lock as lock_tool
from dsa.tools.pipeline import add_levels
from dsa.tools.testing import runfile

TARGETS = runfile("toolchains/targets/x86_64-v3.json").parent
V3 = read_json(TARGETS / "x86_64-v3.json")
V4 = read_json(TARGETS / "x86_64-v4.json")
V4_FEATURES = V4["host"]["cpu_features"]
V3_FEATURES = V3["host"]["cpu_features"]


def _index(path, target, levels=(), params="params.irpa"):
    shutil.copyfile(TARGETS / f"{target}.json", path.parent / f"{target}.json")
    ModuleIndex(target=target, target_spec=f"{target}.json", parameter_archive=params, parameter_scope="model",
                runtime_view="runtime_view.json", modules=(), levels=tuple(levels)).write(path)
    return path


@pytest.fixture
def act(tmp_path):
    """act.modules.json (x86_64-v3) listing act_x86_64-v4.modules.json as its level, as dsa_policy builds them."""
    _index(tmp_path / "act_x86_64-v4.modules.json", "x86_64-v4")
    return _index(tmp_path / "act.modules.json", "x86_64-v3", [("x86_64-v4", "act_x86_64-v4.modules.json")])


def test_an_avx512_machine_gets_the_x86_64_v4_build_and_is_told_why(act):
    choice = choose_level(act, arch="x86_64", features=V4_FEATURES)
    assert choice.target == "x86_64-v4" and choice.index == act.parent / "act_x86_64-v4.modules.json"
    assert choice.why == "the most capable of its builds (x86_64-v3, x86_64-v4) this machine runs"


def test_an_avx2_machine_gets_the_portable_build_and_is_told_what_the_other_lacks(act):
    choice = choose_level(act, arch="x86_64", features=V3_FEATURES)
    assert choice.target == "x86_64-v3" and choice.index == act
    assert "x86_64-v4: it needs the CPU features avx512bw" in choice.why


def test_a_machine_that_runs_none_of_the_builds_is_refused_naming_each(act):
    with pytest.raises(DsaError, match=r"act\.modules\.json: has no build this machine can run: x86_64-v3: its code "
                                       r"is for x86_64 CPUs and this machine is aarch64; x86_64-v4: "):
        choose_level(act, arch="aarch64", features=["fp", "asimd"])


def test_a_named_target_is_taken_as_asked_and_an_unknown_one_is_refused(act):
    assert choose_level(act, "x86_64-v3", arch="x86_64", features=V4_FEATURES).index == act
    assert choose_level(act, "x86_64-v3").why is None
    with pytest.raises(DsaError, match=r"has no build for target 'aarch64-orin' \(it has x86_64-v3, x86_64-v4\)"):
        choose_level(act, "aarch64-orin")


def test_an_index_without_levels_is_its_own_build(tmp_path):
    index = _index(tmp_path / "m.modules.json", "x86_64-v3")
    assert builds_of(index) == {"x86_64-v3": index}
    assert choose_level(index, arch="x86_64", features=V4_FEATURES).why is None


def test_a_missing_level_is_refused_naming_it_and_how_to_run_the_base(act):
    (act.parent / "act_x86_64-v4.modules.json").unlink()
    with pytest.raises(DsaError, match=r"act_x86_64-v4\.modules\.json: is the x86_64-v4 build that act\.modules\.json "
                                       r"lists under `levels`, and it is missing.*target='x86_64-v3'"):
        choose_level(act, arch="x86_64", features=V4_FEATURES)


def test_a_level_of_another_export_is_refused(act):
    _index(act.parent / "act_x86_64-v4.modules.json", "x86_64-v4", params="other.irpa")
    with pytest.raises(DsaError, match=r"is not a x86_64-v4 build of act\.modules\.json's export"):
        choose_level(act, arch="x86_64", features=V4_FEATURES)


@pytest.mark.parametrize("levels,message", [
    ([{"target": "x86_64-v4", "index": "../../etc/x.modules.json"}], r"levels\[0\]\.index: '\.\./\.\./etc/x\.modules\.json' "
                                                                     r"is not a module index file name beside this index"),
    ([{"target": "x86_64-v4", "index": "/abs.modules.json"}], r"levels\[0\]\.index"),
    ([{"target": "x86_64-v4", "index": "x.json"}], r"levels\[0\]\.index"),
    ([{"target": "x86_64-v3", "index": "x.modules.json"}], r"levels\[0\]\.target: 'x86_64-v3' is not a further target"),
    ([{"target": "x86_64-v4", "index": "a.modules.json"}, {"target": "x86_64-v4", "index": "b.modules.json"}],
     r"levels\[1\]\.target"),
    ([{"target": "x86_64-v4"}], r"levels\[0\]: must be"),
    ({"x86_64-v4": "a.modules.json"}, r"levels: must be a list"),
])
def test_a_hostile_levels_field_is_refused_when_the_index_is_read(act, levels, message):
    data = read_json(act)
    data["levels"] = levels
    act.write_text(json.dumps(data))
    with pytest.raises(DsaError, match=message):
        ModuleIndex.read(act)


def test_the_lock_action_writes_the_levels_it_is_given_and_refuses_a_path(tmp_path):
    with pytest.raises(DsaError, match=r"--index-level: 'x86_64-v4=sub/act\.modules\.json' is not TARGET=NAME"):
        lock_tool._level("x86_64-v4=sub/act.modules.json")
    assert lock_tool._level("x86_64-v4=act_x86_64-v4.modules.json") == ("x86_64-v4", "act_x86_64-v4.modules.json")


def test_dsa_compile_lists_the_richer_builds_of_the_same_machines_on_the_portable_one(tmp_path):
    """x86_64-v3, x86_64-v4 and aarch64-orin compiled: v3's index lists v4; Orin's CPU is another machine."""
    indexes = [_index(tmp_path / f"{t}.modules.json", t) for t in ("x86_64-v4", "x86_64-v3", "aarch64-orin")]
    add_levels(indexes)
    assert ModuleIndex.read(tmp_path / "x86_64-v3.modules.json").levels == (("x86_64-v4", "x86_64-v4.modules.json"),)
    assert ModuleIndex.read(tmp_path / "x86_64-v4.modules.json").levels == ()
    assert ModuleIndex.read(tmp_path / "aarch64-orin.modules.json").levels == ()


def test_dsa_compile_of_one_target_writes_no_levels(tmp_path):
    index = _index(tmp_path / "x86_64-v4.modules.json", "x86_64-v4")
    add_levels([index])
    assert "levels" not in read_json(index)
