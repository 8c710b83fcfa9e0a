"""Providers of rules_dsa: one per concept, so no rule reaches into another's files by name."""

DsaTargetInfo = provider(
    doc = "A compilation target (toolchains/targets): device, backends, flags, runtime driver.",
    fields = {
        "name": "Target name, as the manifest's `targets` lists it; empty for //:target's default (no override).",
        "spec": "File: the target spec (JSON) the compile stage reads.",
        "tuning_files": "List of File: tuning files (<family>.<target>.json) for this target beyond the rule set's.",
    },
)

DsaModelInfo = provider(
    doc = "An exported model: MLIR with externalised parameters, its export record, its parameter archive.",
    fields = {
        "model_id": "Rule name the artifacts are reported under.",
        "manifest": "File: the deployment manifest.",
        "export_view": "File: the manifest's export view (JSON).",
        "params_view": "File: the manifest's params view (JSON).",
        "checkpoint": "File: the checkpoint the parameter archive was made from (a sharded checkpoint's index).",
        "checkpoint_shards": "list of Files: a sharded checkpoint's shard files, beside its index; empty for one file.",
        "runtime_view": "File: the manifest's runtime view (JSON).",
        "mlir": "File: torch-dialect MLIR, dynamic dims kept dynamic.",
        "export_record": "File: the export record (JSON).",
        "params": "File: the .irpa parameter archive.",
        "model_sources": "depset of Files: every Python source the export imports (model code and dsa.stages.spec).",
        "own_sources": "list of Files: the model's own sources (model_sources without rules_dsa's dsa package).",
        "pythonpath": "list of str: execroot-relative directories that hold the model code's packages.",
        "policy_config": "File or None: framework lerobot, the policy's config.json.",
        "model_file": "File or None: frameworks onnx, stablehlo: the model file the export imports.",
        "python_env": "struct(python, identity, files) or None: the environment the export runs in, when not the toolchain's.",
    },
)

DsaBucketInfo = provider(
    doc = "One specialised export per shape bucket of a dynamic dim; all share the model's parameters.",
    fields = {
        "model": "DsaModelInfo of the model the buckets specialise.",
        "dim": "Name of the bucketed dim.",
        "mlirs": "list of Files: one MLIR per bucket slot, in slot order.",
        "records": "list of Files: the export record of each slot.",
        "views": "list of Files: the bucket view of each slot.",
    },
)

DsaModuleInfo = provider(
    doc = "Compiled modules of one model for one target.",
    fields = {
        "model": "DsaModelInfo.",
        "target": "DsaTargetInfo.",
        "vmfbs": "list of Files: compiled modules (one per bucket, or one).",
        "records": "list of Files: the export record of each module.",
        "reports": "list of Files: the compile report of each module.",
        "index": "File: the module index the runner loads (JSON).",
        "lock": "File: the recipe lock (JSON): digests of every input and output of these modules.",
        "levels": "list of DsaModuleInfo: the same export compiled for further targets (dsa_vmfb's `levels`); the index names them.",
        "files": "depset of Files: these modules' own outputs (the index and all it names), without the levels'.",
    },
)

DsaPteInfo = provider(
    doc = "The ExecuTorch Plan B of one model (dsa_pte).",
    fields = {
        "model": "DsaModelInfo: the model it was built from.",
        "pte": "File: the ExecuTorch program (.pte, XNNPACK-delegated).",
        "record": "File: the program record (JSON): inputs, outputs, delegation, provenance.",
    },
)

DsaPipelineInfo = provider(
    doc = "Compiled models linked into one pipeline by the tensors they exchange (dsa_pipeline).",
    fields = {
        "stage_names": "list of str: the stages in the order they run (each the dsa_vmfb's name).",
        "stages": "list of DsaModuleInfo, in stage order.",
        "link": "File: link.json, the checked edges (name, shape, dtype, producer, consumer).",
        "index": "File: the pipeline index the runner loads (JSON): the link and each stage's module index.",
    },
)
