"""The dsa package's import direction (dsa/tools/layers.py, grimp): the tree as it is passes, and a
deliberately wrong import — a stage importing a tool, the runtime importing torch, two modules of one layer
importing each other — fails, naming the chain."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import dsa

# The runfiles copy (not resolved: under Bazel each file is a symlink into the source tree).
PACKAGE = Path(os.path.abspath(dsa.__file__)).parent


def _check(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([sys.executable, "-m", "dsa.tools.layers"], capture_output=True, text=True, env=env,
                          cwd=root, check=False)


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(PACKAGE, tmp_path / "dsa", ignore=shutil.ignore_patterns("__pycache__", "BUILD.bazel"))
    return tmp_path


def test_the_package_respects_its_layers():
    proc = _check(PACKAGE.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dsa layers: ok" in proc.stdout


def test_a_stage_importing_a_tool_is_refused_naming_the_chain(tmp_path):
    root = _copy(tmp_path)
    compile_py = root / "dsa" / "stages" / "compile.py"
    compile_py.write_text(compile_py.read_text() + "\n\ndef _wrong():\n    from dsa.tools import bench  # noqa\n")
    proc = _check(root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "dsa.stages must not import dsa.tools" in proc.stdout
    assert "dsa.stages.compile -> dsa.tools.bench" in proc.stdout


def test_a_private_name_used_from_another_module_is_refused(tmp_path):
    """`_name` is its module's own: importing it, or reaching for it through the module, from another fails."""
    root = _copy(tmp_path)
    run_py = root / "dsa" / "runtime" / "run.py"
    run_py.write_text(run_py.read_text() + "\n\ndef _wrong():\n    from dsa.runtime.host import _CPUINFO  # noqa\n"
                      "    from dsa.runtime import host\n    return host._cpuinfo_field\n")
    proc = _check(root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "dsa.runtime.run imports dsa.runtime.host._CPUINFO, private to dsa.runtime.host" in proc.stdout
    assert "dsa.runtime.run uses dsa.runtime.host._cpuinfo_field, private to it" in proc.stdout


def test_the_runtime_importing_torch_is_refused(tmp_path):
    root = _copy(tmp_path)
    policy = root / "dsa" / "runtime" / "policy.py"
    policy.write_text(policy.read_text() + "\n\ndef _wrong():\n    import torch  # noqa\n")
    proc = _check(root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "dsa.runtime must not import torch: dsa.runtime.policy -> torch" in proc.stdout


def test_the_runtime_reaching_torch_through_a_stage_is_refused(tmp_path):
    """Through another module counts too: runtime → stages is already upward, and the torch chain is named."""
    root = _copy(tmp_path)
    bundle = root / "dsa" / "runtime" / "bundle.py"
    bundle.write_text(bundle.read_text() + "\n\ndef _wrong():\n    from dsa.stages import spec  # noqa\n")
    proc = _check(root)
    assert proc.returncode == 1
    assert "dsa.runtime must not import dsa.stages" in proc.stdout
    assert "dsa.runtime must not import torch: dsa.runtime.bundle -> dsa.stages.spec -> torch" in proc.stdout


def test_an_import_cycle_inside_a_layer_is_refused_naming_the_cycle(tmp_path):
    """Same layer, so no direction is broken; a lazy import inside a function closes the cycle all the same."""
    root = _copy(tmp_path)
    host = root / "dsa" / "runtime" / "host.py"  # dsa.runtime.policy imports it
    host.write_text(host.read_text() + "\n\ndef _wrong():\n    from dsa.runtime import policy  # noqa\n")
    proc = _check(root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("dsa.runtime must not import in a cycle (dsa.runtime.host, dsa.runtime.policy): "
            "dsa.runtime.host -> dsa.runtime.policy -> dsa.runtime.host") in proc.stdout
    assert proc.stdout.count("cycle") == 1, proc.stdout


def test_a_longer_cycle_is_named_by_its_shortest_loop(tmp_path):
    root = _copy(tmp_path)
    spec = root / "dsa" / "stages" / "spec.py"  # dsa.stages.export imports spec; nothing in stages imports export
    spec.write_text(spec.read_text() + "\n\ndef _wrong():\n    from dsa.stages import export  # noqa\n")
    proc = _check(root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "dsa.stages must not import in a cycle (" in proc.stdout
    assert "dsa.stages.export -> dsa.stages.spec -> dsa.stages.export" in proc.stdout


def test_architecture_doc_names_only_paths_that_exist():
    """docs/architecture.md's "where to add" lists are file lists: a renamed or moved file makes them stale."""
    doc = Path(os.path.abspath("docs/architecture.md"))
    source_root = Path(os.path.realpath(doc)).parents[1]  # the checkout the runfiles link to
    text = doc.read_text(encoding="utf-8")
    paths = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        if "/" in token and not re.search(r"[<*:{]", token) and token.split("/")[0] in (
                "dsa", "rules", "toolchains", "models", "manifests", "tools", "bench", "docs", "tests", "bin"):
            paths.add(token)
    assert len(paths) > 20, sorted(paths)
    missing = sorted(p for p in paths if not (source_root / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
