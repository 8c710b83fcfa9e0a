"""The Python environment of rules_dsa's actions as a Bazel toolchain.

A dsa_python_toolchain carries one environment (DsaPythonInfo: its interpreter, identity and lock) and
returns it twice: as the provider itself, for an attribute that names an environment (`python_env` of
dsa_model, dsa_pte, the LeRobot stand-ins; `python` of dsa_py_test), and inside a
platform_common.ToolchainInfo, for a `toolchain()` of type //toolchains/python:toolchain_type. Every rule
that runs a rules_dsa tool resolves that type: the registered environment's identity is an input of each of
its actions, so a different environment is a different action key.

Every dsa_python_env repository defines `:env` (this rule) and `:dsa_toolchain` (its toolchain() target).
A workspace chooses the environment of its builds by registering one before rules_dsa's own:

    register_toolchains("@my_python//:dsa_toolchain", "@my_python//:python_toolchain")
"""

DsaPythonInfo = provider(
    doc = "A Python environment rules_dsa's tools run in.",
    fields = {
        "name": "str: the environment's name, for messages (a dsa_python_env's repository name).",
        "interpreter": "File: the interpreter (a dsa_python_env's bin/python3 wrapper).",
        "identity": "File: identity.json (lock digest, interpreter version, installed set); an input of every action run in this environment.",
        "lock": "File or None: the hashed requirements lock the environment was installed from.",
        "files": "list of File: what an action run on `interpreter` needs as inputs: the interpreter and the identity.",
    },
)

def _dsa_python_toolchain_impl(ctx):
    info = DsaPythonInfo(
        name = ctx.attr.env_name or str(ctx.label),
        interpreter = ctx.file.interpreter,
        identity = ctx.file.identity,
        lock = ctx.file.lock,
        files = [ctx.file.interpreter, ctx.file.identity],
    )
    return [
        platform_common.ToolchainInfo(dsa_python = info),
        info,
        DefaultInfo(files = depset(info.files)),
    ]

dsa_python_toolchain = rule(
    implementation = _dsa_python_toolchain_impl,
    doc = """A Python environment for rules_dsa: the target a `toolchain()` of type
`@rules_dsa//toolchains/python:toolchain_type` points at, and what a `python_env` attribute takes.
dsa_python_env generates one (`:env`) in every environment repository; write one yourself to bring an
environment made some other way (its interpreter must run rules_dsa's tools: the packages of
requirements.in).""",
    attrs = {
        "interpreter": attr.label(mandatory = True, allow_single_file = True, doc = "The interpreter (an executable file)."),
        "identity": attr.label(mandatory = True, allow_single_file = [".json"], doc = "identity.json: what the environment is (dsa/core/identity.py writes it)."),
        "lock": attr.label(allow_single_file = True, doc = "The requirements lock the environment was installed from."),
        "env_name": attr.string(doc = "A name for messages; the label by default."),
    },
    provides = [DsaPythonInfo],
)

# The toolchain type the rules resolve. A Label, so that it names this repository's target from any
# workspace (`@rules_dsa//toolchains/python:toolchain_type`).
DSA_PYTHON_TOOLCHAIN_TYPE = Label("//toolchains/python:toolchain_type")

def dsa_python_of(ctx):
    """The DsaPythonInfo of the environment registered for `ctx`'s rule (which declares
    `toolchains = [DSA_PYTHON_TOOLCHAIN_TYPE]`)."""
    toolchain = ctx.toolchains[DSA_PYTHON_TOOLCHAIN_TYPE]
    info = getattr(toolchain, "dsa_python", None) if toolchain else None
    if info == None:
        fail(("%s: the toolchain registered for %s is not a dsa_python_toolchain (no DsaPythonInfo): " +
              "register a dsa_python_env's `:dsa_toolchain`, or a toolchain() whose `toolchain` is a " +
              "dsa_python_toolchain target (docs/python-environments.md).") % (ctx.label, DSA_PYTHON_TOOLCHAIN_TYPE))
    return info
