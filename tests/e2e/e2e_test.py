"""End-to-end test: a user's workspace that uses rules_dsa as an external repository, built by a real Bazel.

The session fixture copies the rule set (//:rules_dsa_files, from the runfiles, as real files) and the
workspace template (workspace/: a tiny policy, its manifest and a BUILD loading @rules_dsa) into $TEST_TMPDIR,
and runs /usr/bin/bazel there in its own output root, so nothing is shared with the Bazel running this test.
The first nested build creates the Python environment (pip) and runs every action; the tests after it reuse
that output root. Each test that edits the workspace restores it afterwards.

Which actions ran is read from `--execution_log_json_file`: an action that Bazel found up to date spawns
nothing and is not in the log.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from dsa.tools.execlog import executed_mnemonics, read_execution_log

RUNFILES = Path(os.environ["TEST_SRCDIR"]) / os.environ["TEST_WORKSPACE"]
TEMPLATE = RUNFILES / "tests" / "e2e" / "workspace"
BAZEL = shutil.which("bazel") or "/usr/bin/bazel"

# Template files stored under another name, so that this repository's Bazel sees no nested package or
# workspace in tests/e2e/workspace.
TEMPLATE_NAMES = {"WORKSPACE.in": "WORKSPACE", "BUILD.in": "BUILD.bazel", "bazelrc.in": ".bazelrc"}
PLACEHOLDER = "@RULES_DSA@"

TARGET = "//:tiny"
BUCKETS = [4, 8]
# The sha256 tiny.yaml pins: the seeded checkpoint dsa_checkpoint writes, byte-identical on every machine.
PINNED_SHA = re.search(r'sha256: "([0-9a-f]{64})"', (TEMPLATE / "tiny.yaml").read_text()).group(1)
# The rule set as tracked in git: these directories and root files (checked against //:rules_dsa_files).
RULE_SET_DIRS = ["dsa", "rules", "toolchains"]
RULE_SET_ROOT_FILES = [
    "BUILD.bazel", "MODULE.bazel", "WORKSPACE.bazel", "WORKSPACE.bzlmod", "requirements.in",
    "requirements_lock.txt",
]


# ---------------------------------------------------------------------------------------------------------
# Helpers


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _client_env(home: Path) -> Dict[str, str]:
    """The environment of the nested Bazel client: a user's shell, reduced to what matters.

    python3.11 on PATH (the interpreter this test's venv was made from), as dsa_python_env looks it up; the
    machine's pip configuration (the user's pip.conf, PIP_* variables, proxies), which dsa_python_env applies
    as is. HOME is a fresh directory: no ~/.bazelrc, no caches of earlier runs.
    """
    base = Path(sys._base_executable).parent
    if not (base / "python3.11").exists():
        base = Path(sys.base_prefix) / "bin"
    user = pwd.getpwuid(os.getuid())
    env = {
        "PATH": os.pathsep.join([str(base), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": str(home),
        "USER": user.pw_name,
        "LANG": "C.UTF-8",
    }
    for key, value in os.environ.items():
        if key.startswith("PIP_") or key == "DSA_PYTHON" or key.lower() in ("http_proxy", "https_proxy", "no_proxy"):
            env[key] = value
    if "PIP_CONFIG_FILE" not in env:
        real_home = Path(user.pw_dir)
        for candidate in (real_home / ".config" / "pip" / "pip.conf", real_home / ".pip" / "pip.conf"):
            if candidate.is_file():
                env["PIP_CONFIG_FILE"] = str(candidate)
                break
    return env


def _rmtree(path: Path) -> None:
    """rmtree that also removes Bazel's read-only outputs."""

    def make_writable_and_retry(func, p, _exc):
        os.chmod(os.path.dirname(p), stat.S_IRWXU)
        if os.path.lexists(p) and not os.path.islink(p):
            os.chmod(p, stat.S_IRWXU)
        func(p)

    if path.exists():
        shutil.rmtree(path, onerror=make_writable_and_retry)


class Workspace:
    """The user workspace in $TEST_TMPDIR and the Bazel that builds it."""

    def __init__(self, root: Path):
        self.root = root
        self.rules_dsa = root / "rules_dsa"
        self.path = root / "ws"
        self.bin = self.path / "bazel-bin"
        self.output_user_root = root / "output_root"
        self.logs = root / "logs"
        self.logs.mkdir(parents=True)
        home = root / "home"
        home.mkdir()
        self.env = _client_env(home)
        self.timings: List[tuple] = []
        self._builds = 0

    def bazel(self, *args: str, expect_ok: Optional[bool] = True, timeout: int = 3000) -> subprocess.CompletedProcess:
        """Runs `bazel ARGS` in the workspace; fails the test unless it succeeds (or fails, for expect_ok=False)."""
        command = [
            BAZEL,
            f"--output_user_root={self.output_user_root}",
            "--nohome_rc",
            # A safety net: the fixture shuts the server down, but never leave one behind for long.
            "--max_idle_secs=600",
            *args,
        ]
        start = time.monotonic()
        proc = subprocess.run(command, cwd=self.path, env=self.env, capture_output=True, text=True, timeout=timeout)
        self.timings.append((" ".join(args[:1]), proc.returncode, time.monotonic() - start))
        if expect_ok is not None and (proc.returncode == 0) != expect_ok:
            raise AssertionError(
                f"`bazel {' '.join(args)}` exited {proc.returncode}, expected "
                f"{'success' if expect_ok else 'failure'}\n--- stderr (tail) ---\n{proc.stderr[-8000:]}"
            )
        return proc

    def build(self, *targets: str, expect_ok: Optional[bool] = True):
        """`bazel build` with an execution log; returns (CompletedProcess, log entries)."""
        self._builds += 1
        log = self.logs / f"build{self._builds}.json"
        proc = self.bazel(
            "build", "--color=no", "--curses=no", f"--execution_log_json_file={log}",
            *(targets or (TARGET,)), expect_ok=expect_ok,
        )
        entries = read_execution_log(log)
        ran = executed_mnemonics(entries)
        self.timings[-1] += (" ".join(f"{m}x{n}" for m, n in sorted(ran.items())) or "nothing ran",)
        return proc, entries

    # Outputs of //:tiny and the targets under it.
    @property
    def vmfbs(self) -> List[Path]:
        return [self.bin / "tiny" / f"seq_len_{slot}.vmfb" for slot in range(len(BUCKETS))]

    @property
    def irpa(self) -> Path:
        return self.bin / "tiny_model" / "params.irpa"

    @property
    def model_mlir(self) -> Path:
        return self.bin / "tiny_model" / "model.mlir"

    @property
    def index(self) -> Path:
        return self.bin / "tiny.modules.json"


def _install_rule_set(dest: Path) -> None:
    """Copies //:rules_dsa_files out of the runfiles, as real files (the runfiles are symlinks)."""
    for dirpath, dirnames, filenames in os.walk(RUNFILES):
        rel = Path(dirpath).relative_to(RUNFILES)
        # Skip this test's own files and external/ (Bazel's legacy runfiles copy of the Python toolchain).
        if rel.parts[:1] in (("tests",), ("external",)):
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            shutil.copy2(Path(dirpath) / name, dest / rel / name)  # follows the symlink


def _outer_python_env() -> Optional[Path]:
    """The dsa_python_env repository this test runs in (its interpreter is <repo>/venv/bin/python3), if it is
    one: made from the same requirements_lock.txt the nested workspace's dsa_python names."""
    repo = Path(sys.executable).parents[2]
    return repo if all((repo / f).exists() for f in ("identity.json", "WORKSPACE", "BUILD.bazel")) else None


def _install_workspace(dest: Path, rules_dsa: Path) -> None:
    for src in sorted(TEMPLATE.rglob("*")):
        if src.is_dir() or "__pycache__" in src.parts:
            continue
        rel = src.relative_to(TEMPLATE)
        target = dest / rel.parent / TEMPLATE_NAMES.get(rel.name, rel.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(src.read_bytes().replace(PLACEHOLDER.encode(), str(rules_dsa).encode()))
    # The nested workspace's @dsa_python is this test's own environment (the same lock, so the same
    # identity.json and action keys), not a fresh pip install: that took ~3 of this exclusive test's 6 min.
    # Creating the environment in a fresh output base is what tests/bundle/repro.sh and
    # tests/remote_cache/run.sh exercise.
    outer = _outer_python_env()
    if outer is not None:
        with open(dest / ".bazelrc", "a") as rc:
            rc.write(f"\n# Added by e2e_test.py: the test's own environment (see _install_workspace).\n"
                     f"build --override_repository=dsa_python={outer}\n")


@pytest.fixture(scope="session")
def ws(request):
    root = Path(os.environ["TEST_TMPDIR"]) / "e2e"
    _rmtree(root)
    workspace = Workspace(root)
    _install_rule_set(workspace.rules_dsa)
    _install_workspace(workspace.path, workspace.rules_dsa)
    try:
        yield workspace
    finally:
        workspace.bazel("shutdown", expect_ok=None, timeout=300)
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():  # into the test log, past pytest's capture
            print("\ne2e: nested bazel commands:")
            for cmd, rc, seconds, *ran in workspace.timings:
                print(f"  {cmd}: exit {rc}, {seconds:.1f}s{': ' + ran[0] if ran else ''}")
        if not os.environ.get("DSA_E2E_KEEP"):  # --test_env=DSA_E2E_KEEP=1 keeps the output root to inspect
            _rmtree(workspace.output_user_root)


class Edits:
    """Edits of workspace files, undone after the test."""

    def __init__(self, root: Path):
        self.root = root
        self._saved: Dict[Path, Optional[bytes]] = {}

    def _save(self, path: Path) -> None:
        if path not in self._saved:
            self._saved[path] = path.read_bytes() if path.exists() else None

    def replace(self, name: str, old: str, new: str) -> None:
        path = self.root / name
        self._save(path)
        text = path.read_text(encoding="utf-8")
        assert text.count(old) == 1, f"{name}: expected exactly one {old!r}"
        path.write_text(text.replace(old, new), encoding="utf-8")

    def create(self, name: str) -> Path:
        path = self.root / name
        self._save(path)
        return path

    def restore(self) -> None:
        for path, content in self._saved.items():
            if content is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(content)


@pytest.fixture
def edits(ws):
    e = Edits(ws.path)
    try:
        yield e
    finally:
        e.restore()


def _write_finetuned_checkpoint(seeded: Path, out: Path) -> None:
    """A different checkpoint of the same architecture, as a training run would produce: same tensors,
    same shapes and dtypes, other values."""
    from safetensors.numpy import load_file, save_file

    tensors = {name: (value * 0.5 + 0.01).astype(value.dtype) for name, value in load_file(str(seeded)).items()}
    save_file(tensors, str(out), metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------------------
# Tests, in order: the first build is shared by the rest.


def test_rules_dsa_files_lists_every_tracked_file_of_the_rule_set(ws):
    """//:rules_dsa_files is a list (a glob stops at package boundaries): catch a file added to the rule set
    but not to the list before a user does."""
    source_root = Path(os.path.realpath(RUNFILES / "WORKSPACE.bazel")).parent
    git = shutil.which("git")
    if git is None or not (source_root / ".git").exists():
        pytest.skip("the runfiles do not lead back to a git checkout")
    tracked = subprocess.run(
        [git, "ls-files", "--", *RULE_SET_DIRS, *RULE_SET_ROOT_FILES],
        cwd=source_root, capture_output=True, text=True, check=True,
    ).stdout.split()
    missing = sorted(f for f in tracked if not (ws.rules_dsa / f).exists())
    assert not missing, f"add these files to //:rules_dsa_files (BUILD.bazel): {', '.join(missing)}"


def test_build_produces_vmfb_per_bucket_and_param_archive(ws):
    _, log = ws.build()
    ran = executed_mnemonics(log)
    # The model export, one export per bucket; one compile per bucket; one archive; one seeded checkpoint.
    assert ran["DsaExport"] == 1 + len(BUCKETS), ran
    assert ran["DsaCompile"] == len(BUCKETS), ran
    assert ran["DsaParams"] == 1, ran
    assert ran["DsaCheckpoint"] == 1, ran

    for vmfb in ws.vmfbs:
        assert vmfb.is_file() and vmfb.stat().st_size > 0, vmfb
    assert ws.irpa.is_file() and ws.irpa.stat().st_size > 0
    assert sha256(ws.bin / "tiny.safetensors") == PINNED_SHA, "dsa_checkpoint is not byte-identical across machines"

    index = json.loads(ws.index.read_text())
    base = ws.index.parent
    assert (base / index["parameter_archive"]).resolve() == ws.irpa.resolve()
    # Every file the index names resolves from bazel-bin itself (not only from a runfiles tree).
    for key in ("target_spec", "runtime_view"):
        assert (base / index[key]).is_file(), key
    assert [(base / m["vmfb"]).resolve() for m in index["modules"]] == [v.resolve() for v in ws.vmfbs]
    sizes = [json.loads((base / m["record"]).read_text())["bucket"]["size"] for m in index["modules"]]
    assert sizes == BUCKETS

    # Weights are named parameters resolved from the .irpa at run time, never inlined into the module.
    mlir = ws.model_mlir.read_text()
    assert "#flow.parameter.named" in mlir
    assert "dense_resource" not in mlir
    assert "!torch.vtensor<[1,?,8],f32>" in mlir, "seq_len should stay dynamic in the model's own export"


def test_second_build_executes_nothing(ws):
    _, log = ws.build()
    assert not [m for m in executed_mnemonics(log) if m.startswith("Dsa")], executed_mnemonics(log)
    assert log == [], f"a no-op rebuild spawned {executed_mnemonics(log)}"


def test_new_checkpoint_reruns_params_only(ws, edits):
    modules_before = {v: sha256(v) for v in ws.vmfbs + [ws.model_mlir]}
    irpa_before = sha256(ws.irpa)

    # The user drops a fine-tuned checkpoint into the workspace, points dsa_model at it, and pins it.
    finetuned = edits.create("finetuned.safetensors")
    _write_finetuned_checkpoint(ws.bin / "tiny.safetensors", finetuned)
    edits.replace("BUILD.bazel", 'checkpoint = ":tiny.safetensors"', 'checkpoint = ":finetuned.safetensors"')
    edits.replace("tiny.yaml", "path: tiny.safetensors", "path: finetuned.safetensors")
    edits.replace("tiny.yaml", PINNED_SHA, sha256(finetuned))

    _, log = ws.build()
    ran = executed_mnemonics(log)
    assert ran["DsaParams"] == 1, ran
    assert ran["DsaExport"] == 0 and ran["DsaCompile"] == 0 and ran["DsaCheckpoint"] == 0, ran
    # Besides the archive, only the cheap manifest projections (the manifest file changed) and the recipe
    # lock (it records the checkpoint's and the archive's digests) may run.
    assert set(ran) <= {"DsaParams", "DsaManifest", "DsaLock"}, ran
    assert sha256(ws.irpa) != irpa_before
    assert {v: sha256(v) for v in modules_before} == modules_before


def test_changed_checkpoint_without_new_sha_is_refused(ws, edits):
    finetuned = edits.create("finetuned.safetensors")
    _write_finetuned_checkpoint(ws.bin / "tiny.safetensors", finetuned)
    edits.replace("BUILD.bazel", 'checkpoint = ":tiny.safetensors"', 'checkpoint = ":finetuned.safetensors"')

    proc, _ = ws.build(expect_ok=False)
    assert "tiny.yaml" in proc.stderr and "checkpoint.sha256" in proc.stderr, proc.stderr[-4000:]
    assert sha256(finetuned) in proc.stderr, "the message should give the digest to pin"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    # No archive of the earlier checkpoint is left where the refused one would be.
    assert not ws.irpa.exists()


def test_manifest_missing_field_fails_with_clear_message(ws, edits):
    edits.replace("tiny.yaml", "chunk_size: 4\n", "")

    proc, _ = ws.build(expect_ok=False)
    # A missing field has no line of its own: `tiny.yaml: chunk_size: missing required field (...)`.
    assert re.search(r"tiny\.yaml(:\d+)?: chunk_size: missing required field", proc.stderr), proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


def test_bucket_count_mismatch_names_the_fix(ws, edits):
    edits.replace("tiny.yaml", "seq_len: [4, 8]", "seq_len: [4, 8, 16]")

    proc, _ = ws.build(expect_ok=False)
    assert "the manifest lists 3 bucket(s) but //:tiny_buckets declares count = 2" in proc.stderr, (
        proc.stderr[-4000:]
    )
    assert "set count = 3 on //:tiny_buckets" in proc.stderr, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


@pytest.mark.parametrize(
    "old, new",
    [
        ("power_profile: balanced", "power_profile: efficiency"),
        ("flow_steps: 3", "flow_steps: 7"),
        ("n_action_steps: 2", "n_action_steps: 1"),
    ],
    ids=["power_profile", "flow_steps", "n_action_steps"],
)
def test_runtime_only_field_executes_no_export_params_or_compile(ws, edits, old, new):
    """These fields live in the runtime view only: editing one re-validates the manifest (DsaManifest),
    rewrites the runtime view and the lock that records its digest (DsaLock), and runs nothing else."""
    ws.build()
    edits.replace("tiny.yaml", old, new)
    _, log = ws.build()
    ran = executed_mnemonics(log)
    assert ran["DsaExport"] == ran["DsaParams"] == ran["DsaCompile"] == 0, ran
    assert ran["DsaManifest"] >= 1 and ran["DsaLock"] == 1, ran
    assert set(ran) <= {"DsaManifest", "DsaLock"}, ran


def test_target_change_recompiles_without_exporting(ws, edits):
    """Switching the dsa_vmfb to another target the manifest lists recompiles every bucket for it and
    exports nothing, and the vmfbs differ (another CPU level)."""
    ws.build()
    before = [v.read_bytes() for v in ws.vmfbs]
    edits.replace("tiny.yaml", "targets: [x86_64-v3]", "targets: [x86_64-v3, x86_64-v4]")
    edits.replace("BUILD.bazel", "toolchains/targets:x86_64-v3", "toolchains/targets:x86_64-v4")
    _, log = ws.build()
    ran = executed_mnemonics(log)
    assert ran["DsaCompile"] == len(BUCKETS) and ran["DsaExport"] == ran["DsaParams"] == 0, ran
    assert [v.read_bytes() for v in ws.vmfbs] != before


def test_a_target_of_the_users_own_builds_with_no_change_to_the_rule_set(ws, edits):
    """A dsa_target in the user's workspace, with a spec of its own (a RISC-V board without the vector
    extension), chosen for the whole build with --@rules_dsa//:target: every bucket compiles for it (RISC-V
    executables in the vmfbs), nothing is exported or packed again, and the module index names the target."""
    ws.build()
    (ws.path / "board").mkdir(exist_ok=True)
    edits.create("board/my-riscv.json").write_text(json.dumps({
        "name": "my-riscv",
        "description": "a RISC-V board of the user's own: RV64GC, no vector extension",
        "device": "local",
        "backends": ["llvm-cpu"],
        "runtime_driver": "local-task",
        "flags": ["--iree-hal-local-target-device-backends=llvm-cpu",
                  "--iree-llvmcpu-target-triple=riscv64-unknown-linux-gnu",
                  "--iree-llvmcpu-target-cpu=generic-rv64", "--iree-llvmcpu-target-abi=lp64d",
                  "--iree-llvmcpu-target-cpu-features=+m,+a,+f,+d,+c"],
        "executable_formats": ["embedded-elf-riscv_64"],
        "host": {"arch": "riscv64", "cpu_features": []},
    }))
    edits.create("board/BUILD.bazel").write_text(
        'load("@rules_dsa//rules:defs.bzl", "dsa_target")\n\n'
        'dsa_target(name = "my-riscv", spec = "my-riscv.json", visibility = ["//visibility:public"])\n')
    edits.replace("tiny.yaml", "targets: [x86_64-v3]", "targets: [x86_64-v3, my-riscv]")
    _, log = ws.build(TARGET, "--@rules_dsa//:target=//board:my-riscv")
    ran = executed_mnemonics(log)
    assert ran["DsaCompile"] == len(BUCKETS) and ran["DsaExport"] == ran["DsaParams"] == 0, ran
    for vmfb in ws.vmfbs:
        data = vmfb.read_bytes()
        assert b"embedded-elf-riscv_64" in data and b"embedded-elf-x86_64" not in data, vmfb
    index = json.loads((ws.bin / "tiny.modules.json").read_text())
    assert index["target"] == "my-riscv", index


def test_tuning_file_edit_recompiles_only_the_modules_that_name_it(ws, edits):
    """A dsa_vmfb's tuning file (toolchains/tuning format) is an input of its compile actions only: naming
    one, then changing its flags, recompiles every bucket and exports or packs nothing; the flags reach the
    vmfbs. A flag the target owns is refused, naming the flag."""
    ws.build()
    before = [v.read_bytes() for v in ws.vmfbs]
    tuning = edits.create("tiny.x86_64-v3.json")
    tuning.write_text(json.dumps({"format": 1, "family": "tiny", "target": "x86_64-v3", "flags": []}))
    edits.replace("BUILD.bazel", '    target = "@rules_dsa//toolchains/targets:x86_64-v3",\n',
                  '    target = "@rules_dsa//toolchains/targets:x86_64-v3",\n    tuning = "tiny.x86_64-v3.json",\n')
    _, log = ws.build()
    ran = executed_mnemonics(log)
    assert ran["DsaCompile"] == len(BUCKETS) and ran["DsaExport"] == ran["DsaParams"] == 0, ran
    assert [v.read_bytes() for v in ws.vmfbs] == before  # no flags yet: the same modules
    tuning.write_text(json.dumps({"format": 1, "family": "tiny", "target": "x86_64-v3",
                                  "flags": ["--iree-opt-data-tiling"]}))
    _, log = ws.build()
    ran = executed_mnemonics(log)
    assert ran["DsaCompile"] == len(BUCKETS) and ran["DsaExport"] == ran["DsaParams"] == 0, ran
    assert [v.read_bytes() for v in ws.vmfbs] != before
    assert "--iree-opt-data-tiling" in json.loads((ws.bin / "tiny.lock.json").read_text())["tuning"]["flags"]
    tuning.write_text(json.dumps({"format": 1, "family": "tiny", "target": "x86_64-v3",
                                  "flags": ["--iree-llvmcpu-target-cpu=znver4"]}))
    proc, _ = ws.build(expect_ok=False)
    assert "tuning flag '--iree-llvmcpu-target-cpu=znver4' is not allowed" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_quant_scheme_edit_reexports_repacks_and_recompiles(ws, edits):
    """quant_scheme shapes the graph (packed weights), the archive (quantised tensors) and the compile flags:
    editing it reruns all three, and the archive shrinks."""
    ws.build()
    irpa_size = ws.irpa.stat().st_size
    edits.replace("tiny.yaml", "kind: none", "kind: int8")
    _, log = ws.build()
    ran = executed_mnemonics(log)
    assert ran["DsaExport"] == 1 + len(BUCKETS) and ran["DsaParams"] == 1, ran
    assert ran["DsaCompile"] == len(BUCKETS), ran
    assert ws.irpa.stat().st_size < irpa_size


def test_target_not_in_manifest_is_refused(ws, edits):
    edits.replace("BUILD.bazel", "toolchains/targets:x86_64-v3", "toolchains/targets:x86_64-v4")
    proc, _ = ws.build(expect_ok=False)
    assert "x86_64-v4" in proc.stderr and "targets" in proc.stderr and "Traceback" not in proc.stderr


def test_one_bucket_edit_reexports_and_recompiles_only_that_bucket(ws, edits):
    ws.build()
    before = [v.read_bytes() for v in ws.vmfbs]
    edits.replace("tiny.yaml", f"seq_len: [{BUCKETS[0]}, {BUCKETS[1]}]", f"seq_len: [{BUCKETS[0]}, {BUCKETS[1] * 2}]")
    _, log = ws.build()
    ran = executed_mnemonics(log)
    assert ran["DsaExport"] == 1 and ran["DsaCompile"] == 1 and ran["DsaParams"] == 0, ran
    after = [v.read_bytes() for v in ws.vmfbs]
    assert after[0] == before[0] and after[1] != before[1]


# ---------------------------------------------------------------------------------------------------------
# The rule set's own code: a tool is in no action's inputs; a stage reruns what runs it.


@pytest.fixture
def rule_set_edits(ws):
    e = Edits(ws.rules_dsa)
    try:
        yield e
    finally:
        e.restore()


def _append_comment(edits: Edits, name: str) -> None:
    path = edits.create(name)
    path.write_text(path.read_text(encoding="utf-8") + "\n# an edit that changes no behaviour\n", encoding="utf-8")


@pytest.mark.parametrize("tool", ["dsa/tools/bench/timing.py", "dsa/tools/profiler/model.py", "dsa/tools/diff.py",
                                  "dsa/tools/pipeline.py", "dsa/tools/bundle_cli.py"])
def test_editing_a_tool_module_runs_no_action_and_keeps_the_bundle(ws, rule_set_edits, tool):
    """Tools (dsa/tools/) are in no action's inputs and not in the recipe lock: editing one executes nothing,
    and the release bundle keeps its sha256."""
    ws.build(TARGET, "//:tiny_bundle")
    bundle = (ws.bin / "tiny_bundle.sha256").read_text()
    lock = sha256(ws.bin / "tiny.lock.json")
    _append_comment(rule_set_edits, tool)
    _, log = ws.build(TARGET, "//:tiny_bundle")
    assert log == [], f"editing {tool} spawned {executed_mnemonics(log)}"
    assert (ws.bin / "tiny_bundle.sha256").read_text() == bundle
    assert sha256(ws.bin / "tiny.lock.json") == lock


@pytest.mark.parametrize(
    "stage, reruns",
    [
        ("dsa/stages/compile.py", {"DsaCompile": len(BUCKETS)}),
        ("dsa/stages/params.py", {"DsaParams": 1}),
        ("dsa/stages/export.py", {"DsaExport": 1 + len(BUCKETS), "DsaCheckpoint": 1}),
    ],
    ids=["compile", "params", "export"],
)
def test_editing_a_stage_module_reruns_that_stage_and_the_lock(ws, rule_set_edits, stage, reruns):
    """A stage's code is an input of the actions that run it and recorded in the lock: editing it reruns that
    stage (and the lock, which records its digest), nothing else; an edit that changes no behaviour gives
    the same modules and archive."""
    ws.build(TARGET, "//:tiny_bundle")
    before = {p: sha256(p) for p in ws.vmfbs + [ws.irpa, ws.model_mlir]}
    lock = json.loads((ws.bin / "tiny.lock.json").read_text())
    assert stage in lock["tool_sources"], sorted(lock["tool_sources"])
    assert not [k for k in lock["tool_sources"] if k.startswith(("dsa/tools/", "dsa/runtime/"))], lock["tool_sources"]
    _append_comment(rule_set_edits, stage)
    _, log = ws.build(TARGET, "//:tiny_bundle")
    ran = executed_mnemonics(log)
    for mnemonic, count in reruns.items():
        assert ran[mnemonic] == count, ran
    assert ran["DsaLock"] == 1 and ran["DsaBundle"] == 1, ran
    assert set(ran) <= set(reruns) | {"DsaLock", "DsaBundle"}, ran
    assert {p: sha256(p) for p in before} == before
    assert json.loads((ws.bin / "tiny.lock.json").read_text())["tool_sources"][stage] != lock["tool_sources"][stage]


# ---------------------------------------------------------------------------------------------------------
# A user's own Python environment. Last: it rebuilds everything in another environment, which the tests
# above would otherwise see as reruns.

# What a user's WORKSPACE adds before rules_dsa's registrations (docs/python-environments.md).
USER_ENV = "my_python"
_USER_ENV_WORKSPACE = f"""dsa_python_env(
    name = "{USER_ENV}",
    lock = "//:my_lock.txt",
)

register_toolchains(
    "@{USER_ENV}//:dsa_toolchain",
    "@{USER_ENV}//:python_toolchain",
)

"""
_DSA_PYTHON_PATH = re.compile(r"(^|/)dsa_python/")


def _use_own_environment(ws: Workspace, edits: Edits) -> None:
    """The user's WORKSPACE makes its own environment from a lock of its own and registers it first. The lock
    is rules_dsa's, and the repository this test's own environment (as for @dsa_python): no pip install."""
    edits.create("my_lock.txt").write_bytes((ws.rules_dsa / "requirements_lock.txt").read_bytes())
    edits.replace("WORKSPACE", "register_toolchains(\n", _USER_ENV_WORKSPACE + "register_toolchains(\n")
    outer = _outer_python_env()
    if outer is not None:
        rc = edits.create(".bazelrc")
        rc.write_text(rc.read_text(encoding="utf-8") + f"build --override_repository={USER_ENV}={outer}\n",
                      encoding="utf-8")


def test_a_users_own_environment_registered_first_runs_every_dsa_action(ws, edits):
    """A workspace that registers its own dsa_python_env (another repository name) before rules_dsa's builds
    the policy in it: every Dsa action takes that repository's identity.json and interpreter, and nothing of
    @dsa_python."""
    _use_own_environment(ws, edits)
    _, log = ws.build()
    ran = executed_mnemonics(log)
    # Another environment is another action key: the policy is built again, in it.
    assert ran["DsaExport"] == 1 + len(BUCKETS) and ran["DsaCompile"] == len(BUCKETS), ran
    dsa_spawns = [e for e in log if e.get("mnemonic", "").startswith("Dsa")]
    for spawn in dsa_spawns:
        inputs = [i["path"] for i in spawn.get("inputs", [])]
        mnemonic = spawn["mnemonic"]
        assert f"external/{USER_ENV}/identity.json" in inputs, (mnemonic, [p for p in inputs if "identity" in p])
        assert any(p.endswith(f"{USER_ENV}/bin/python3") for p in inputs), (mnemonic, "no interpreter of " + USER_ENV)
        assert not [p for p in inputs if _DSA_PYTHON_PATH.search(p)], (mnemonic, [p for p in inputs if _DSA_PYTHON_PATH.search(p)])
        assert not [a for a in spawn.get("commandArgs", []) if _DSA_PYTHON_PATH.search(a)], (mnemonic, spawn["commandArgs"])
    lock = json.loads((ws.bin / "tiny.lock.json").read_text())
    assert lock["toolchain"]["lock_sha256"] == hashlib.sha256((ws.path / "my_lock.txt").read_bytes()).hexdigest(), lock["toolchain"]


def test_a_toolchain_that_is_no_dsa_python_toolchain_is_refused_naming_what_to_register(ws, edits):
    """A toolchain of rules_dsa's type whose target is not a dsa_python_toolchain (here a Python runtime pair)
    fails the build's analysis with a message saying what to register."""
    _use_own_environment(ws, edits)
    build = edits.create("BUILD.bazel")
    build.write_text(build.read_text(encoding="utf-8") + f"""
toolchain(
    name = "not_a_dsa_toolchain",
    toolchain = "@{USER_ENV}//:runtime_pair",
    toolchain_type = "@rules_dsa//toolchains/python:toolchain_type",
)
""", encoding="utf-8")
    edits.replace("WORKSPACE", f'    "@{USER_ENV}//:dsa_toolchain",\n', '    "//:not_a_dsa_toolchain",\n')
    proc, _ = ws.build(expect_ok=False)
    assert "is not a dsa_python_toolchain (no DsaPythonInfo)" in proc.stderr, proc.stderr[-4000:]
    assert "register a dsa_python_env's `:dsa_toolchain`" in proc.stderr, proc.stderr[-4000:]
