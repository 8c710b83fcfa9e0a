"""dsa.tools.stage_process: a stage runs in a child process of its own, whose result, DsaError, crash or death
comes back to the caller, with the child's own wall time and peak RSS."""

import os
import signal

import pytest

from dsa.core.errors import DsaError
from dsa.tools.stage_process import StageRunner


def add(a, b, *, scale=1):
    return {"sum": (a + b) * scale, "pid": os.getpid()}


def allocate(mib):
    block = bytearray(mib * 1024 * 1024)
    for i in range(0, len(block), 4096):  # touch every page: resident, not just reserved
        block[i] = 1
    return len(block)


def refuse():
    raise DsaError("model.yaml: inputs.state", "dim must be positive", "set it to the state's width")


def crash():
    return {}["missing"]


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def mkl_branch():
    return os.environ.get("MKL_CBWR")


def test_a_stage_runs_in_another_process_and_returns_its_result():
    runner = StageRunner()
    result = runner("add", add, 2, 3, scale=10)
    assert result["sum"] == 50
    assert result["pid"] != os.getpid()
    [timing] = runner.timings
    assert timing.stage == "add" and timing.wall_s > 0 and timing.peak_rss_kib > 0


def test_a_stage_runs_on_mkls_one_code_path_whatever_the_caller_set(monkeypatch):
    # dsa.core.determinism: MKL rounds differently per code path (AVX-512 on Intel, generic on AMD); a stage's
    # artifact must not depend on the CPU or on the caller's environment.
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    assert StageRunner()("branch", mkl_branch) == "COMPATIBLE"


def test_the_peak_rss_is_the_stages_own_not_the_callers():
    runner = StageRunner()
    runner("small", allocate, 1)
    runner("large", allocate, 300)
    small, large = runner.timings
    assert large.peak_rss_kib - small.peak_rss_kib >= 290 * 1024
    ballast = bytearray(400 * 1024 * 1024)  # noqa: F841 — the caller's own memory is not counted
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    runner("small again", allocate, 1)
    assert runner.timings[-1].peak_rss_kib < small.peak_rss_kib + 50 * 1024


def test_a_dsa_error_in_the_stage_comes_back_unchanged():
    with pytest.raises(DsaError) as e:
        StageRunner()("validate", refuse)
    assert (e.value.where, e.value.message, e.value.hint) == \
        ("model.yaml: inputs.state", "dim must be positive", "set it to the state's width")


def test_an_unexpected_exception_names_the_stage_in_one_line_without_a_traceback(monkeypatch):
    monkeypatch.delenv("DSA_TRACEBACK", raising=False)
    with pytest.raises(DsaError, match=r"dsa compile: export: unexpected KeyError: 'missing'") as e:
        StageRunner()("export", crash)
    assert "Traceback" not in str(e.value) and "\n" not in str(e.value)
    assert "DSA_TRACEBACK=1" in str(e.value)


def test_dsa_traceback_shows_the_childs_traceback_for_a_developer(monkeypatch):
    monkeypatch.setenv("DSA_TRACEBACK", "1")
    with pytest.raises(DsaError, match=r"dsa compile: export: unexpected KeyError") as e:
        StageRunner()("export", crash)
    assert "Traceback" in e.value.hint and 'return {}["missing"]' in e.value.hint


def exhaust():
    raise MemoryError()


def test_a_stage_out_of_memory_says_so_in_one_line(monkeypatch):
    monkeypatch.delenv("DSA_TRACEBACK", raising=False)
    with pytest.raises(DsaError, match=r"dsa compile: params: out of memory: an input states a size") as e:
        StageRunner()("params", exhaust)
    assert "\n" not in str(e.value)


def test_a_stage_killed_by_a_signal_says_so_and_suggests_memory():
    runner = StageRunner()
    with pytest.raises(DsaError, match=r"dsa compile: params: the stage's process was killed by SIGKILL "
                                       r"before it finished \(SIGKILL usually means out of memory"):
        runner("params", die)
    assert [t.stage for t in runner.timings] == ["params"]
