"""Releasing a bundle: verify it (and, given the signer's public key, its signature), then copy the archive, its
NAME.sha256 and its signature into a directory. `dsa bundle release` and `dsa_release`'s `bazel run`.

    dsa bundle release NAME.tar DEST [--key KEY.pub.pem]
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import List, Optional, Tuple

from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import atomic_output, sha256_file
from dsa.core.tarfiles import digest_line, sidecar_path
from dsa.runtime.bundle import open_bundle, user_path
from dsa.runtime.signing import signature_path, verify_signature


def release(archive: Path, dest: Path, *, public_key: Optional[Path] = None) -> Tuple[Path, Path]:
    """Verifies `archive`, then copies it and its NAME.sha256 into directory `dest` (created if missing). With
    `public_key`, the archive must carry a valid signature by it (NAME.dsse.json), which is copied too."""
    archive = Path(archive)
    if public_key is not None:
        verify_signature(archive, public_key)
    with open_bundle(archive) as b:
        sha = b.sha256
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise DsaError(str(dest), "exists and is not a directory", "pass a directory to release into")
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / archive.name
    with atomic_output(out) as tmp:
        shutil.copyfile(archive, tmp)
        os.chmod(tmp, 0o644)  # Bazel's outputs are read-only
    if sha256_file(out) != sha:
        raise DsaError(str(out), "differs from the verified archive after copying", "check the disk")
    digest = sidecar_path(out)
    with atomic_output(digest) as tmp:
        tmp.write_text(digest_line(sha, out.name), encoding="utf-8")
    if public_key is not None:
        with atomic_output(signature_path(out)) as tmp:
            shutil.copyfile(signature_path(archive), tmp)
    return out, digest


def add_release_arguments(r: argparse.ArgumentParser) -> None:
    r.add_argument("bundle")
    r.add_argument("dest", help="directory (created if missing); relative to where `bazel run` was started")
    r.add_argument("--key", help="the signer's public key (KEY.pub.pem): release only a bundle it signed, and "
                   "ship the signature beside it")


def release_command(a: argparse.Namespace) -> None:
    # DEST is always relative to where `bazel run` was started (the runfiles tree is no place for it).
    dest = Path(os.environ.get("BUILD_WORKING_DIRECTORY", ".")) / a.dest
    archive, digest = release(user_path(a.bundle), dest, public_key=user_path(a.key) if a.key else None)
    print(f"released {archive} and {digest.name}: sha256 {digest.read_text(encoding='utf-8').split()[0]}")


def main(argv: Optional[List[str]] = None) -> None:
    """`release BUNDLE DEST [--key KEY.pub.pem]` (dsa_release's `bazel run`)."""
    parser = argparse.ArgumentParser(prog="dsa bundle", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_release_arguments(sub.add_parser("release", help="verify a bundle, then copy it and its .sha256 into DEST"))
    release_command(parser.parse_args(argv))


if __name__ == "__main__":
    run_cli(main, "dsa bundle")
