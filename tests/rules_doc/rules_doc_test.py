"""The rule reference in docs/ is exactly what the generator prints from the rules' doc strings (never
hand-edited), it documents every public name of rules/defs.bzl and, in a section of their own, of
rules/testing.bzl (the stand-in generators and dsa_py_test), and the generator refuses what it cannot read."""

import ast
import textwrap

import pytest

from dsa.tools import rules_doc
from dsa.tools.rules_doc import RulesDocError, cell, render
from dsa.tools.testing import runfile

RULES = ("dsa_model", "dsa_bucket", "dsa_vmfb", "dsa_target", "dsa_pte", "dsa_pipeline", "dsa_python_toolchain", "dsa_bundle")
MACROS = ("dsa_policy", "dsa_policies", "dsa_runner", "dsa_release")
PROVIDERS = ("DsaModelInfo", "DsaBucketInfo", "DsaModuleInfo", "DsaPipelineInfo", "DsaPteInfo", "DsaTargetInfo", "DsaPythonInfo")
# rules/testing.bzl: the stand-in generators (not exported by defs.bzl) and the test macro.
TESTING = ("dsa_checkpoint", "dsa_lerobot_policy", "dsa_lerobot_processors", "dsa_lerobot_tokenizer", "dsa_py_test")


@pytest.fixture(scope="module")
def text():
    return render()


def _section(text, name):
    """The reference's section for `name`: from its heading to the next heading of the same or a higher level."""
    start = text.index(f"\n### {name}\n")
    ends = [i for i in (text.find("\n### ", start + 1), text.find("\n## ", start + 1)) if i != -1]
    return text[start:min(ends) if ends else len(text)]


def _defs_exports(path="rules/defs.bzl"):
    """Public names a .bzl file binds itself (assignments and defs; loaded names are file-local in Starlark)."""
    tree = ast.parse(runfile(path).read_text(encoding="utf-8"))
    names = [n.targets[0].id for n in tree.body if isinstance(n, ast.Assign)] + \
            [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    return {n for n in names if not n.startswith("_")}


def test_checked_in_rule_reference_is_generated_from_the_rules(text):
    checked_in = runfile("docs/rules.md").read_text(encoding="utf-8")
    assert checked_in == text, f"docs/rules.md is out of date; regenerate: {rules_doc.REGENERATE} (or bin/dsa rules-doc)"


def test_reference_says_it_is_generated_and_must_not_be_edited_by_hand(text):
    first = text.splitlines()[0]
    assert "python -m dsa.tools.rules_doc" in first and "do not edit by hand" in first


def test_every_public_name_of_defs_bzl_has_a_section_of_its_kind(text):
    # The lists above are what the brief names; the check against defs.bzl itself catches a new export.
    assert _defs_exports() == set(RULES + MACROS + PROVIDERS)
    for name in RULES + MACROS + PROVIDERS:
        assert f"\n### {name}\n" in text, name
    rules, macros, providers = text.index("\n## Rules\n"), text.index("\n## Macros\n"), text.index("\n## Providers\n")
    assert all(rules < text.index(f"\n### {n}\n") < macros for n in RULES)
    assert all(macros < text.index(f"\n### {n}\n") < providers for n in MACROS)
    assert all(providers < text.index(f"\n### {n}\n") for n in PROVIDERS)


def test_stand_ins_and_the_test_macro_are_documented_apart_from_the_public_api(text):
    assert _defs_exports("rules/testing.bzl") == set(TESTING)
    testing = text.index("\n## Stand-ins and tests (rules/testing.bzl)\n")
    assert all(testing < text.index(f"\n### {n}\n") for n in TESTING)
    assert all(text.index(f"\n### {n}\n") < testing for n in RULES + MACROS + PROVIDERS)
    assert '    load("@rules_dsa//rules:testing.bzl", "dsa_checkpoint",' in text
    # The public API's load line names none of them.
    defs_load = next(line for line in text.splitlines() if 'load("@rules_dsa//rules:defs.bzl"' in line)
    assert not [n for n in TESTING if f'"{n}"' in defs_load], defs_load


@pytest.mark.parametrize("rule, attribute, row", [
    ("dsa_vmfb", "tuning", "| `tuning` | label | optional, default `None` | one file: `.json` | "
     + cell("Tuning file for this model family and target (toolchains/tuning/<family>.<target>.json).") + " |"),
    ("dsa_model", "checkpoint", "| `checkpoint` | label | mandatory | files: `.safetensors`, `.json`, `.onnx`, "
     "`.data`, `.bin` | Checkpoint: a safetensors file, or a sharded checkpoint (a filegroup of its "
     "model.safetensors.index.json and its shards, in one directory); for framework onnx the model's external-data "
     "file (or the .onnx file when its weights are inline). Its sha256 (and each shard's) must match the manifest's. |"),
    ("dsa_bucket", "dim", "| `dim` | string | mandatory |  | The dynamic dim to bucket (e.g. prompt_len). |"),
    ("dsa_target", "spec", "| `spec` | label | mandatory | one file: `.json` | Target spec (JSON): device, backends, runtime driver, flags. |"),
    ("dsa_checkpoint", "out", "| `out` | output | optional, default `None` |  | The .safetensors file to write (without "
     "`shards`). |"),
    ("dsa_lerobot_policy", "config", "| `config` | label | mandatory | one file: `.json` | Policy type and config fields (JSON). |"),
    ("dsa_pipeline", "stages", "| `stages` | label_list | mandatory | providers: `DsaModuleInfo` | dsa_vmfb targets, in run order. |"),
    ("dsa_bundle", "module", "| `module` | label | optional, default `None` | providers: `DsaModuleInfo` | A dsa_vmfb (or set `modules` or `pipeline`). |"),
    ("dsa_bundle", "policy_config", "| `policy_config` | label | optional, default `None` | one file: `.json` | With `processors`: the policy's config.json (the manifest's model.policy_config). |"),
    ("dsa_lerobot_processors", "policy", "| `policy` | label | mandatory | files | The policy directory (a dsa_lerobot_policy): its config.json. |"),
])
def test_each_rule_documents_a_known_attribute_with_its_type_default_and_doc(text, rule, attribute, row):
    assert row in _section(text, rule).splitlines(), f"{rule}.{attribute}"


def test_attributes_from_shared_dicts_are_resolved_through_load_and_overrides_win(text):
    # dsa_model gets python_env from ENV_ATTRS in common.bzl; dsa_lerobot_policy overrides it with its own.
    assert "LeRobot policies (framework: lerobot) need" in _section(text, "dsa_model")
    lerobot = _section(text, "dsa_lerobot_policy")
    assert '`Label("@dsa_lerobot_python//:env")`' in lerobot
    assert "The environment (DsaPythonInfo: a dsa_python_env's `:env`) with LeRobot installed." in lerobot


def test_private_attributes_are_left_out(text):
    for name in RULES + TESTING[:4]:
        assert "| `_" not in _section(text, name), name


def test_macros_show_their_signature_and_docstring(text):
    runner = _section(text, "dsa_runner")
    assert "dsa_runner(name, module, args = [], **kwargs)" in runner
    assert "runs the compiled policy `module`" in runner
    assert "dsa_release(name, bundle, **kwargs)" in _section(text, "dsa_release")


def test_providers_list_their_fields_with_docs(text):
    assert "| `spec` | File: the target spec (JSON) the compile stage reads. |" in _section(text, "DsaTargetInfo")
    assert "| `lock` |" in _section(text, "DsaModuleInfo")


def _tree(tmp_path, private_bzl):
    (tmp_path / "rules" / "private").mkdir(parents=True)
    (tmp_path / "rules" / "defs.bzl").write_text(textwrap.dedent('''\
        """A tiny rule set."""

        load("//rules/private:thing.bzl", _dsa_thing = "dsa_thing")

        dsa_thing = _dsa_thing
        '''), encoding="utf-8")
    (tmp_path / "rules" / "private" / "thing.bzl").write_text(textwrap.dedent(private_bzl), encoding="utf-8")
    return tmp_path


def test_generator_reads_any_root_given_to_it(tmp_path):
    root = _tree(tmp_path, '''\
        SHARED = {"size": attr.int(default = 2, doc = "How " + "big.")}

        dsa_thing = rule(
            implementation = None,
            doc = "A %s." % "thing",
            attrs = dict(SHARED, **{"src": attr.label(mandatory = True, allow_files = [".txt"])}),
        )
        ''')
    text = render(root)
    assert "### dsa_thing" in text and "A thing." in text
    assert "| `size` | int | optional, default `2` |  | How big. |" in text
    assert "| `src` | label | mandatory | files: `.txt` |  |" in text


@pytest.mark.parametrize("construct, line", [
    # An attribute whose default comes from a call the evaluator does not know (would otherwise be dropped).
    ('dsa_thing = rule(\n    implementation = None,\n    attrs = {"x": attr.label(default = select({}))},\n)\n', 3),
    # An attribute type it does not know.
    ('dsa_thing = rule(\n    implementation = None,\n    attrs = {"x": attr.magic()},\n)\n', 3),
    # A top-level statement that could change a dict behind the evaluator's back.
    ('ATTRS = {}\nATTRS.update({"x": attr.int()})\ndsa_thing = rule(implementation = None, attrs = ATTRS)\n', 2),
    # A name defined nowhere.
    ('dsa_thing = rule(implementation = None, attrs = MISSING)\n', 1),
    # str() of something that is neither a string nor a Label.
    ('dsa_thing = rule(implementation = None, toolchains = [str({})])\n', 1),
])
def test_generator_refuses_a_construct_it_cannot_evaluate_naming_file_and_line(tmp_path, construct, line):
    root = _tree(tmp_path, construct)
    with pytest.raises(RulesDocError) as raised:
        render(root)
    assert str(raised.value).startswith(f"rules/private/thing.bzl:{line}: "), str(raised.value)


def test_generator_takes_str_of_a_label_as_a_rule_s_toolchains_and_keeps_the_rule(tmp_path):
    root = _tree(tmp_path, '''\
        TYPE = Label("//toolchains/python:toolchain_type")

        dsa_thing = rule(
            implementation = None,
            doc = "A thing.",
            toolchains = [str(TYPE)],
            attrs = {"n": attr.int(doc = "N.")},
        )
        ''')
    text = render(root)
    assert "### dsa_thing" in text and "| `n` | int | optional, default `0` |  | N. |" in text


def test_generator_refuses_an_unparseable_file_naming_file_and_line(tmp_path):
    root = _tree(tmp_path, 'dsa_thing = rule(\n    implementation = None,\n    attrs = {"x": attr.int(}\n)\n')
    with pytest.raises(RulesDocError, match=r"^rules/private/thing\.bzl:3: cannot parse"):
        render(root)


def test_under_bazel_the_generator_reads_the_bzl_files_of_the_runfiles_tree():
    import os

    if not os.environ.get("TEST_SRCDIR"):
        pytest.skip("not run by bazel test")
    root = rules_doc.default_root()
    assert os.path.abspath(root) == os.path.abspath(runfile(".")), root
    assert (root / "rules" / "defs.bzl").is_file() and (root / "rules" / "private" / "common.bzl").is_file()
