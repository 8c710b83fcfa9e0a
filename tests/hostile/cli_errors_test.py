"""No traceback, ever: every CLI entry point goes through dsa.core.errors.run_cli, which turns any exception —
not only DsaError — into one line on stderr and exit 2 (Ctrl-C: 130); DSA_TRACEBACK=1 shows the traceback to
a developer. And a tuning file or a `--targets-dir` spec cannot make iree-compile write outside --out:
`dsa compile` refuses it before any stage runs, naming the file and the flag."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from hostile_lib import PACKAGE_ROOT, cli, refused  # noqa: E402
from dsa.tools.testing import runfile  # noqa: E402

MANIFEST = runfile("manifests/custom_op.yaml")
TARGETS = runfile("toolchains/targets/x86_64-v3.json").parent


def _run_cli_with(body: str, env: dict = None) -> subprocess.CompletedProcess:
    """A tiny CLI whose main raises what `body` raises, run through run_cli."""
    program = ("from dsa.core.errors import run_cli\n"
               "def main():\n" + textwrap.indent(body, "    ") + "\n"
               "run_cli(main, 'dsa probe')\n")
    environment = {k: v for k, v in os.environ.items() if k != "DSA_TRACEBACK"}
    environment.update(PYTHONPATH=str(PACKAGE_ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=environment,
                          timeout=60)


@pytest.mark.parametrize("body, says", [
    ("raise MemoryError()", "out of memory: an input states a size larger than this machine can hold"),
    ("def f(n): return f(n + 1)\nf(0)", "nested too deeply"),
    ("b'\\xff'.decode('utf-8')", "not valid UTF-8 text"),
    ("open('/no/such/dir/file')", "cannot read or write /no/such/dir/file: No such file or directory"),
    ("{}['missing']", "unexpected KeyError: 'missing' (a bug, or an input no check names: rerun with "
                      "DSA_TRACEBACK=1"),
    ("import numpy as np\nnp.zeros(3) + np.zeros(4)", "unexpected ValueError: operands could not be broadcast"),
    ("int('9' * 5000)", "unexpected ValueError"),
])
def test_an_unexpected_exception_is_one_line_and_exit_2(body, says):
    proc = _run_cli_with(body)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsa probe: error: ") and says in lines[0], lines


def test_ctrl_c_exits_130_without_a_traceback():
    proc = _run_cli_with("raise KeyboardInterrupt()")
    assert proc.returncode == 130 and proc.stderr.strip() == "dsa probe: interrupted"


def test_dsa_traceback_1_shows_the_traceback_to_a_developer():
    proc = _run_cli_with("{}['missing']", env={"DSA_TRACEBACK": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "KeyError" in proc.stderr


def test_dsa_in_a_python_without_the_packages_names_the_package_and_the_environment(tmp_path):
    # The machine's bare Python (no torch): `dsa compile` says what is missing instead of an import traceback.
    bare = shutil.which("python3", path="/usr/bin:/usr/local/bin:/bin")
    if bare is None or subprocess.run([bare, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("no Python without torch on this machine")
    proc = subprocess.run([bare, "-m", "dsa", "compile", "--help"], capture_output=True, text=True,
                          env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(PACKAGE_ROOT)}, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "needs the Python package 'torch'" in proc.stderr and "requirements_lock.txt" in proc.stderr


def _compile(tmp_path: Path, *args) -> subprocess.CompletedProcess:
    return cli("dsa", "compile", "--manifest", MANIFEST, "--out", tmp_path / "out", *args)


@pytest.mark.parametrize("flag", [
    "--iree-hal-dump-executable-files-to={dump}",
    "--dump-compilation-phases-to={dump}",
    "--iree-llvmcpu-static-library-output-path={dump}/lib.o",
    "--mlir-print-ir-after-all",
    "--iree-llvmcpu-link-embedded=false",
])
def test_a_tuning_file_that_would_write_outside_out_is_refused_before_any_stage(tmp_path, flag):
    dump = tmp_path / "elsewhere"
    flag = flag.format(dump=dump)
    tuning = tmp_path / "evil.json"
    tuning.write_text(json.dumps({"format": 1, "family": "custom", "target": "x86_64-v3", "flags": [flag]}))
    proc = _compile(tmp_path, "--tuning", f"x86_64-v3={tuning}")
    line = refused(proc, f"{tuning}: tuning flag '{flag}' is not allowed")
    assert "--iree-opt-level" in line  # the allow-list is named
    assert not dump.exists() and not (tmp_path / "out").exists()


def test_a_targets_dir_spec_that_would_write_outside_out_is_refused_before_any_stage(tmp_path):
    dump = tmp_path / "elsewhere"
    targets = tmp_path / "targets"
    shutil.copytree(TARGETS, targets, ignore=shutil.ignore_patterns("*.bzl", "BUILD*"))
    spec = json.loads((targets / "x86_64-v3.json").read_text())
    spec["flags"].append(f"--iree-hal-dump-executable-files-to={dump}")
    (targets / "x86_64-v3.json").write_text(json.dumps(spec))
    proc = _compile(tmp_path, "--targets-dir", targets, "--target", "x86_64-v3")
    refused(proc, f"{targets / 'x86_64-v3.json'}: target spec flag '--iree-hal-dump-executable-files-to={dump}' "
                  "is not allowed")
    assert not dump.exists() and not (tmp_path / "out").exists()


def test_a_tuning_runtime_flag_of_2_63_bytes_is_refused(tmp_path):
    tuning = tmp_path / "huge.json"
    tuning.write_text(json.dumps({"format": 1, "family": "custom", "target": "x86_64-v3", "flags": [],
                                  "runtime_flags": ["--task_worker_stack_size=9223372036854775807"]}))
    proc = _compile(tmp_path, "--tuning", f"x86_64-v3={tuning}")
    refused(proc, "runtime flag '--task_worker_stack_size=9223372036854775807' needs a positive byte count of "
                  "at most 67108864")
    assert not (tmp_path / "out").exists()
