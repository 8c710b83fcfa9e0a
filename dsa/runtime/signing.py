"""Signed bundles: a DSSE envelope over an in-toto statement naming the archive by sha256, signed with ed25519.

    dsa keygen KEY                         # KEY.pem (private, keep it secret) and KEY.pub.pem
    dsa sign NAME.tar --key KEY.pem        # verifies the bundle, then writes NAME.dsse.json beside it
    dsa verify NAME.tar --key KEY.pub.pem  # the bundle's checks, then the signature (refused if absent)
    dsa run NAME.tar --require-signature KEY.pub.pem

The envelope (https://github.com/secure-systems-lab/dsse) holds, base64-encoded, the statement

    {"_type": "https://in-toto.io/Statement/v1", "subject": [{"name": "NAME.tar", "digest": {"sha256": ...}}],
     "predicateType": "https://rules-dsa.invalid/signed-bundle/v1", "predicate": {"model_id", "target", ...}}

and one ed25519 signature over DSSE's pre-authentication encoding of (payloadType, payload); `keyid` is the
sha256 of the raw public key. Verifying checks the signature with the given public key, then that the signed
digest is the archive's: a bundle whose bytes changed after signing (weights swapped and every digest inside
recomputed) is refused, and so is an unsigned one when a signature is required. What signing does not do: it
says who signed, not that the build was honest; keep the private key off the build machines that anyone else
can change (docs/security.md).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
from pathlib import Path
from typing import List, Optional

from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import atomic_output, canonical_json, sha256_file

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://rules-dsa.invalid/signed-bundle/v1"
MAX_ENVELOPE_BYTES = 1 << 20


def signature_path(archive: Path) -> Path:
    """NAME.dsse.json beside NAME.tar."""
    archive = Path(archive)
    return archive.with_name((archive.name[:-4] if archive.name.endswith(".tar") else archive.name) + ".dsse.json")


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what the signature covers."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:  # pragma: no cover - the environment pins cryptography
        raise DsaError("dsa sign", "the cryptography package is not installed",
                       "install rules_dsa's environment (requirements_lock.txt)") from None
    return InvalidSignature, serialization, ed25519


def _read_key(path: Path, private: bool):
    _, serialization, ed25519 = _crypto()
    path = Path(path)
    if not path.is_file():
        raise DsaError(str(path), "no key file", "make a key pair with `dsa keygen KEY`")
    if path.stat().st_size > 64 << 10:
        raise DsaError(str(path), "is too large to be a PEM key", "pass the KEY.pem or KEY.pub.pem `dsa keygen` wrote")
    data = path.read_bytes()
    try:
        key = (serialization.load_pem_private_key(data, password=None) if private
               else serialization.load_pem_public_key(data))
    except (ValueError, TypeError) as e:
        kind = "private" if private else "public"
        raise DsaError(str(path), f"is not a PEM {kind} key: {str(e).splitlines()[0] if str(e) else e}",
                       f"pass the {'KEY.pem' if private else 'KEY.pub.pem'} `dsa keygen` wrote") from None
    wanted = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    if not isinstance(key, wanted):
        raise DsaError(str(path), f"is a {type(key).__name__}, not an ed25519 key", "make one with `dsa keygen KEY`")
    return key


def key_id(public_key) -> str:
    _, serialization, _ = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def generate_key(prefix: Path) -> tuple:
    """Writes PREFIX.pem (private, mode 0600) and PREFIX.pub.pem; refuses to overwrite either."""
    _, serialization, ed25519 = _crypto()
    private_path, public_path = Path(f"{prefix}.pem"), Path(f"{prefix}.pub.pem")
    for path in (private_path, public_path):
        if path.exists():
            raise DsaError(str(path), "exists", "choose another name: a key is never overwritten")
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    public_path.write_bytes(public)
    return private_path, public_path


# A release number is a non-negative integer below 2^53 (exact in every JSON reader).
MAX_RELEASE = (1 << 53) - 1


def check_release(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RELEASE:
        raise DsaError(where, f"{str(value)[:40]} is not a release number (an integer from 0 to {MAX_RELEASE})",
                       "number releases 1, 2, 3, ... in the order they ship")
    return value


def _bundle_identity(b) -> dict:
    """What a signature binds besides the archive's digest: the model, its targets, the bundle format and the
    recipe lock's digest (the build's identity: every input and output digest)."""
    locks = [entry.get("sha256") for name, entry in sorted(b.meta.get("files", {}).items())
             if (name == "lock.json" or name.endswith(".lock.json") or name.endswith("_lock.json"))
             and isinstance(entry, dict)]
    return {"model_id": b.meta.get("model_id") or " → ".join(s.model_id for s in b.stages),
            "target": b.meta.get("target"), "bundle_format": b.meta.get("format"),
            "lock_sha256": ",".join(locks) or None}


def sign_bundle(archive: Path, private_key: Path, release: Optional[int] = None) -> Path:
    """Verifies `archive` as `dsa run` would, then writes its DSSE envelope (NAME.dsse.json) beside it. The signed
    statement names the archive's sha256 and what it is: model id, targets, format, the recipe lock's digest and,
    when given, the `release` number (what `--min-release` compares: a rollback floor)."""
    from dsa.runtime.bundle import open_bundle

    key = _read_key(private_key, private=True)
    archive = Path(archive)
    if release is not None:
        check_release(release, "--release")
    with open_bundle(archive) as b:
        sha = b.sha256
        predicate = _bundle_identity(b)
    if release is not None:
        predicate["release"] = release
    statement = {"_type": STATEMENT_TYPE, "subject": [{"name": archive.name, "digest": {"sha256": sha}}],
                 "predicateType": PREDICATE_TYPE, "predicate": predicate}
    payload = canonical_json(statement).encode("utf-8")
    signature = key.sign(pae(PAYLOAD_TYPE, payload))
    envelope = {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(payload).decode("ascii"),
                "signatures": [{"keyid": key_id(key.public_key()),
                                "sig": base64.b64encode(signature).decode("ascii")}]}
    out = signature_path(archive)
    with atomic_output(out) as tmp:
        tmp.write_text(canonical_json(envelope), encoding="utf-8")
    return out


def verify_signature(archive: Path, public_key: Path, *, expect_model: Optional[str] = None,
                     min_release: Optional[int] = None) -> dict:
    """The signed statement of `archive`, after checking its envelope's signature with `public_key` and that
    the signed digest is the archive's sha256. An absent, malformed, foreign or stale signature is refused; so is
    one that signs another model than `expect_model` (a substituted bundle, renamed) or a release older than
    `min_release` (a rollback), or none when a floor is given."""
    InvalidSignature, _, _ = _crypto()
    archive = Path(archive)
    key = _read_key(public_key, private=False)
    path = signature_path(archive)
    where = str(path)
    if not path.is_file():
        raise DsaError(str(archive), f"is not signed: no {path.name} beside it",
                       f"sign it with `dsa sign {archive.name} --key KEY.pem`, or get the signed release")
    if path.stat().st_size > MAX_ENVELOPE_BYTES:
        raise DsaError(where, f"is over {MAX_ENVELOPE_BYTES} bytes: not a signature envelope", "sign the bundle again")
    try:
        envelope = json.loads(path.read_bytes().decode("utf-8"))
        payload = base64.b64decode(envelope["payload"], validate=True)
        signatures = [(s["keyid"], base64.b64decode(s["sig"], validate=True)) for s in envelope["signatures"]]
        payload_type = envelope["payloadType"]
    except (ValueError, KeyError, TypeError, UnicodeError, RecursionError) as e:
        raise DsaError(where, f"is not a DSSE envelope ({type(e).__name__})", "sign the bundle again") from None
    if payload_type != PAYLOAD_TYPE:
        raise DsaError(where, f"payloadType is {payload_type!r}, not {PAYLOAD_TYPE}", "sign the bundle again")
    wanted = key_id(key)
    for keyid, signature in signatures:
        if keyid != wanted:
            continue
        try:
            key.verify(signature, pae(payload_type, payload))
        except InvalidSignature:
            raise DsaError(where, f"the signature does not verify with {public_key}",
                           "the envelope was altered: get the signed release again") from None
        break
    else:
        raise DsaError(where, f"holds no signature by the key {public_key} (keyid {wanted[:16]}…)",
                       "verify with the public key of whoever signed the release")
    try:
        statement = json.loads(payload.decode("utf-8"))
        digests = {s["digest"]["sha256"] for s in statement["subject"]}
    except (ValueError, KeyError, TypeError, UnicodeError, RecursionError):
        raise DsaError(where, "its signed payload is not an in-toto statement", "sign the bundle again") from None
    sha = sha256_file(archive)
    if statement.get("_type") != STATEMENT_TYPE or sha not in digests:
        raise DsaError(str(archive), f"has sha256 {sha}, but its signature covers {', '.join(sorted(digests))}",
                       "the archive changed after it was signed: get the signed release again")
    predicate = statement.get("predicate") if isinstance(statement.get("predicate"), dict) else {}
    if expect_model is not None and predicate.get("model_id") != expect_model:
        raise DsaError(str(archive), f"is signed as model {str(predicate.get('model_id'))[:100]!r}, not the "
                       f"expected {expect_model!r}", "this is another model's release: get the right bundle")
    if min_release is not None:
        check_release(min_release, "--min-release")
        release = predicate.get("release")
        if release is None:
            raise DsaError(str(archive), "was signed without a release number, and a release floor "
                           f"({min_release}) is required", "sign releases with `dsa sign ... --release N`")
        if isinstance(release, bool) or not isinstance(release, int) or release < min_release:
            raise DsaError(str(archive), f"is signed as release {str(release)[:40]}, older than the floor "
                           f"{min_release} (a rollback)", "install the current release")
    return statement


def check_identity(statement: dict, opened, archive: Path) -> None:
    """The signed identity against the bundle as opened (every digest already checked): they agree unless the
    signer signed something else than what this bundle says it is."""
    signed = statement.get("predicate") or {}
    actual = _bundle_identity(opened)
    for field in ("model_id", "target", "bundle_format", "lock_sha256"):
        if field in signed and signed[field] != actual[field]:
            raise DsaError(str(archive), f"its signature names {field} {str(signed[field])[:100]!r}, the bundle "
                           f"{str(actual[field])[:100]!r}", "the signature is not this bundle's: sign it again")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    k = sub.add_parser("keygen", help="make an ed25519 key pair: KEY.pem (private) and KEY.pub.pem")
    k.add_argument("key", help="path prefix of the two files")
    s = sub.add_parser("sign", help="verify a bundle, then sign it (NAME.dsse.json beside it)")
    s.add_argument("bundle")
    s.add_argument("--key", required=True, help="the private key (KEY.pem)")
    s.add_argument("--release", type=int, help="the release number the signature states (1, 2, 3, ... in the order "
                   "releases ship): what a robot's --min-release floor compares")
    v = sub.add_parser("verify", help="check a bundle as `dsa run` would; with --key, its signature too")
    v.add_argument("bundle")
    v.add_argument("--key", help="the signer's public key (KEY.pub.pem): the bundle must be signed by it")
    add_expectations(v)
    a = parser.parse_args(argv)
    from dsa.runtime.bundle import open_bundle, user_path

    if a.command == "keygen":
        private, public = generate_key(user_path(a.key))
        print(f"dsa keygen: wrote {private} (private: keep it secret) and {public}")
    elif a.command == "sign":
        out = sign_bundle(user_path(a.bundle), user_path(a.key), release=a.release)
        print(f"dsa sign: wrote {out}")
    else:
        archive = user_path(a.bundle)
        check_expectations(a, a.key, "--key")
        statement = verify_signature(archive, user_path(a.key), expect_model=a.expect_model,
                                     min_release=a.min_release) if a.key else None
        with open_bundle(archive) as b:
            if statement is not None:
                check_identity(statement, b, archive)
            print(b.describe())
        if a.key:
            print(f"signature {signature_path(archive).name}: verified with {a.key}{describe_signed(statement)}")


def add_expectations(parser) -> None:
    """--expect-model and --min-release: what a signature must say (dsa verify, dsa run)."""
    parser.add_argument("--expect-model", metavar="MODEL_ID",
                        help="with a signature: refuse a bundle signed as another model (a substituted release)")
    parser.add_argument("--min-release", type=int, metavar="N",
                        help="with a signature: refuse a release signed with a lower number, or none (a rollback)")


def check_expectations(a, key, flag: str) -> None:
    for name in ("expect_model", "min_release"):
        if getattr(a, name) is not None and not key:
            raise DsaError(f"--{name.replace('_', '-')}", f"needs {flag}: only a signature binds a model id and a "
                           "release number", f"pass {flag} KEY.pub.pem")


def describe_signed(statement: Optional[dict]) -> str:
    predicate = (statement or {}).get("predicate") or {}
    release = predicate.get("release")
    return f" (model {predicate.get('model_id')}" + (f", release {release})" if release is not None else ")")


if __name__ == "__main__":
    run_cli(main, "dsa")
