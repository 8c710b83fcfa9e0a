"""Signed bundles (dsa keygen / sign / verify, `dsa run --require-signature`, release --key): a signed bundle
verifies and runs; a tampered archive, a tampered envelope, another signer's key and an unsigned bundle are
refused with one message, before anything in the bundle is loaded."""

from __future__ import annotations

import base64
import json
import shutil

import pytest

from bundle_testlib import cli, rebundle
from dsa.core.errors import DsaError
from dsa.runtime import bundle as B
from dsa.runtime import release as R
from dsa.runtime import signing as S


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("keys") / "release"
    proc = cli("dsa", "keygen", prefix)
    assert proc.returncode == 0, proc.stderr
    return prefix.with_name("release.pem"), prefix.with_name("release.pub.pem")


@pytest.fixture
def signed(built_copy, keys):
    proc = cli("dsa", "sign", built_copy, "--key", keys[0])
    assert proc.returncode == 0, proc.stderr
    assert S.signature_path(built_copy).is_file()
    return built_copy


def _refused(proc, *needles):
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-2000:]


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(keys, tmp_path):
    private, public = keys
    assert private.stat().st_mode & 0o077 == 0
    assert b"PUBLIC KEY" in public.read_bytes() and b"PRIVATE KEY" in private.read_bytes()
    _refused(cli("dsa", "keygen", private.with_name("release")), "release.pem: exists")


def test_a_signed_bundle_verifies_and_runs_with_the_signature_required(signed, keys):
    proc = cli("dsa", "verify", signed, "--key", keys[1])
    assert proc.returncode == 0, proc.stderr
    assert "verified with" in proc.stdout
    run = cli("dsa", "run", signed, "--require-signature", keys[1], "--steps", "1", "--repeats", "1")
    assert run.returncode == 0, run.stderr
    assert "signature pi0_bundle.dsse.json: verified" in run.stdout and "flow_steps=1" in run.stdout


def test_the_envelope_is_dsse_over_an_in_toto_statement_naming_the_archive(signed):
    envelope = json.loads(S.signature_path(signed).read_text())
    assert envelope["payloadType"] == "application/vnd.in-toto+json"
    statement = json.loads(base64.b64decode(envelope["payload"]))
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["subject"] == [{"name": signed.name, "digest": {"sha256": B.sha256_file(signed)}}]
    assert len(envelope["signatures"]) == 1 and len(envelope["signatures"][0]["keyid"]) == 64


def test_an_unsigned_bundle_is_refused_when_a_signature_is_required(built_copy, keys):
    _refused(cli("dsa", "run", built_copy, "--require-signature", keys[1]), "is not signed", "pi0_bundle.dsse.json")
    _refused(cli("dsa", "verify", built_copy, "--key", keys[1]), "is not signed")


def test_a_bundle_rebuilt_with_swapped_weights_after_signing_is_refused(signed, keys, opened, tmp_path):
    # Weights swapped and every digest inside recomputed (bundle.json, lock, sidecar): only the signature holds.
    params = bytearray((opened.root / B.PARAMS_IRPA).read_bytes())
    params[-1] ^= 0x01
    rebuilt = rebundle(opened, tmp_path / "pi0_bundle.tar", files={B.PARAMS_IRPA: bytes(params)})
    shutil.copyfile(rebuilt, signed)
    shutil.copyfile(B.sidecar_path(rebuilt), B.sidecar_path(signed))
    assert cli("dsa", "verify", signed).returncode == 0   # consistent inside: the digests cannot tell
    _refused(cli("dsa", "run", signed, "--require-signature", keys[1]), "changed after it was signed")


def test_a_tampered_envelope_is_refused(signed, keys):
    path = S.signature_path(signed)
    envelope = json.loads(path.read_text())
    statement = json.loads(base64.b64decode(envelope["payload"]))
    statement["subject"][0]["digest"]["sha256"] = "0" * 64
    envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    path.write_text(json.dumps(envelope))
    _refused(cli("dsa", "verify", signed, "--key", keys[1]), "the signature does not verify")
    path.write_text("{not json")
    _refused(cli("dsa", "verify", signed, "--key", keys[1]), "is not a DSSE envelope")


def test_another_signers_key_is_refused(signed, tmp_path):
    other = tmp_path / "other"
    assert cli("dsa", "keygen", other).returncode == 0
    _refused(cli("dsa", "verify", signed, "--key", tmp_path / "other.pub.pem"), "holds no signature by the key")


def test_a_private_key_where_a_public_one_belongs_is_refused(signed, keys):
    _refused(cli("dsa", "verify", signed, "--key", keys[0]), "is not a PEM public key")


def test_release_with_a_key_ships_only_a_signed_bundle_and_its_signature(signed, built_copy, keys, tmp_path):
    archive, _ = R.release(signed, tmp_path / "out", public_key=keys[1])
    assert S.signature_path(archive).read_bytes() == S.signature_path(signed).read_bytes()
    S.verify_signature(archive, keys[1])
    S.signature_path(signed).unlink()
    with pytest.raises(DsaError, match="is not signed"):
        R.release(signed, tmp_path / "out2", public_key=keys[1])


# -- what a signature says: the model and the release (substitution and rollback) ---------------------------

@pytest.fixture
def released(built_copy, keys):
    """The bundle signed as release 3."""
    proc = cli("dsa", "sign", built_copy, "--key", keys[0], "--release", "3")
    assert proc.returncode == 0, proc.stderr
    return built_copy


def test_the_signed_statement_names_the_model_the_recipe_lock_and_the_release(released):
    statement = json.loads(base64.b64decode(json.loads(S.signature_path(released).read_text())["payload"]))
    predicate = statement["predicate"]
    assert predicate["model_id"] == "pi0" and predicate["release"] == 3
    with B.open_bundle(released) as b:
        assert predicate["lock_sha256"] == b.meta["files"][B.LOCK_JSON]["sha256"]


def test_a_bundle_signed_as_another_model_is_refused_even_renamed(released, keys, tmp_path):
    """Substitution: pi0's signed release, renamed to the name the robot expects, is still pi0's."""
    renamed = tmp_path / "act_bundle.tar"
    shutil.copyfile(released, renamed)
    shutil.copyfile(S.signature_path(released), S.signature_path(renamed))
    _refused(cli("dsa", "run", renamed, "--require-signature", keys[1], "--expect-model", "act"),
             "is signed as model 'pi0', not the expected 'act'")
    _refused(cli("dsa", "verify", renamed, "--key", keys[1], "--expect-model", "act"), "not the expected 'act'")
    run = cli("dsa", "run", renamed, "--require-signature", keys[1], "--expect-model", "pi0", "--steps", "1",
              "--repeats", "1")
    assert run.returncode == 0 and "(model pi0, release 3)" in run.stdout, run.stderr


def test_an_older_release_is_refused_under_a_release_floor(released, keys):
    """Rollback: release 3 under a floor of 4 is refused; under 3 it runs."""
    _refused(cli("dsa", "run", released, "--require-signature", keys[1], "--min-release", "4"),
             "is signed as release 3, older than the floor 4 (a rollback)")
    run = cli("dsa", "run", released, "--require-signature", keys[1], "--min-release", "3", "--steps", "1",
              "--repeats", "1")
    assert run.returncode == 0, run.stderr


def test_a_release_floor_refuses_a_signature_without_a_release_number(signed, keys):
    _refused(cli("dsa", "run", signed, "--require-signature", keys[1], "--min-release", "1"),
             "was signed without a release number")


@pytest.mark.parametrize("flags", [["--expect-model", "pi0"], ["--min-release", "2"]])
def test_expectations_without_a_signature_are_refused(built_copy, flags):
    _refused(cli("dsa", "run", built_copy, *flags), "needs --require-signature")
    _refused(cli("dsa", "verify", built_copy, *flags), "needs --key")


@pytest.mark.parametrize("release", ["-1", str(2 ** 60)])
def test_a_release_number_out_of_range_is_refused(built_copy, keys, release):
    _refused(cli("dsa", "sign", built_copy, "--key", keys[0], "--release", release), "is not a release number")
    assert not S.signature_path(built_copy).exists()


def test_the_python_api_checks_model_and_release_as_dsa_run_does(released, keys):
    from dsa.runtime import load

    with pytest.raises(DsaError, match="not the expected 'act'"):
        load(released, require_signature=keys[1], expect_model="act")
    with pytest.raises(DsaError, match="older than the floor 9"):
        load(released, require_signature=keys[1], min_release=9)
    with pytest.raises(DsaError, match="need require_signature"):
        load(released, expect_model="pi0")
    with load(released, require_signature=keys[1], expect_model="pi0", min_release=3) as policy:
        assert policy.model_id == "pi0"
