"""The rule set's compilation targets, derived from their spec files: one `dsa_target` per
toolchains/targets/<name>.json, named by the file (no list of names to keep). Starlark, not the BUILD file,
because a BUILD file cannot define the function that checks each name."""

load("//rules:defs.bzl", "dsa_target")
load("//rules/private:providers.bzl", "DsaTargetInfo")

_NAME_FIRST = "abcdefghijklmnopqrstuvwxyz0123456789"
_NAME_REST = _NAME_FIRST + "_.-"

def _check_name(spec, name):
    """Fails, naming the spec file, unless `name` is a target name a manifest can list under `targets`
    (manifest.schema.json: ^[a-z0-9][a-z0-9_.-]*$)."""
    ok = name != "" and name[0] in _NAME_FIRST
    for c in name.elems():
        ok = ok and c in _NAME_REST
    if not ok:
        fail(("toolchains/targets/%s: '%s' is not a valid target name (lower-case letters, digits, '_', '.' " +
              "and '-', starting with a letter or digit, as manifests list targets): rename the file") % (spec, name))

def rule_set_targets(specs):
    """Makes a `dsa_target` named `<name>` for each spec file `<name>.json` of `specs`.

    Args:
      specs: the spec files of this package (`glob(["*.json"])`).

    Returns:
      The target names, sorted.
    """
    names = []
    for spec in specs:
        if "/" in spec or not spec.endswith(".json"):
            fail("toolchains/targets/%s: a target spec is a <name>.json file beside this BUILD file" % spec)
        name = spec[:-len(".json")]
        _check_name(spec, name)
        dsa_target(
            name = name,
            spec = spec,
        )
        names.append(name)
    return sorted(names)

def _dsa_target_index_impl(ctx):
    rows = [
        struct(name = t[DsaTargetInfo].name, spec = t[DsaTargetInfo].spec.short_path)
        for t in ctx.attr.targets
    ]
    # In a folder of its own: a glob of the specs' folder (toolchains/targets/*.json) must not find it.
    out = ctx.actions.declare_file(ctx.label.name + "/dsa_targets.json")
    ctx.actions.write(out, json.encode_indent(struct(targets = rows)) + "\n")
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

# The name and spec of every dsa_target given, as JSON: what //tests/targets compares with the spec files, so
# that a spec without its dsa_target fails a test.
dsa_target_index = rule(
    implementation = _dsa_target_index_impl,
    attrs = {
        "targets": attr.label_list(mandatory = True, providers = [DsaTargetInfo]),
    },
)
