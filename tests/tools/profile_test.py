"""dsa.tools.profiler: a model's dispatches, profiled, each named by the torch ops and model modules it came from.

The tiny policy below (a conv patchifier, an attention block, a linear head) is the manifest's entry point
(`profile_test:tiny_policy`). Times are only checked to be positive and to add up sanely."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from dsa.core.errors import DsaError
from dsa.stages.spec import ExportSpec, InputSpec
from dsa.tools.testing import runfile

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the manifest's entry point is this module
    sys.path.insert(0, str(HERE))


class Mixer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        return self.out(F.scaled_dot_product_attention(q, k, v).squeeze(1))


class TinyPolicy(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.patchify = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.mixer = Mixer(dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, image, state):
        tokens = self.patchify(image).flatten(2).transpose(1, 2)
        tokens = tokens + self.mixer(tokens)
        return self.head(tokens.mean(dim=1) + state)


def tiny_policy(view, dims):
    return ExportSpec(module=TinyPolicy(view["model"]["config"].get("dim", 16)),
                      inputs=[InputSpec("image", (1, 3, 16, 16), "float32"),
                              InputSpec("state", (1, 16), "float32")],
                      outputs=["action"])


class Step(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Looped(nn.Module):
    """Applies `step` `n` times in a while_loop: the loop body's nodes carry no nn_module_stack."""

    def __init__(self):
        super().__init__()
        self.step = Step()

    def forward(self, x, n):
        from torch._higher_order_ops.while_loop import while_loop

        def cond(i, y):
            return i < n

        def body(i, y):
            return i + 1, self.step(y)

        return while_loop(cond, body, (torch.zeros((), dtype=torch.int64), x))[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A manifest for the tiny policy (pi0.yaml's shape), its checkpoint, and a target spec."""
    from safetensors.torch import save_file

    from dsa.core.fileio import sha256_file

    out = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    state = {k: torch.randn(v.shape) for k, v in TinyPolicy().state_dict().items()}
    save_file(state, str(out / "tiny.safetensors"))
    manifest = yaml.safe_load(runfile("manifests/pi0.yaml").read_text())
    manifest.update(model_id="tiny", model={"entry_point": "profile_test:tiny_policy", "config": {"dim": 16}},
                    checkpoint={"path": "tiny.safetensors", "sha256": sha256_file(out / "tiny.safetensors")},
                    buckets={}, targets=["x86_64-v3"])
    manifest.pop("normalization", None)
    (out / "tiny.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return {"manifest": out / "tiny.yaml", "checkpoint": out / "tiny.safetensors", "dir": out,
            "target": runfile("toolchains/targets/x86_64-v3.json")}


@pytest.fixture(scope="module")
def profiled(tiny):
    """Profiled without graph rewrites, so the conv and the fused attention keep their own dispatches."""
    from dsa.tools.profiler import profile_model

    keep = tiny["dir"] / "kept"
    result = profile_model(tiny["manifest"], tiny["checkpoint"], tiny["target"], runs=3, pythonpath=[str(HERE)],
                           keep_dir=keep, rewrites=())
    return result, keep


def test_with_the_default_rewrites_the_rewritten_ops_keep_their_module_paths(tiny):
    """As the build compiles it (default rewrites): the patch conv became a matmul and the attention two
    matmuls and a softmax, and their dispatches are still named by the modules they came from."""
    from dsa.tools.profiler import profile_model

    result = profile_model(tiny["manifest"], tiny["checkpoint"], tiny["target"], runs=2, pythonpath=[str(HERE)])
    assert result["rewrites"] is None  # the manifest's (default) rewrites
    names = [d["name"] for d in result["dispatches"]]
    assert not any("conv" in n or "attention" in n for n in names), names
    assert result["unmapped"] == []
    paths = {p for d in result["dispatches"] for p in d["module_paths"]}
    assert {"patchify", "mixer"} <= paths
    ops = {o for d in result["dispatches"] for o in d["ops"]}
    assert "aten.conv2d" not in ops and "aten._softmax" in ops


def test_every_dispatch_is_timed_and_attributed(profiled):
    result, _ = profiled
    dispatches = result["dispatches"]
    assert dispatches and result["unmapped"] == []
    for d in dispatches:
        assert d["total_ms"] > 0 and d["count"] > 0, d
        assert d["module_paths"] and d["ops"], d
        assert all(op.startswith("aten.") for op in d["ops"]), d
    assert result["total_ms"] > 0
    assert result["dispatch_ms"] == pytest.approx(sum(d["total_ms"] for d in dispatches))
    # Dispatches run in sequence here: their time is part of the calls' wall time.
    assert 0 < result["dispatch_ms"] <= 1.25 * result["total_ms"]
    assert [d["rank"] for d in dispatches] == list(range(1, len(dispatches) + 1))
    assert [d["total_ms"] for d in dispatches] == sorted((d["total_ms"] for d in dispatches), reverse=True)


def test_the_conv_dispatch_names_the_conv_module_and_op(profiled):
    result, _ = profiled
    conv = [d for d in result["dispatches"] if "conv" in d["name"]]
    assert len(conv) == 1, [d["name"] for d in result["dispatches"]]
    assert conv[0]["module_paths"][0] == "patchify"
    assert conv[0]["root_ops"][0] == "aten.conv2d"


def test_the_attention_module_and_its_linears_are_named(profiled):
    result, _ = profiled
    attention = [d for d in result["dispatches"] if "aten.scaled_dot_product_attention" in d["root_ops"]]
    assert attention and all(d["root_paths"] == ["mixer"] for d in attention)
    paths = {p for d in result["dispatches"] for p in d["module_paths"]}
    assert {"patchify", "mixer", "mixer.qkv", "mixer.out", "head"} <= paths


def test_the_table_lists_the_top_dispatches_and_totals(profiled):
    from dsa.tools.profiler import format_profile

    result, _ = profiled
    text = format_profile(result, top=2)
    lines = text.splitlines()
    assert lines[0].startswith("tiny on x86_64-v3: 3 run(s)")
    assert lines[1].split()[:5] == ["#", "dispatch", "count", "ms", "%"]
    assert lines[2].split()[0] == "1" and lines[3].split()[0] == "2"
    assert lines[4].startswith("total: ") and "dispatches: " in lines[4]
    assert result["dispatches"][0]["name"] in lines[2]


def test_bin_dsa_profile_with_a_parameter_archive(profiled, tiny, tmp_path):
    _, kept = profiled
    out = tmp_path / "profile.json"
    env = dict(os.environ, DSA_PYTHON=sys.executable)
    proc = subprocess.run(
        [str(runfile("bin/dsa")), "profile", "--manifest", str(tiny["manifest"]), "--params",
         str(kept / "params.irpa"), "--target", str(tiny["target"]), "--pythonpath", str(HERE), "--runs", "1",
         "--top", "3", "--json", str(out), "--", "--iree-opt-level=O2"],
        capture_output=True, text=True, env=env, cwd=runfile("."))
    assert proc.returncode == 0, proc.stderr
    assert "module paths" in proc.stdout and "total: " in proc.stdout
    result = json.loads(out.read_text())
    assert result["flags"][-1] == "--iree-opt-level=O2" and result["runs"] == 1
    assert all(d["module_paths"] for d in result["dispatches"])


def test_bad_requests_are_refused_before_compiling(tiny):
    from dsa.tools.profiler import profile_model

    args = (tiny["manifest"], tiny["checkpoint"], tiny["target"])
    for bucket in ("prompt_len=32", {"dim": "prompt_len", "slot": 0}):
        with pytest.raises(DsaError, match="no buckets for 'prompt_len'"):
            profile_model(*args, bucket=bucket, pythonpath=[str(HERE)])
    with pytest.raises(DsaError, match="no such input"):
        profile_model(*args, inputs={"noise": 1}, pythonpath=[str(HERE)])
    with pytest.raises(DsaError, match="set by dsa-profile itself"):
        profile_model(*args, tuning_flags=["--compile-to=flow"], pythonpath=[str(HERE)])
    with pytest.raises(DsaError, match="neither a .safetensors checkpoint nor an .irpa"):
        profile_model(tiny["manifest"], tiny["manifest"], tiny["target"], pythonpath=[str(HERE)])


def test_loop_body_nodes_get_paths_from_their_parameters_and_neighbours():
    from dsa.tools.profiler import annotate_locations

    module = Looped().eval()
    exported = torch.export.export(module, (torch.randn(1, 4), torch.tensor(3)), strict=False)
    nodes = annotate_locations(exported, module)
    body = [n for n in nodes if n.graph == "while_loop_body_graph_0" and n.kind == "op"]
    # The linears read their module's parameters; tanh sits between the two.
    assert [(n.op, n.display_path) for n in body if n.op in ("aten.linear", "aten.tanh")] == [
        ("aten.linear", "~step.fc1"), ("aten.tanh", "~step"), ("aten.linear", "~step.fc2")]
    assert [n.op for n in nodes if n.kind == "hop"] == ["while_loop"]
    assert [n.graph for n in nodes if n.kind == "inputs"] == [
        "", "while_loop_cond_graph_0", "while_loop_body_graph_0"]
    # Every call node and each graph's first input is tagged, in a form the importer's location regex reads.
    tagged = {}
    for graph_module in exported.graph_module.modules():
        for node in graph_module.graph.nodes if isinstance(graph_module, torch.fx.GraphModule) else []:
            if "stack_trace" in node.meta:
                file, line = re.findall(r"""File "([^"]+)", line ([0-9]+),""", node.meta["stack_trace"])[0]
                tagged[int(line)] = file
    assert sorted(tagged) == [n.serial for n in nodes]
    assert all(tagged[n.serial] == f"dsa-fx|{n.display_path}|{n.op}" for n in nodes)
