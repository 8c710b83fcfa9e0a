"""Unit tests of the rules' pure Starlark helpers (bazel-skylib unittest): functions of strings, lists and
file-like values that take no ctx, so they run on fakes (structs with a File's fields) without a build.

    bazel test //tests/rules:helpers_tests

Uses only what bazel-skylib 1.0.3 (Debian's package; WORKSPACE.bazel) has: unittest.make, unittest.suite,
asserts.equals."""

load("@bazel_skylib//lib:unittest.bzl", "asserts", "unittest")
load("//rules/private:common.bzl", "pythonpath_of", "repo_relative")
load("//rules/private:model.bzl", "checkpoint_files")
load("//rules/private:stand_ins.bzl", "shard_names")

def _file(short_path, root = "", workspace_root = ""):
    """A stand-in for a File: the fields the helpers read."""
    dirname, _, basename = short_path.rpartition("/")
    return struct(
        short_path = short_path,
        basename = basename,
        dirname = dirname,
        root = struct(path = root),
        owner = struct(workspace_root = workspace_root),
    )

def _shard_names_test_impl(ctx):
    env = unittest.begin(ctx)
    asserts.equals(env, [], shard_names(0))
    asserts.equals(env, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], shard_names(2))
    # Hugging Face's names: five digits, padded, whatever the count (dsa.stages.tensor_files.shard_file_name).
    asserts.equals(env, "model-00012-of-00012.safetensors", shard_names(12)[11])
    asserts.equals(env, 12, len(shard_names(12)))
    return unittest.end(env)

shard_names_test = unittest.make(_shard_names_test_impl)

def _repo_relative_test_impl(ctx):
    env = unittest.begin(ctx)
    asserts.equals(env, "dsa/stages/export.py", repo_relative(_file("dsa/stages/export.py")))
    # A file of another repository (rules_dsa used from a user's workspace): the same path as in its own.
    asserts.equals(env, "dsa/stages/export.py", repo_relative(_file("../rules_dsa/dsa/stages/export.py")))
    asserts.equals(env, "models/pi0/pi0.py", repo_relative(_file("../user_ws/models/pi0/pi0.py")))
    return unittest.end(env)

repo_relative_test = unittest.make(_repo_relative_test_impl)

def _pythonpath_of_test_impl(ctx):
    env = unittest.begin(ctx)
    asserts.equals(env, [], pythonpath_of([]))
    asserts.equals(env, ["."], pythonpath_of([_file("models/pi0/pi0.py"), _file("models/pi0/__init__.py")]))
    files = [
        _file("dsa/stages/export.py", workspace_root = "external/rules_dsa"),
        _file("models/gen.py", root = "bazel-out/k8-fastbuild/bin"),
        _file("models/pi0/pi0.py"),
        _file("dsa/gen.py", root = "bazel-out/k8-fastbuild/bin", workspace_root = "external/rules_dsa"),
        _file("dsa/core/errors.py", workspace_root = "external/rules_dsa"),
    ]

    # One root per (output root, repository), each once, sorted: the same list in any order of `files`.
    expected = [".", "bazel-out/k8-fastbuild/bin", "bazel-out/k8-fastbuild/bin/external/rules_dsa", "external/rules_dsa"]
    asserts.equals(env, expected, pythonpath_of(files))
    asserts.equals(env, expected, pythonpath_of(reversed(files)))
    return unittest.end(env)

pythonpath_of_test = unittest.make(_pythonpath_of_test_impl)

def _checkpoint_files_test_impl(ctx):
    env = unittest.begin(ctx)
    single = _file("models/pi0.safetensors")
    asserts.equals(env, (single, []), checkpoint_files("//models:pi0", [single]))

    # A sharded checkpoint: the index, and its shards sorted by name whatever the order given.
    index = _file("models/big/model.safetensors.index.json")
    first = _file("models/big/model-00001-of-00002.safetensors")
    second = _file("models/big/model-00002-of-00002.safetensors")
    asserts.equals(env, (index, [first, second]), checkpoint_files("//models:big", [second, index, first]))
    return unittest.end(env)

checkpoint_files_test = unittest.make(_checkpoint_files_test_impl)

def dsa_helpers_unit_tests(name):
    """A test_suite `name` of the unit tests above (targets `<name>_test_<i>`)."""
    unittest.suite(
        name,
        shard_names_test,
        repo_relative_test,
        pythonpath_of_test,
        checkpoint_files_test,
    )
