"""dsa.stages.link without Bazel: the edge check on hand-made export records, link.json's content, and the CLI
(a refused link exits 2 with one message naming the edge and leaves no output)."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsa.core.errors import DsaError
from dsa.stages.link import Stage, edges_of, link

PACKAGE_ROOT = Path(__import__("dsa").__file__).resolve().parent.parent

BACKBONE = {
    "model_id": "bb",
    "inputs": [
        {"name": "image", "shape": [1, 3, 32, 32], "dtype": "float32"},
        {"name": "prompt_tokens", "shape": [1, 8], "dtype": "int64"},
    ],
    "outputs": [
        {"name": "features", "shape": [1, 24, 64], "dtype": "float32"},
        {"name": "mask", "shape": [1, 24], "dtype": "float32"},
    ],
}
HEAD = {
    "model_id": "head",
    "inputs": [
        {"name": "features", "shape": [1, 24, 64], "dtype": "float32"},
        {"name": "mask", "shape": [1, 24], "dtype": "float32"},
        {"name": "noise", "shape": [1, 16, 7], "dtype": "float32"},
        {"name": "steps", "shape": [], "dtype": "int64", "value_range": [1, 1000]},
    ],
    "outputs": [{"name": "action", "shape": [1, 16, 7], "dtype": "float32"}],
}
EDGES = [("head.features", "bb.features"), ("head.mask", "bb.mask")]


def stages(backbone=BACKBONE, head=HEAD):
    return [Stage("bb", [backbone], ["bb.json"], ["1" * 64]), Stage("head", [head], ["head.json"], ["2" * 64])]


def edited(record, kind, name, **changes):
    record = copy.deepcopy(record)
    for entry in record[kind]:
        if entry["name"] == name:
            entry.update(changes)
    return record


def test_link_records_each_edge_with_name_shape_dtype_producer_consumer():
    result = link(stages(), EDGES)
    assert result["format"] == 1
    assert result["edges"] == [
        {"name": "features", "shape": [1, 24, 64], "dtype": "float32",
         "producer": {"stage": "bb", "output": "features"}, "consumer": {"stage": "head", "input": "features"}},
        {"name": "mask", "shape": [1, 24], "dtype": "float32",
         "producer": {"stage": "bb", "output": "mask"}, "consumer": {"stage": "head", "input": "mask"}},
    ]
    assert [(i["name"], i["stage"]) for i in result["inputs"]] == [
        ("image", "bb"), ("prompt_tokens", "bb"), ("noise", "head"), ("steps", "head")]
    assert result["outputs"] == [{"name": "action", "shape": [1, 16, 7], "dtype": "float32", "stage": "head"}]
    assert result["stages"] == [{"name": "bb", "model_id": "bb", "export_records": ["1" * 64]},
                                {"name": "head", "model_id": "head", "export_records": ["2" * 64]}]
    assert sorted(edges_of(result)) == sorted(EDGES)


def test_a_shape_mismatch_is_refused_naming_the_edge_and_both_records():
    head = edited(HEAD, "inputs", "features", shape=[1, 24, 96])
    with pytest.raises(DsaError) as e:
        link(stages(head=head), EDGES)
    text = str(e.value)
    assert "edge 'features' (bb.features → head.features)" in text
    assert "[1, 24, 64] float32" in text and "[1, 24, 96] float32" in text
    assert "bb.json" in text and "head.json" in text
    assert "make the two models agree on the edge" in text


def test_a_dtype_mismatch_is_refused():
    head = edited(HEAD, "inputs", "mask", dtype="int64")
    with pytest.raises(DsaError, match=r"edge 'mask' .*\[1, 24\] float32.*\[1, 24\] int64"):
        link(stages(head=head), EDGES)


@pytest.mark.parametrize("edges, message", [
    ([("head.features", "bb.nothing")] + EDGES[1:], r"bb has no output 'nothing' \(its outputs: features, mask\)"),
    ([("head.nothing", "bb.features")] + EDGES, r"head has no input 'nothing'"),
    ([("head.features", "ghost.features")], r"names no stage 'ghost' as its producer"),
    ([("bb.prompt_tokens", "head.action")] + EDGES, r"the producer head does not run before the consumer bb"),
    ([("head.features", "bb.mask")] + EDGES, r"shape/dtype mismatch"),
    ([("head-features", "bb.features")], r"is not STAGE.TENSOR"),
])
def test_bad_edges_are_refused(edges, message):
    with pytest.raises(DsaError, match=message):
        link(stages(), edges)


def test_a_forgotten_edge_is_refused():
    """Without the mask edge the head's `mask` would silently become an input the caller must provide."""
    with pytest.raises(DsaError, match=r"stage head: input 'mask'.*has no edge, but stage bb outputs a tensor of "
                       r"that name.*add the edge head.mask=bb.mask"):
        link(stages(), EDGES[:1])


def test_external_inputs_of_one_name_must_agree():
    head = copy.deepcopy(HEAD)
    head["inputs"].append({"name": "prompt_tokens", "shape": [1, 9], "dtype": "int64"})
    with pytest.raises(DsaError, match=r"input 'prompt_tokens'.*stage bb takes an input of that name"):
        link(stages(head=head), EDGES)


def test_every_bucket_of_the_consumer_is_checked():
    bucket = edited(HEAD, "inputs", "features", shape=[1, 24, 32])
    both = [stages()[0], Stage("head", [HEAD, bucket], ["head_0.json", "head_1.json"])]
    with pytest.raises(DsaError, match=r"head takes \[1, 24, 32\] float32 \(head_1.json\)"):
        link(both, EDGES)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dsa.stages.link", *map(str, args)], capture_output=True, text=True,
                          cwd=PACKAGE_ROOT, check=False)


def _write(path, record):
    path.write_text(json.dumps(record))
    return path


def test_cli_writes_link_json_deterministically(tmp_path):
    bb, head = _write(tmp_path / "bb.json", BACKBONE), _write(tmp_path / "head.json", HEAD)
    outs = []
    for n in (1, 2):
        out = tmp_path / f"link{n}.json"
        proc = _cli("link", "--stage", f"bb={bb}", "--stage", f"head={head}",
                    "--edge", "head.features=bb.features", "--edge", "head.mask=bb.mask", "--out", out)
        assert proc.returncode == 0, proc.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    data = json.loads(outs[0])
    assert [e["name"] for e in data["edges"]] == ["features", "mask"]
    assert data["stages"][0]["export_records"][0] == __import__("hashlib").sha256(bb.read_bytes()).hexdigest()


def test_cli_refuses_a_mismatch_with_exit_2_and_no_output(tmp_path):
    bb = _write(tmp_path / "bb.json", BACKBONE)
    head = _write(tmp_path / "head.json", edited(HEAD, "inputs", "features", shape=[1, 24, 96]))
    out = tmp_path / "link.json"
    proc = _cli("link", "--stage", f"bb={bb}", "--stage", f"head={head}",
                "--edge", "head.features=bb.features", "--edge", "head.mask=bb.mask", "--out", out)
    assert proc.returncode == 2
    assert proc.stderr.startswith("dsa link: error: edge 'features' (bb.features → head.features)")
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert {p.name for p in tmp_path.iterdir()} == {"bb.json", "head.json"}  # no link.json, no partial file


def test_cli_refuses_two_edges_into_one_input(tmp_path):
    bb, head = _write(tmp_path / "bb.json", BACKBONE), _write(tmp_path / "head.json", HEAD)
    proc = _cli("link", "--stage", f"bb={bb}", "--stage", f"head={head}", "--edge", "head.features=bb.features",
                "--edge", "head.features=bb.features", "--edge", "head.mask=bb.mask", "--out", tmp_path / "l.json")
    assert proc.returncode == 2 and "head.features already has an edge" in proc.stderr
    assert not (tmp_path / "l.json").exists()


def test_the_link_the_cli_writes_is_what_the_bundle_writer_reads(tmp_path):
    """link.json is written and read only through dsa.core.formats.Link: what `dsa link link` writes, the bundle
    writer's and the pipeline runner's reader accept; another format or a missing field is refused, naming the
    file."""
    from dsa.core.formats import Link

    bb, head = _write(tmp_path / "bb.json", BACKBONE), _write(tmp_path / "head.json", HEAD)
    out = tmp_path / "link.json"
    proc = _cli("link", "--stage", f"bb={bb}", "--stage", f"head={head}", "--edge", "head.features=bb.features",
                "--edge", "head.mask=bb.mask", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert Link.read(out) == json.loads(out.read_text())
    out.write_text(json.dumps(dict(json.loads(out.read_text()), format=2)))
    with pytest.raises(DsaError, match="link.json: link format 2 is not supported"):
        Link.read(out)
    out.write_text(json.dumps({"format": 1, "stages": []}))
    with pytest.raises(DsaError, match="link.json: link lacks edges, inputs, outputs"):
        Link.read(out)
