"""The export builds models without their weights (dsa.stages.weightless): the MLIR and the export record are
byte-identical to those of a model built with real weights, and the export's peak memory does not grow with
the parameter count."""

import copy
import json
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from dsa.manifest.contract import load_manifest, project
from dsa.stages.export import export_model
from dsa.stages.spec import ExportSpec, InputSpec
from dsa.stages.weightless import as_fake, is_weightless, stand_in_values, without_weights
from dsa.tools.testing import runfile

HERE = Path(__file__).resolve().parent


class Tied(nn.Module):
    """Tied weights (one tensor under two names), a persistent buffer, a non-persistent one (computed from the
    config; a graph that read it would inline it, which the export refuses), a parameter filled before it is
    registered, and a module moved with `.to()` after it is built."""

    def __init__(self, vocab=64, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width), persistent=False)
        self.register_buffer("offset", torch.zeros(width))
        self.pos = nn.Parameter(torch.zeros(1, 8, width))
        self.norm = nn.LayerNorm(width)
        self.to("cpu")

    def forward(self, tokens):
        x = self.embed(tokens) + self.offset + self.pos
        return self.head(self.norm(x))


def tied(view, dims):
    return ExportSpec(module=Tied(), inputs=[InputSpec("tokens", (1, 8), "int64", sample_range=(0, 63))],
                      outputs=["logits"])


def big_embedding(view, dims):
    """An embedding table of `rows` x 2048 float32 rows (rows = 262144: 2.1 GB), read by one lookup."""
    rows = view["model"]["config"]["rows"]
    return ExportSpec(module=nn.Embedding(rows, 2048), inputs=[InputSpec("ids", (1, 4), "int64",
                                                                         sample_range=(0, 15))],
                      outputs=["x"])


@pytest.fixture(scope="module")
def pi0_view():
    return project(load_manifest(runfile("manifests/pi0.yaml")), "export")


def _export_both(view, tmp_path, **kwargs):
    out = {}
    for weightless in (False, True):
        d = tmp_path / str(weightless)
        record = export_model(view, d / "model.mlir", d / "record.json", weightless=weightless, **kwargs)
        out[weightless] = ((d / "model.mlir").read_bytes(), (d / "record.json").read_bytes(), record)
    return out


def test_pi0_exports_the_same_mlir_and_record_without_its_weights(pi0_view, tmp_path):
    both = _export_both(pi0_view, tmp_path, pythonpath=[str(runfile("models/pi0/pi0.py").parents[2])])
    assert both[True][0] == both[False][0]
    assert both[True][1] == both[False][1]
    assert both[True][2]["parameter_count"] > 2_000_000


def test_tied_weights_and_buffers_export_the_same_without_weights(pi0_view, tmp_path):
    view = copy.deepcopy(pi0_view)
    view["model"] = {"entry_point": "weightless_test:tied", "config": {}}
    view["bucket_dims"] = []
    both = _export_both(view, tmp_path, pythonpath=[str(HERE)])
    assert both[True][0] == both[False][0] and both[True][1] == both[False][1]
    names = [p["name"] for p in both[True][2]["parameters"]]
    # One tensor for the tied pair (under one of its names), the persistent buffer as a parameter, the
    # non-persistent one in no archive.
    assert len({"embed.weight", "head.weight"} & set(names)) == 1
    assert "offset" in names and "scale" not in names


def test_quantised_model_exports_the_same_without_weights(pi0_view, tmp_path):
    view = copy.deepcopy(pi0_view)
    view["model"] = {"entry_point": "tiny_models:mlp", "config": {}}
    view["bucket_dims"] = []
    view["quant_scheme"] = {"kind": "int4", "group_size": 32}
    both = _export_both(view, tmp_path, pythonpath=[str(HERE)])
    assert both[True][0] == both[False][0] and both[True][1] == both[False][1]
    assert both[True][2]["quantization"]["tensors"]


def test_without_weights_puts_parameters_on_meta_and_keeps_buffers():
    with without_weights():
        model = Tied()
    assert all(p.is_meta for p in model.parameters())
    assert not model.scale.is_meta and torch.equal(model.scale, torch.linspace(0.5, 1.5, 16))
    assert model.head.weight is model.embed.weight  # tied, still
    with without_weights():
        model.to(torch.float16)  # a dtype change of meta tensors stays on meta
    assert model.head.weight.dtype == torch.float16 and model.head.weight.is_meta
    plain = nn.Linear(3, 3)  # outside the context: real again
    assert not plain.weight.is_meta


def test_as_fake_makes_every_weight_storage_less_keeps_ties_and_non_persistent_buffers():
    with without_weights():
        model = Tied()
    as_fake(model)
    assert all(is_weightless(t) for t in model.state_dict().values())
    assert model.head.weight is model.embed.weight
    assert not is_weightless(model.scale)
    values = stand_in_values(model.norm)
    assert sorted(values) == ["bias", "weight"] and all(not is_weightless(v) for v in values.values())
    out = torch.func.functional_call(model.norm, values, (torch.ones(2, 16),))
    assert out.shape == (2, 16)


_MEASURE = textwrap.dedent("""
    import json, resource, sys
    sys.path.insert(0, sys.argv[1])
    from dsa.stages.export import export_model
    view = json.loads(sys.argv[2])
    export_model(view, sys.argv[3] + "/m.mlir", sys.argv[3] + "/r.json", pythonpath=[sys.argv[1]],
                 weightless=sys.argv[4] == "1")
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
""")


def _peak_kib(view, tmp_path, weightless=True):
    out = tmp_path / f"{view['model']['config']['rows']}-{weightless}"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(HERE), json.dumps(view), str(out),
                           "1" if weightless else "0"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((out / "r.json").read_text())
    return int(proc.stdout.split()[-1]), record["parameter_count"]


def test_export_peak_memory_does_not_grow_with_the_parameter_count(pi0_view, tmp_path):
    view = copy.deepcopy(pi0_view)
    view["bucket_dims"] = []
    small, big = (dict(view, model={"entry_point": "weightless_test:big_embedding", "config": {"rows": rows}})
                  for rows in (1024, 262144))
    small_kib, small_params = _peak_kib(small, tmp_path)
    big_kib, big_params = _peak_kib(big, tmp_path)
    assert big_params * 4 >= 2 * 2**30  # 2 GiB of float32 weights...
    # ... cost the export no more memory than 2 million (the allocator's noise: 150 MiB).
    assert big_kib - small_kib < 150 * 1024, (small_kib, big_kib)
    # Built with its weights, the same export holds them all: the measurement sees it.
    real_kib, _ = _peak_kib(big, tmp_path, weightless=False)
    assert real_kib - small_kib > 1.5 * 2**20, (small_kib, real_kib)


# -- a config asking for more than any policy: refused as the model is built, naming the config -----------------
@pytest.mark.parametrize("change, needle", [
    ({"depth": 1_000_000}, "parameter tensors: 20,001 registered"),      # a million layers: counted, stopped
    ({"width": 1_000_000}, "needs more memory than this process can have"),  # one 4 TB weight: not allocatable
])
def test_a_config_asking_for_more_than_any_policy_is_refused_naming_model_config(pi0_view, tmp_path, change,
                                                                                 needle):
    """π0's own entry point with one hyper-parameter made absurd: refused in seconds, within 1 GiB more than the
    process holds, with one line naming model.config and its largest value, and nothing written."""
    import time

    from dsa.core.errors import DsaError
    from dsa.tools.testing import bounded_memory

    view = copy.deepcopy(pi0_view)
    view["model"]["config"].update(change)
    start = time.monotonic()
    with bounded_memory(), pytest.raises(DsaError) as info:
        export_model(view, tmp_path / "model.mlir", tmp_path / "record.json", manifest_name="pi0.yaml",
                     pythonpath=[str(runfile("models/pi0/pi0.py").parents[2])])
    text = str(info.value)
    assert "\n" not in text and text.startswith("pi0.yaml: model.config: ") and needle in text, text
    (field, value), = change.items()
    assert f"{field}={value}" in text, text
    assert time.monotonic() - start < 30, text  # generous: seconds on every machine measured
    assert not list(tmp_path.iterdir())


def test_the_parameter_budget_counts_what_is_registered_and_resets():
    from dsa.stages.weightless import Budget, ModelTooLarge

    with pytest.raises(ModelTooLarge, match=r"parameter elements: 104 registered \(at Linear.weight\), the limit is 64"):
        with without_weights(Budget(100, 64)):
            nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8))
    with without_weights():  # no budget: the same model builds, and the last budget is gone
        nn.Sequential(*[nn.Linear(8, 8) for _ in range(200)])


def test_a_policy_config_over_its_size_limit_is_refused_before_it_is_read(tmp_path):
    """A LeRobot policy's config.json is a few kilobytes: a 2 MiB one is refused by its size (before its digest
    is even computed), naming model.policy_config and the limit."""
    from dsa.core.errors import DsaError
    from dsa.stages.export import MAX_POLICY_CONFIG_BYTES, load_policy_config

    config = tmp_path / "config.json"
    config.write_text('{"type": "pi0", "pad": "' + "x" * (2 << 20) + '"}')
    view = {"framework": "lerobot", "model": {"policy_config": {"path": "config.json", "sha256": "0" * 64}}}
    with pytest.raises(DsaError, match=f"m.yaml: model.policy_config: .* over the {MAX_POLICY_CONFIG_BYTES}-byte"):
        load_policy_config(view, config, "m.yaml")
