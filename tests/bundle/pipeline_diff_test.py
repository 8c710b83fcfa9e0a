"""A whole-pipeline bundle (//models:act_pipeline_bundle) rebuilt with another dataset's statistics, as the
build rebuilds it (DsaManifest's runtime view, DsaLock, DsaBundle; no export, parameters or compile): the
export, parameter and compile views do not move, `dsa diff` names the two normalisation nodes whose
statistics changed and nothing else (not the network), and the bundle tool refuses statistics the manifest
does not pin, naming the field."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from dsa.core.errors import DsaError
from dsa.core.fileio import sha256_file
from dsa.manifest.contract import load_manifest, project
from dsa.runtime import bundle as B
from dsa.runtime.processors import read_safetensors
from dsa.tools.diff import diff_bundles, format_text
from dsa.tools.testing import runfile

if str(Path(__file__).resolve().parent) not in sys.path:  # bundle_testlib sits beside the tests
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from bundle_testlib import rebundle_pipeline  # noqa: E402

BUNDLE = runfile("models/act_pipeline_bundle.tar")
PRE_STATS = "policy_preprocessor_step_3_normalizer_processor.safetensors"
POST_STATS = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"


def _rebuild(opened, tmp, new_stats, *, pin=True):
    """The bundle's own files with the two statistics files replaced (and, with `pin`, the manifest's pins
    and the lock following them)."""
    work = tmp / "files"
    shutil.copytree(opened.root, work)
    manifest_text = (work / B.MANIFEST_YAML).read_text(encoding="utf-8")
    old = {sha256_file(work / name) for name in (PRE_STATS, POST_STATS)}
    assert len(old) == 1  # the stand-in's pre- and postprocessor hold the same statistics
    for name in (PRE_STATS, POST_STATS):
        save_file(new_stats, str(work / name))
    if pin:
        old_sha = old.pop()
        assert manifest_text.count(old_sha) == 2
        manifest_text = manifest_text.replace(old_sha, sha256_file(work / PRE_STATS))
    (work / B.MANIFEST_YAML).write_text(manifest_text, encoding="utf-8")
    processors = [work / n for n in ("policy_preprocessor.json", "policy_postprocessor.json", PRE_STATS, POST_STATS)]
    out = rebundle_pipeline(work, tmp / "act_pipeline_bundle.tar", opened.meta["manifest_source"], processors)
    return out, load_manifest(work / B.MANIFEST_YAML)


@pytest.fixture(scope="module")
def opened():
    with B.open_bundle(BUNDLE) as bundle:
        yield bundle


@pytest.fixture(scope="module")
def other_dataset():
    stats = read_safetensors(runfile(f"models/act_processors/{PRE_STATS}"))
    return {k: (v * 1.5 if k.endswith(".std") else v + 0.25).astype(np.float32) for k, v in stats.items()}


def test_new_statistics_move_only_the_runtime_view(opened, other_dataset, tmp_path):
    _, manifest = _rebuild(opened, tmp_path, other_dataset)
    before = load_manifest(opened.root / B.MANIFEST_YAML)  # every level's manifest: one file
    for view in ("export", "params"):
        assert project(manifest, view) == project(before, view), view
    assert project(manifest, "compile", target="x86_64-v3") == project(before, "compile", target="x86_64-v3")
    assert project(manifest, "runtime") != project(before, "runtime")


def test_dsa_diff_names_the_normalisation_nodes_whose_statistics_changed(opened, other_dataset, tmp_path):
    out, _ = _rebuild(opened, tmp_path, other_dataset)
    with B.open_bundle(out) as changed:
        # The bundle holds the policy's levels (x86_64-v4, x86_64-v3): compared for one of them, as `dsa diff
        # --target` does.
        assert opened.targets == changed.targets == ["x86_64-v4", "x86_64-v3"]
        result = diff_bundles(opened.for_target("x86_64-v3"), changed.for_target("x86_64-v3"))
    pipeline = result["pipeline"]
    assert sorted(pipeline["changed"]) == ["postprocessor[0] unnormalizer_processor",
                                           "preprocessor[3] normalizer_processor"]
    assert set(pipeline["changed"]["preprocessor[3] normalizer_processor"]) == {PRE_STATS}
    assert "network" not in pipeline["changed"]
    assert not [name for name in result["artifacts"] if name.endswith((".vmfb", ".irpa"))]
    assert result["suspicious"] == []
    text = format_text(result)
    assert "pipeline nodes changed:" in text and f"preprocessor[3] normalizer_processor: {PRE_STATS} sha256" in text


def test_statistics_the_manifest_does_not_pin_are_refused_naming_the_field(opened, other_dataset, tmp_path):
    with pytest.raises(DsaError, match=r"processors.preprocessor.sha256|processors.files\[\d\].sha256"):
        _rebuild(opened, tmp_path, other_dataset, pin=False)


def test_statistics_missing_a_normalised_feature_are_refused_naming_step_and_feature(opened, other_dataset,
                                                                                     tmp_path):
    # LeRobot would run this policy with its camera frames un-normalised (a feature without statistics passes
    # through unchanged): the bundle refuses it, naming the processor step and the feature.
    camera = [k for k in other_dataset if k.startswith("observation.images.")]
    assert camera
    partial = {k: v for k, v in other_dataset.items() if k not in camera}
    feature = camera[0].rsplit(".", 1)[0]
    with pytest.raises(DsaError, match=rf"policy_preprocessor.json step 3 \(normalizer_processor\).*normalises "
                                       rf"'{feature}' \(MEAN_STD\) but its statistics file has no"):
        _rebuild(opened, tmp_path, partial)
