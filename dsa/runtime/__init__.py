"""Loading and running compiled policies, pipelines and bundles; numpy and IREE's runtime only, never torch.

`dsa.runtime.load(bundle)` is the deployment API (dsa.runtime.deploy). The classes behind it are importable from
here too, loaded when first named: `CompiledPolicy` (a module index's compiled modules, dsa.runtime.policy),
`DeployedPolicy` (what `load` returns), `PolicyPipeline` (a policy with LeRobot's processors and action queue)
and `ProcessorPipeline` (the processors alone)."""

# name → the module that defines it; imported on first use, so `import dsa.runtime` stays cheap.
_EXPORTS = {
    "CompiledPolicy": "dsa.runtime.policy",
    "DeployedPolicy": "dsa.runtime.deploy",
    "PolicyPipeline": "dsa.runtime.policy_pipeline",
    "ProcessorPipeline": "dsa.runtime.processors",
}
__all__ = ["load", *_EXPORTS]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dsa.runtime' has no attribute '{name}'")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def load(bundle, target=None, *, allow_nonfinite=False, seed=0, temporal_ensemble_coeff=None,
         require_signature=None, expect_model=None, min_release=None):
    """Verifies a release bundle and loads its policy: `reset()`, `select_action(observation)` (LeRobot's action
    queue; raw observations in, raw actions out for a bundle with the policy's pipeline),
    `predict_action_chunk(observation)`. `require_signature=KEY.pub.pem` (with `expect_model`, `min_release`):
    the signature checks of `dsa run --require-signature`. See dsa.runtime.deploy."""
    from dsa.runtime.deploy import load as _load

    return _load(bundle, target, allow_nonfinite=allow_nonfinite, seed=seed,
                 temporal_ensemble_coeff=temporal_ensemble_coeff, require_signature=require_signature,
                 expect_model=expect_model, min_release=min_release)
