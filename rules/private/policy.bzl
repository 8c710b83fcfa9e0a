"""dsa_policy: one call per model — checkpoint (or LeRobot policy directory), model, buckets and vmfb.

dsa_policies: the package's policies (and pipelines), discovered from the targets dsa_policy made, as one
index the tools read (bazel-bin/<pkg>/<name>.json) — so no tool keeps a list of models by hand."""

load("@rules_python//python:defs.bzl", "py_library")
load(":bucket.bzl", "dsa_bucket")
load(":link.bzl", "dsa_pipeline")
load(":model.bzl", "dsa_model")
load(":stand_ins.bzl", "dsa_checkpoint", "dsa_lerobot_policy")
load(":providers.bzl", "DsaModuleInfo", "DsaPipelineInfo")
load(":vmfb.bzl", "dsa_vmfb")

# The tag dsa_policy puts on the dsa_vmfb it makes; dsa_policies finds the package's policies by it.
POLICY_TAG = "dsa_policy"
# The tag of real-size policies (and pipelines): dsa_policies indexes them apart (`<name>_real_size`), so that
# the default index, the benchmark's sets and `bazel build //...` never build them.
REAL_SIZE_TAG = "real_size"
_TEST_TAG = "dsa_parity_test="
# On the dsa_vmfb of a policy built for a further target (`more_targets`, `levels`): the policy it is a build of.
_BUILD_OF_TAG = "dsa_policy_build_of="
# On the dsa_vmfb of a level (`levels`): the policy whose default build holds it.
_LEVEL_OF_TAG = "dsa_policy_level_of="

# The LeRobot environment and front end: what every `framework: lerobot` model's export needs.
_LEROBOT_ENV = Label("@dsa_lerobot_python//:env")
_LEROBOT_FRONTEND = Label("//dsa:lerobot")

# Attributes every generated target takes from the macro's caller.
_COMMON = ["visibility", "testonly", "compatible_with", "restricted_to", "features"]

def dsa_policy(
        name,
        manifest,
        target,
        deps = [],
        checkpoint = None,
        seed = 0,
        lerobot_config = None,
        lerobot_policy = None,
        policy_config = None,
        model_file = None,
        bucket = None,
        tuning = None,
        more_targets = {},
        levels = {},
        python_env = None,
        parity_test = None,
        stand_in = {},
        tags = [],
        **kwargs):
    """A compiled policy in one call: `bazel build :<name>` builds its modules for `target`.

    Makes, with predictable names:
      * the weights — `checkpoint` as given (a .safetensors label, or a LeRobot policy directory's
        `model.safetensors`); else, for a LeRobot policy, `<name>_policy` (dsa_lerobot_policy from
        `lerobot_config`: `<name>_policy/config.json` + `model.safetensors`, seeded); else `<name>_checkpoint`
        (dsa_checkpoint, seeded stand-in weights written to `<name>.safetensors`);
      * `<name>_model` (dsa_model), `<name>_buckets` (dsa_bucket, when `bucket` is given) and `<name>`
        (dsa_vmfb, tagged "dsa_policy" so that dsa_policies and the tools find it);
      * for each of `more_targets`, `<name>_<target name>`: the same exports compiled for that target (a
        dsa_vmfb of its own: its modules, index and lock), found by the tools like `<name>`.
      * for each of `levels`, `<name>_<target name>` as well, and `<name>` holds it: `bazel build :<name>`
        builds every level, `<name>`'s index lists them, and the runner takes the most capable one the
        machine executes.

    Args:
      name: the policy's name: the dsa_vmfb target, and the prefix of the targets it makes.
      manifest: the deployment manifest (its sha256 pins must match the weights).
      target: a dsa_target the manifest lists under `targets`.
      deps: py_library targets with the model code (the manifest's `model.entry_point`). A LeRobot policy
        needs none: the LeRobot front end (//dsa:lerobot) is added.
      checkpoint: real (or shared) weights: a .safetensors label. Unset: seeded stand-in weights.
      seed: the seed of generated weights.
      lerobot_config: a LeRobot policy: the JSON of its config (type and fields) from which
        `<name>_policy` is made with LeRobot's own save_pretrained.
      lerobot_policy: a LeRobot policy directory target already in the package (a dsa_lerobot_policy), to
        share its weights and config.json instead of making one.
      policy_config: a trained LeRobot policy's config.json (with `checkpoint`, its model.safetensors).
      model_file: frameworks onnx and stablehlo: the model file (the manifest's model.file), with
        `checkpoint` (an ONNX model's external-data file, or the .onnx itself when its weights are inline; a
        StableHLO module's parameters as .safetensors).
      bucket: `{"dim": DIM, "count": N}`: one module per size of the manifest's `buckets.DIM` list.
      tuning: the measured tuning file of the model's family for `target` (toolchains/tuning).
      more_targets: {dsa_target label: its tuning file label, or None}: further targets to build the same
        exports for, e.g. an AVX-512 build beside a portable x86-64-v3 `target`. Each must be among the
        manifest's `targets`; a runner refuses a build its machine cannot execute (the target spec's `host`).
      levels: {dsa_target label: its tuning file label, or None}: further targets of the same machines that
        the default build holds beside `target` — every x86-64 level the manifest lists (x86_64-v4 beside a
        portable x86_64-v3 `target`). `dsa run`, `dsa.runtime.load`, the runner and a bundle of `<name>` take
        the most capable build this machine executes (by the target specs' `host` CPU features), and say
        which; no output depends on the building machine. Each must be among the manifest's `targets`.
      python_env: the dsa_python_env to export in; LeRobot policies default to @dsa_lerobot_python.
      stand_in: how seeded stand-in weights are made, for real-size models: {"dtype": "bfloat16"} saves them
        in bf16 (as large models are published), {"shards": N} as a sharded checkpoint (`<name>_checkpoint/`,
        Hugging Face's index and N shards; not for LeRobot policies, which LeRobot saves as one file), and for
        a LeRobot policy {"weights": "seeded"} seeds each tensor and streams them instead of LeRobot's own
        initialisation (which holds the whole model). Default: float32, one file, LeRobot's initialisation.
      parity_test: the label of the test that checks the compiled policy against eager (the import matrix
        reports its result).
      tags: added to every target made; execution tags (no-remote-cache, ...) reach their actions.
      **kwargs: visibility, testonly, ... — passed to every target made.
    """
    common = {k: v for k, v in kwargs.items() if k in _COMMON}
    unknown = [k for k in kwargs if k not in _COMMON]
    if unknown:
        fail("dsa_policy %s: unknown argument(s) %s" % (name, ", ".join(unknown)))
    if len([x for x in [lerobot_config, lerobot_policy, policy_config] if x]) > 1:
        fail("dsa_policy %s: set at most one of lerobot_config (make a policy directory), lerobot_policy (use " % name +
             "one of this package) and policy_config (a trained policy's config.json, with checkpoint)")
    if policy_config and not checkpoint:
        fail("dsa_policy %s: policy_config needs checkpoint (the policy's model.safetensors)" % name)
    if model_file and not checkpoint:
        fail("dsa_policy %s: model_file needs checkpoint (its weights; no seeded stand-in is made for a model file)" % name)
    if model_file and (deps or lerobot_config or lerobot_policy or policy_config):
        fail("dsa_policy %s: model_file is imported as it is: it takes no deps and no LeRobot policy" % name)
    if bucket != None and sorted(bucket.keys()) != ["count", "dim"]:
        fail("dsa_policy %s: bucket must be {\"dim\": DIM, \"count\": N}, got %s" % (name, bucket))

    unknown_stand_in = [k for k in stand_in if k not in ("dtype", "shards", "weights")]
    if unknown_stand_in:
        fail("dsa_policy %s: stand_in takes dtype, shards and weights, not %s" % (name, ", ".join(unknown_stand_in)))
    if lerobot_config:
        if stand_in.get("shards"):
            fail("dsa_policy %s: a LeRobot policy directory holds one model.safetensors; stand_in cannot shard it" % name)
        lerobot_policy = ":%s_policy" % name
        dsa_lerobot_policy(
            name = name + "_policy",
            config = lerobot_config,
            seed = seed,
            weights = stand_in.get("weights", "lerobot"),
            dtype = stand_in.get("dtype", "float32"),
            tags = tags,
            **common
        )
    elif stand_in.get("weights"):
        fail("dsa_policy %s: stand_in weights applies to a LeRobot policy made from lerobot_config" % name)
    if lerobot_policy:
        policy_config = lerobot_policy + "/config.json"
        checkpoint = checkpoint or lerobot_policy + "/model.safetensors"
    if policy_config:
        deps = deps + [str(_LEROBOT_FRONTEND)]
        python_env = python_env or str(_LEROBOT_ENV)
    if not checkpoint:
        shards = stand_in.get("shards", 0)
        dsa_checkpoint(
            name = name + "_checkpoint",
            out = None if shards else name + ".safetensors",
            manifest = manifest,
            seed = seed,
            dtype = stand_in.get("dtype", "float32"),
            shards = shards,
            deps = deps,
            tags = tags,
            **common
        )
        checkpoint = ":%s_checkpoint" % name if shards else ":%s.safetensors" % name

    dsa_model(
        name = name + "_model",
        checkpoint = checkpoint,
        manifest = manifest,
        policy_config = policy_config,
        model_file = model_file,
        python_env = python_env,
        deps = deps,
        tags = tags,
        **common
    )
    src = ":%s_model" % name
    if bucket != None:
        dsa_bucket(name = name + "_buckets", count = bucket["count"], dim = bucket["dim"], model = src, tags = tags, **common)
        src = ":%s_buckets" % name
    test_tags = [_TEST_TAG + parity_test] if parity_test else []
    both = [t for t in levels if t in more_targets]
    if both:
        fail("dsa_policy %s: %s is in both levels and more_targets; a level is built with <name> already" % (name, ", ".join(both)))
    dsa_vmfb(
        name = name,
        src = src,
        target = target,
        tuning = tuning,
        levels = [":%s_%s" % (name, t.rpartition(":")[2]) for t in levels],
        tags = tags + [POLICY_TAG] + test_tags,
        **common
    )
    for more, more_tuning in dict(levels, **more_targets).items():
        dsa_vmfb(
            name = "%s_%s" % (name, more.rpartition(":")[2]),
            src = src,
            target = more,
            tuning = more_tuning,
            tags = tags + [POLICY_TAG, _BUILD_OF_TAG + name] + ([_LEVEL_OF_TAG + name] if more in levels else []) + test_tags,
            **common
        )

def _tag_value(rule, prefix):
    """The value of `rule`'s first tag `<prefix><value>` (native.existing_rules' view of a target), or ""."""
    return ([t[len(prefix):] for t in rule.get("tags", []) if t.startswith(prefix)] + [""])[0]

def _index_impl(ctx):
    rows = []
    for policy, test, level_of, build_of in zip(ctx.attr.policies, ctx.attr.tests, ctx.attr.level_of, ctx.attr.build_of):
        model = policy[DsaModuleInfo].model
        config = model.policy_config
        rows.append(struct(
            name = policy.label.name,
            label = str(policy.label),
            index = policy[DsaModuleInfo].index.short_path,
            # A LeRobot policy's config.json (its directory also holds model.safetensors), else None.
            policy_config = config.short_path if config else None,
            # What `dsa compile` needs to build the same model without Bazel (the import matrix times it):
            # the manifest, the checkpoint, and the interpreter of its environment (None: the toolchain's).
            manifest = model.manifest.short_path,
            checkpoint = model.checkpoint.short_path,
            python = model.python_env.python.short_path if model.python_env else None,
            # Frameworks onnx, stablehlo: the model file the export imports, else None.
            model_file = model.model_file.short_path if model.model_file else None,
            test = test,
            # The policy whose default build holds this one as a level, else None.
            level_of = level_of or None,
            # The policy this is a further build of (a level, or one of `more_targets`), else None.
            build_of = build_of or None,
            # The targets its index stands for: its own, then its levels' (the runner takes the most capable).
            targets = [policy[DsaModuleInfo].target.name] + [m.target.name for m in policy[DsaModuleInfo].levels],
        ))
    pipelines = []
    for pipeline, test in zip(ctx.attr.pipelines, ctx.attr.pipeline_tests):
        info = pipeline[DsaPipelineInfo]
        pipelines.append(struct(
            name = pipeline.label.name,
            label = str(pipeline.label),
            index = info.index.short_path,
            stages = info.stage_names,
            test = test,
        ))
    out = ctx.actions.declare_file(ctx.label.name + ".json")
    ctx.actions.write(out, json.encode_indent(struct(format = 1, policies = rows, pipelines = pipelines)) + "\n")
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

_dsa_policy_index = rule(
    implementation = _index_impl,
    doc = "The index dsa_policies writes (JSON only): every policy (dsa_vmfb) and pipeline of a package, with its parity test.",
    attrs = {
        "policies": attr.label_list(providers = [DsaModuleInfo]),
        "tests": attr.string_list(),
        "level_of": attr.string_list(),
        "build_of": attr.string_list(),
        "pipelines": attr.label_list(providers = [DsaPipelineInfo]),
        "pipeline_tests": attr.string_list(),
    },
)

def _set_impl(ctx):
    targets = ctx.attr.srcs
    runfiles = ctx.runfiles(files = ctx.files.srcs)
    for t in targets:
        runfiles = runfiles.merge(t[DefaultInfo].default_runfiles)
    return [DefaultInfo(files = depset(transitive = [t[DefaultInfo].files for t in targets]), runfiles = runfiles)]

_dsa_policy_set = rule(
    implementation = _set_impl,
    doc = "The index and every policy's outputs (modules, records, MLIR, archives), as files and runfiles.",
    attrs = {"srcs": attr.label_list()},
)

def dsa_policies(name, pipeline_tests = {}, **kwargs):
    """Call last in a BUILD file. Indexes every policy dsa_policy made above it and every dsa_pipeline —
    discovered from the package's targets, so no tool keeps a list of models by hand:

      * `<name>_index`: bazel-bin/<pkg>/<name>_index.json alone (each policy's name, label, module index and
        parity test; each pipeline's stages);
      * `<name>`: that index plus every policy's and pipeline's outputs (modules, records, MLIR, archives) as
        files and runfiles: what the import matrix needs (`bazel build //models:policies` builds them all);
      * `<name>_lerobot`: the index plus the LeRobot policies (framework lerobot) with their policy
        directories and exported MLIR: what the benchmark and the tuner run in the LeRobot environment;
      * `<name>_real_size` (and `<name>_real_size_index`): the same index and outputs for the policies and
        pipelines tagged "real_size" (manual), which the sets above leave out;
      * `<name>_code`: a py_library of every policy's model code (the dsa_models' `deps`), and
        `<name>_checkpoints`: the seeded checkpoints dsa_policy made — what the benchmark reads, without
        building (or fetching the environment of) any policy.

    Args:
      name: the target name.
      pipeline_tests: {pipeline name: the label of its parity test}.
      **kwargs: visibility, tags, ... (both targets).
    """
    policies, tests, models, level_of, build_of = [], [], [], [], []
    pipelines, ptests = [], []
    code, checkpoints, lerobot = {}, [], []
    real_policies, real_tests, real_models, real_pipelines, real_ptests, real_level_of, real_build_of = [], [], [], [], [], [], []
    rules = native.existing_rules()
    for rule_name, r in rules.items():
        if REAL_SIZE_TAG in r.get("tags", []) and r["kind"] in ("dsa_vmfb", "dsa_pipeline"):
            # Real-size policies (tens of GB, built on request): indexed apart, in `<name>_real_size`.
            if r["kind"] == "dsa_pipeline":
                real_pipelines.append(":" + rule_name)
                real_ptests.append(pipeline_tests.get(rule_name, ""))
            elif POLICY_TAG in r["tags"]:
                real_policies.append(":" + rule_name)
                real_tests.append(_tag_value(r, _TEST_TAG))
                real_level_of.append(_tag_value(r, _LEVEL_OF_TAG))
                real_build_of.append(_tag_value(r, _BUILD_OF_TAG))
                base = _tag_value(r, _BUILD_OF_TAG) or rule_name
                real_models += [":%s_model" % base] + ([":%s_buckets" % base] if (base + "_buckets") in rules else [])
            continue
        if r["kind"] == "dsa_vmfb" and POLICY_TAG in r.get("tags", []):
            policies.append(":" + rule_name)
            tests.append(_tag_value(r, _TEST_TAG))
            level_of.append(_tag_value(r, _LEVEL_OF_TAG))
            build_of.append(_tag_value(r, _BUILD_OF_TAG))
            # A build for a further target shares the helpers of the policy it is a build of.
            base = _tag_value(r, _BUILD_OF_TAG) or rule_name
            models.append(":%s_model" % base)
            for dep in rules.get(base + "_model", {}).get("deps", []):
                code[dep] = True
            if (base + "_checkpoint") in rules:
                checkpoints.append(":%s_checkpoint" % base)
            if (base + "_buckets") in rules:
                models.append(":%s_buckets" % base)
            policy_config = rules.get(base + "_model", {}).get("policy_config")
            if policy_config:
                # The policy, its LeRobot policy directory (config.json + model.safetensors) and the MLIR its
                # modules were compiled from (the tuner compiles it again with each candidate's flags).
                mlir = ":%s_buckets" % base if (base + "_buckets") in rules else ":%s_model" % base
                lerobot += [":" + rule_name, policy_config.rpartition("/")[0], mlir]
        elif r["kind"] == "dsa_pipeline":
            pipelines.append(":" + rule_name)
            ptests.append(pipeline_tests.get(rule_name, ""))
    unknown = [p for p in pipeline_tests if ":" + p not in pipelines + real_pipelines]
    if unknown:
        fail("dsa_policies %s: pipeline_tests names no dsa_pipeline of this package: %s" % (name, ", ".join(unknown)))
    _dsa_policy_index(
        name = name + "_index",
        policies = policies,
        tests = tests,
        level_of = level_of,
        build_of = build_of,
        pipelines = pipelines,
        pipeline_tests = ptests,
        **kwargs
    )
    _dsa_policy_set(
        name = name,
        srcs = [":%s_index" % name] + policies + pipelines + sorted({m: True for m in models}.keys()),
        **kwargs
    )
    _dsa_policy_set(
        name = name + "_lerobot",
        srcs = [":%s_index" % name] + sorted({t: True for t in lerobot}.keys()),
        **kwargs
    )
    py_library(
        name = name + "_code",
        deps = sorted(code.keys()),
        **kwargs
    )
    native.filegroup(
        name = name + "_checkpoints",
        srcs = sorted({c: True for c in checkpoints}.keys()),
        **kwargs
    )
    real_kwargs = dict(kwargs, tags = kwargs.get("tags", []) + ["manual"])
    _dsa_policy_index(
        name = name + "_real_size_index",
        policies = real_policies,
        tests = real_tests,
        level_of = real_level_of,
        build_of = real_build_of,
        pipelines = real_pipelines,
        pipeline_tests = real_ptests,
        **real_kwargs
    )
    _dsa_policy_set(
        name = name + "_real_size",
        srcs = [":%s_real_size_index" % name] + real_policies + real_pipelines + sorted({m: True for m in real_models}.keys()),
        **real_kwargs
    )
