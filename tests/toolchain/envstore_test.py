"""toolchains/python/envstore.py: the machine's store of installed environments, shared by output bases.

Real venvs and a real pip install (offline: the lock pins a wheel this test writes, by file URL and sha256).
"""

import base64
import hashlib
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

ENVSTORE = Path("toolchains/python/envstore.py")


def _base_python() -> str:
    """The interpreter this test's venv was made from (envstore makes venvs from a base interpreter)."""
    return os.path.realpath(sys._base_executable)


def _wheel(dest: Path, version: str) -> Path:
    """A minimal pure-Python wheel `dsa_probe` whose module holds its version."""
    name = f"dsa_probe-{version}-py3-none-any.whl"
    info = f"dsa_probe-{version}.dist-info"
    files = {
        "dsa_probe/__init__.py": f"VERSION = {version!r}\n".encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: dsa-probe\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: envstore_test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = dest / name
    with zipfile.ZipFile(path, "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
    return path


def _lock(tmp: Path, version: str) -> Path:
    wheel = _wheel(tmp, version)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    lock = tmp / f"lock-{version}.txt"
    lock.write_text(f"dsa-probe @ {wheel.as_uri()} --hash=sha256:{digest}\n")
    return lock


def _envstore(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run([_base_python(), str(ENVSTORE), *args], capture_output=True, text=True, env=env)


def _ensure(store: Path, lock: Path, *pip_args: str) -> subprocess.CompletedProcess:
    return _envstore("--store", str(store), "--lock", str(lock), *[f"--pip-arg={a}" for a in pip_args])


def _probe(venv: str) -> str:
    return subprocess.run([os.path.join(venv, "bin", "python3"), "-c", "import dsa_probe; print(dsa_probe.VERSION)"],
                          check=True, capture_output=True, text=True).stdout.strip()


def test_an_environment_is_installed_once_and_the_next_output_base_gets_the_same_venv(tmp_path):
    lock = _lock(tmp_path, "1.0")
    first = _ensure(tmp_path / "store", lock)
    assert first.returncode == 0, first.stderr
    venv = first.stdout.strip().splitlines()[-1]
    assert _probe(venv) == "1.0"
    marker = Path(venv).parent / "complete.json"
    assert marker.is_file()
    mtime = os.stat(os.path.join(venv, "pyvenv.cfg")).st_mtime_ns
    second = _ensure(tmp_path / "store", lock)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip().splitlines()[-1] == venv
    assert "using" in second.stderr  # not installed again
    assert os.stat(os.path.join(venv, "pyvenv.cfg")).st_mtime_ns == mtime


def test_another_lock_or_other_pip_arguments_get_another_entry(tmp_path):
    store = tmp_path / "store"
    venvs = set()
    for lock, args in ((_lock(tmp_path, "1.0"), ()), (_lock(tmp_path, "2.0"), ()),
                       (_lock(tmp_path, "1.0"), ("--no-compile",))):
        proc = _ensure(store, lock, *args)
        assert proc.returncode == 0, proc.stderr
        venvs.add(proc.stdout.strip().splitlines()[-1])
    assert len(venvs) == 3
    assert sorted(_probe(v) for v in venvs) == ["1.0", "1.0", "2.0"]


def test_a_half_made_entry_is_removed_and_installed_again(tmp_path):
    lock = _lock(tmp_path, "1.0")
    venv = Path(_ensure(tmp_path / "store", lock).stdout.strip().splitlines()[-1])
    # An install interrupted before its marker: what is there must not be used.
    (venv.parent / "complete.json").unlink()
    (venv / "lib").rename(venv.parent / "lost")
    again = _ensure(tmp_path / "store", lock)
    assert again.returncode == 0, again.stderr
    assert "using" not in again.stderr
    assert _probe(str(venv)) == "1.0"
    assert not (venv.parent / "lost").exists()


def test_a_failed_install_leaves_no_entry_and_passes_pips_exit_status(tmp_path):
    lock = _lock(tmp_path, "1.0")
    bad = tmp_path / "bad-lock.txt"
    text = lock.read_text()
    bad.write_text(text[:text.index("sha256:") + len("sha256:")] + "0" * 64 + "\n")  # not the wheel's digest
    store = tmp_path / "store"
    proc = _ensure(store, bad)
    assert proc.returncode != 0
    assert "hash" in proc.stderr.lower()  # pip's own message reaches the repository rule's error
    assert [p.name for p in store.iterdir() if not p.name.endswith(".lock")] == []


def test_two_output_bases_set_up_at_once_install_once_and_share_the_venv(tmp_path):
    lock = _lock(tmp_path, "1.0")
    results = [None, None]

    def run(i):
        results[i] = _ensure(tmp_path / "store", lock)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    venvs = {r.stdout.strip().splitlines()[-1] for r in results}
    assert len(venvs) == 1
    assert sum("using" in r.stderr for r in results) == 1  # the second waited for the first's install
    assert _probe(venvs.pop()) == "1.0"


def test_with_the_store_off_the_venv_is_installed_where_asked_and_nothing_is_kept(tmp_path):
    lock = _lock(tmp_path, "1.0")
    venv = tmp_path / "output-base" / "venv"
    proc = _envstore("--into", str(venv), "--lock", str(lock))
    assert proc.returncode == 0, proc.stderr
    assert _probe(str(venv)) == "1.0"
    assert not (venv.parent / "complete.json").exists()


# ---- Remote execution: a worker image's environments (docs/remote-execution.md) ------------------------------

def test_a_worker_image_holds_the_environment_at_its_lock_digest_linked_from_the_store(tmp_path):
    lock = _lock(tmp_path, "1.0")
    image, store = tmp_path / "image", tmp_path / "store"
    proc = _envstore("--image-root", str(image), "--store", str(store), "--lock", str(lock))
    assert proc.returncode == 0, proc.stderr
    lock_sha = hashlib.sha256(lock.read_bytes()).hexdigest()
    venv = image / lock_sha / "venv"
    assert proc.stdout.strip().splitlines()[-1] == str(venv)
    assert venv.is_symlink() and Path(os.path.realpath(venv)).parent.parent == store.resolve()
    assert _probe(str(venv)) == "1.0"
    again = _envstore("--image-root", str(image), "--store", str(store), "--lock", str(lock))
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == str(venv)


def test_a_worker_image_without_a_store_installs_the_environment_at_its_lock_digest(tmp_path):
    lock = _lock(tmp_path, "2.0")
    image = tmp_path / "image"
    proc = _envstore("--image-root", str(image), "--lock", str(lock))
    assert proc.returncode == 0, proc.stderr
    venv = image / hashlib.sha256(lock.read_bytes()).hexdigest() / "venv"
    assert venv.is_dir() and not venv.is_symlink()
    assert _probe(str(venv)) == "2.0"


def test_store_into_and_image_root_cannot_be_mixed(tmp_path):
    lock = _lock(tmp_path, "1.0")
    proc = _envstore("--into", str(tmp_path / "v"), "--image-root", str(tmp_path / "i"), "--lock", str(lock))
    assert proc.returncode == 2 and "give one of --store, --into, --image-root" in proc.stderr
    assert _envstore("--lock", str(lock)).returncode == 2
