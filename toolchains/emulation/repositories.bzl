"""The IREE runtime tools built for another CPU, from the pinned `iree-base-runtime` wheel of that platform.

`dsa_runtime_tools(name, platform, version, sha256)` downloads the wheel with pip (the machine's pip
configuration and package index, as the Python environment does), checks its sha256 against the pinned one
and unpacks its tools (`iree-run-module`, `iree-benchmark-module`, `iree-dump-module`, ...) into `bin/`.
//tests/targets runs the aarch64 ones under qemu user-mode emulation (toolchains/emulation/install.sh) to
check the modules cross-compiled for aarch64 against eager PyTorch.
"""

def _run(rctx, argv, what):
    result = rctx.execute(argv, timeout = 900, environment = {"PYTHONNOUSERSITE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if result.return_code != 0:
        fail("dsa_runtime_tools(name = \"{}\"): {} failed (exit {}):\n{}\n{}".format(
            rctx.name, what, result.return_code, result.stdout, result.stderr))
    return result.stdout

def _dsa_runtime_tools_impl(rctx):
    python = rctx.os.environ.get("DSA_PYTHON") or "python3.11"
    found = rctx.path(python) if "/" in python else rctx.which(python)
    if not found or not found.exists:
        fail("dsa_runtime_tools: no Python interpreter '{}' (set DSA_PYTHON)".format(python))
    rctx.report_progress("downloading iree-base-runtime {} for {}".format(rctx.attr.version, rctx.attr.platform))
    _run(rctx, [
        found, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
        "--platform", rctx.attr.platform, "--python-version", rctx.attr.python_version,
        "iree-base-runtime==" + rctx.attr.version, "-d", "wheel",
    ], "pip download")
    # Checks the digest and unpacks the tools: a wheel is a zip file.
    _run(rctx, [found, "-c", """
import hashlib, pathlib, stat, sys, zipfile
wheels = sorted(pathlib.Path("wheel").glob("*.whl"))
if len(wheels) != 1:
    sys.exit(f"expected one wheel, found {[w.name for w in wheels]}")
digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
if digest != sys.argv[1]:
    sys.exit(f"{wheels[0].name} has sha256 {digest}, the pin is {sys.argv[1]}: update the pin in "
             "WORKSPACE.bazel / MODULE.bazel only for a release you mean to use")
out = pathlib.Path("bin")
out.mkdir()
with zipfile.ZipFile(wheels[0]) as archive:
    for info in archive.infolist():
        name = info.filename
        if name.startswith("iree/_runtime_libs/iree-") and "/" not in name[len("iree/_runtime_libs/"):]:
            target = out / name.rsplit("/", 1)[1]
            target.write_bytes(archive.read(info))
            target.chmod(0o755)
print(wheels[0].name)
""", rctx.attr.sha256], "checking and unpacking the wheel")
    rctx.delete("wheel")
    rctx.file("BUILD.bazel", """package(default_visibility = ["//visibility:public"])

# The IREE runtime tools for {platform} (iree-base-runtime {version}).
filegroup(
    name = "tools",
    srcs = glob(["bin/*"]),
)
""".format(platform = rctx.attr.platform, version = rctx.attr.version))
    rctx.file("WORKSPACE", "workspace(name = \"{}\")\n".format(rctx.name))

dsa_runtime_tools = repository_rule(
    implementation = _dsa_runtime_tools_impl,
    doc = "The IREE runtime tools of the `iree-base-runtime` wheel for another platform, pinned by sha256.",
    attrs = {
        "platform": attr.string(mandatory = True, doc = "pip's --platform, e.g. manylinux_2_28_aarch64."),
        "python_version": attr.string(default = "3.11"),
        "version": attr.string(mandatory = True, doc = "iree-base-runtime version (the project's lock pins the same)."),
        "sha256": attr.string(mandatory = True, doc = "sha256 of the wheel."),
    },
    environ = ["DSA_PYTHON"],
)
