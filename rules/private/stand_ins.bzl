"""The stand-in generators: seeded checkpoints, LeRobot policy directories, processor files and tokenizers.

Real weights, trained policies and Hub tokenizers cannot be downloaded here, so these rules write
deterministic stand-ins (byte-identical on every machine) that the real rules (model.bzl, bundle.bzl) read
exactly as they would read the real files. Each has its own mnemonic: DsaCheckpoint, DsaLeRobotPolicy,
DsaLeRobotProcessors, DsaLeRobotTokenizer. Users load them from //rules:testing.bzl, not //rules:defs.bzl.
"""

load("@rules_python//python:defs.bzl", "PyInfo")
load("//toolchains/python:toolchain.bzl", "DsaPythonInfo")
load(":common.bzl", "ACTION_ENV", "TOOLCHAINS", "TOOL_ATTRS", "execution_requirements", "manifest_view", "python_env_of", "pythonpath_of", "run_tool", "toolchain_identity")
load(":model.bzl", "model_sources")

def shard_names(count):
    """Hugging Face's shard file names for `count` shards (dsa.stages.tensor_files.shard_file_name)."""
    width = 5
    return ["model-%s-of-%s.safetensors" % (_padded(i, width), _padded(count, width)) for i in range(1, count + 1)]

def _padded(number, width):
    text = str(number)
    return "0" * (width - len(text)) + text

def _dsa_checkpoint_impl(ctx):
    view = ctx.actions.declare_file("%s/export_view.json" % ctx.label.name)
    manifest_view(ctx, ctx.file.manifest, "export", view)
    sources, _ = model_sources(ctx.attr.deps)
    source_list = sources.to_list()
    args = ctx.actions.args()
    args.add("--view", view)
    args.add("--seed", str(ctx.attr.seed))
    args.add("--dtype", ctx.attr.dtype)
    args.add_all(pythonpath_of(source_list), before_each = "--pythonpath")
    if ctx.attr.shards:
        if ctx.outputs.out:
            fail("dsa_checkpoint %s: a sharded checkpoint (shards = %d) is written into <name>/; drop `out`" % (ctx.label, ctx.attr.shards))
        index = ctx.actions.declare_file("%s/model.safetensors.index.json" % ctx.label.name)
        outputs = [index] + [ctx.actions.declare_file("%s/%s" % (ctx.label.name, s)) for s in shard_names(ctx.attr.shards)]
        args.add("--shards", str(ctx.attr.shards))
        args.add("--out", index.dirname)
    else:
        if not ctx.outputs.out:
            fail("dsa_checkpoint %s: `out` (the .safetensors file) is required without shards" % ctx.label)
        outputs = [ctx.outputs.out]
        args.add("--out", ctx.outputs.out)
    ctx.actions.run(
        executable = ctx.executable._checkpoint_tool,
        arguments = [args],
        inputs = depset([view, toolchain_identity(ctx)], transitive = [sources]),
        outputs = outputs,
        mnemonic = "DsaCheckpoint",
        progress_message = "Generating seeded checkpoint %s" % outputs[0].short_path,
        env = ACTION_ENV,
        execution_requirements = execution_requirements(ctx),
    )
    # Runfiles too: a test that lists the checkpoint in `data` reads it (a sharded one by its index).
    return [DefaultInfo(files = depset(outputs), runfiles = ctx.runfiles(files = outputs))]

dsa_checkpoint = rule(
    implementation = _dsa_checkpoint_impl,
    toolchains = TOOLCHAINS,
    doc = """A deterministic, seeded checkpoint for the manifest's model (for models whose real weights are
not at hand). Byte-identical on every machine, so the manifest can pin its sha256 like any checkpoint's.""",
    attrs = dict(TOOL_ATTRS, **{
        "manifest": attr.label(mandatory = True, allow_single_file = [".yaml", ".yml"], doc = "Deployment manifest (its export view builds the model)."),
        "deps": attr.label_list(providers = [PyInfo], doc = "py_library targets holding the model code."),
        "seed": attr.int(default = 0, doc = "Seed of the generated weights."),
        "dtype": attr.string(default = "float32", values = ["float32", "bfloat16"], doc = "Float dtype the weights are saved in (bfloat16: as large models are published)."),
        "shards": attr.int(default = 0, doc = "Write a sharded checkpoint of this many shards into `<name>/` (model-0000i-of-0000N.safetensors and model.safetensors.index.json, Hugging Face's layout) instead of `out`."),
        "out": attr.output(doc = "The .safetensors file to write (without `shards`)."),
        "_checkpoint_tool": attr.label(default = Label("//dsa:checkpoint_tool"), executable = True, cfg = "exec"),
    }),
)

def _dsa_lerobot_policy_impl(ctx):
    out_config = ctx.outputs.config_json
    out_weights = ctx.outputs.weights
    args = ctx.actions.args()
    args.add("init")
    args.add("--config-file", ctx.file.config)
    args.add("--seed", str(ctx.attr.seed))
    if ctx.attr.weights != "lerobot" or ctx.attr.dtype != "float32":
        args.add("--weights", ctx.attr.weights)
        args.add("--dtype", ctx.attr.dtype)
    args.add("--out-dir", out_config.dirname)
    run_tool(
        ctx,
        python_env_of(ctx.attr.python_env),
        ctx.attr._lerobot_tool,
        "dsa.frontends.lerobot.cli",
        [args],
        depset([ctx.file.config]),
        outputs = [out_config, out_weights],
        mnemonic = "DsaLeRobotPolicy",
        progress_message = "Initialising LeRobot policy %s" % ctx.label,
        execution_requirements = execution_requirements(ctx),
    )
    return [DefaultInfo(
        files = depset([out_config, out_weights]),
        runfiles = ctx.runfiles(files = [out_config, out_weights]),
    )]

# What the rules that run LeRobot itself share: the tools and the LeRobot environment (LeRobot, transformers,
# tokenizers) as their default `python_env`.
_LEROBOT_ENV_ATTRS = dict(TOOL_ATTRS, **{
    "python_env": attr.label(
        default = Label("@dsa_lerobot_python//:env"),
        providers = [DsaPythonInfo],
        cfg = "exec",
        doc = "The environment (DsaPythonInfo: a dsa_python_env's `:env`) with LeRobot installed.",
    ),
})

dsa_lerobot_policy = rule(
    implementation = _dsa_lerobot_policy_impl,
    toolchains = TOOLCHAINS,
    doc = """A LeRobot policy with seeded random weights, saved in LeRobot's own format by LeRobot's own
`save_pretrained`: `<name>/config.json` and `<name>/model.safetensors`, byte-identical on every machine
(stand-ins for trained policies, which cannot be downloaded here). `config` is a JSON file: the policy
`type` (act, diffusion) and the fields of LeRobot's config class for it, features included.""",
    attrs = dict(_LEROBOT_ENV_ATTRS, **{
        "config": attr.label(mandatory = True, allow_single_file = [".json"], doc = "Policy type and config fields (JSON)."),
        "seed": attr.int(default = 0),
        "weights": attr.string(default = "lerobot", values = ["lerobot", "seeded"], doc = "lerobot: LeRobot's own random initialisation and save_pretrained (the whole model in memory: small policies); seeded: the same tensors seeded per tensor and written one at a time (policies of any size: a 3.5B PI0 needs the memory of its largest tensor)."),
        "dtype": attr.string(default = "float32", values = ["float32", "bfloat16"], doc = "Float dtype of `seeded` weights."),
        "_lerobot_tool": attr.label(default = Label("//dsa:lerobot_tool"), executable = True, cfg = "exec"),
    }),
    # Predeclared, so that `:<name>/config.json` and `:<name>/model.safetensors` are labels a dsa_model
    # (and a manifest's relative paths) can name.
    outputs = {
        "config_json": "%{name}/config.json",
        "weights": "%{name}/model.safetensors",
    },
)

# What the processor and tokenizer stand-in rules share: the LeRobot environment and the stand-in tool.
_LEROBOT_STAND_IN_ATTRS = dict(_LEROBOT_ENV_ATTRS, **{
    "_processors_tool": attr.label(default = Label("//dsa:lerobot_processors_tool"), executable = True, cfg = "exec"),
})

def _dsa_lerobot_processors_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    config = [f for f in ctx.files.policy if f.basename == "config.json"]
    if len(config) != 1:
        fail("dsa_lerobot_processors %s: `policy` must hold exactly one config.json, it holds %d" % (ctx.label, len(config)))
    args = ctx.actions.args()
    args.add("processors")
    args.add("--policy-dir", config[0].dirname)
    args.add("--seed", str(ctx.attr.seed))
    args.add("--out-dir", out.path)
    inputs = [config[0]]
    if ctx.files.tokenizer:
        tokenizer_json = [f for f in ctx.files.tokenizer if f.basename == "tokenizer.json"]
        if len(tokenizer_json) != 1:
            fail("dsa_lerobot_processors %s: `tokenizer` must hold a tokenizer.json" % ctx.label)
        args.add("--tokenizer", tokenizer_json[0].dirname)
        inputs += ctx.files.tokenizer
    run_tool(
        ctx,
        python_env_of(ctx.attr.python_env),
        ctx.attr._processors_tool,
        "dsa.frontends.lerobot_processors",
        [args],
        depset(inputs),
        outputs = [out],
        mnemonic = "DsaLeRobotProcessors",
        progress_message = "Writing LeRobot processor pipelines of %s" % ctx.label,
        execution_requirements = execution_requirements(ctx),
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

dsa_lerobot_processors = rule(
    implementation = _dsa_lerobot_processors_impl,
    toolchains = TOOLCHAINS,
    doc = """A LeRobot policy's pre- and post-processor pipelines with seeded dataset statistics, saved by LeRobot's
own `make_pre_post_processors` + `save_pretrained` into the directory `<name>/` (policy_preprocessor.json,
policy_postprocessor.json, their statistics .safetensors), byte-identical on every machine: stand-ins for the
files a trained policy directory holds. A dsa_bundle with `processors` ships them (docs/policy-pipeline.md).""",
    attrs = dict(_LEROBOT_STAND_IN_ATTRS, **{
        "policy": attr.label(mandatory = True, allow_files = True, doc = "The policy directory (a dsa_lerobot_policy): its config.json."),
        "seed": attr.int(default = 0),
        "tokenizer": attr.label(allow_files = True, doc = "Tokenizer directory files (tokenizer.json + tokenizer_config.json) for SmolVLA, PI0, PI0.5."),
    }),
)

def _dsa_lerobot_tokenizer_impl(ctx):
    outs = [ctx.outputs.tokenizer_json, ctx.outputs.tokenizer_config, ctx.outputs.special_tokens_map]
    args = ctx.actions.args()
    args.add("tokenizer")
    args.add("--out-dir", ctx.outputs.tokenizer_json.dirname)
    run_tool(
        ctx,
        python_env_of(ctx.attr.python_env),
        ctx.attr._processors_tool,
        "dsa.frontends.lerobot_processors",
        [args],
        depset(),
        outputs = outs,
        mnemonic = "DsaLeRobotTokenizer",
        progress_message = "Training the stand-in tokenizer %s" % ctx.label,
        execution_requirements = execution_requirements(ctx),
    )
    return [DefaultInfo(files = depset(outs), runfiles = ctx.runfiles(files = outs))]

dsa_lerobot_tokenizer = rule(
    implementation = _dsa_lerobot_tokenizer_impl,
    toolchains = TOOLCHAINS,
    doc = """A stand-in tokenizer directory (`<name>/tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`): a BPE tokenizer trained in the build with the `tokenizers` library on a fixed corpus
of task texts, saved as transformers saves a Hub tokenizer; byte-identical on every machine. For the
VLAs' processors (dsa_lerobot_processors `tokenizer`), since their real tokenizers cannot be downloaded here.""",
    attrs = _LEROBOT_STAND_IN_ATTRS,
    outputs = {
        "tokenizer_json": "%{name}/tokenizer.json",
        "tokenizer_config": "%{name}/tokenizer_config.json",
        "special_tokens_map": "%{name}/special_tokens_map.json",
    },
)
