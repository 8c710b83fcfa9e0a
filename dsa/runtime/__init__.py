"""Loading and running compiled policies, pipelines and bundles; numpy and IREE's runtime only, never torch.

`dsa.runtime.load(bundle)` is the deployment API (dsa.runtime.deploy)."""


def load(bundle, target=None, *, allow_nonfinite=False, seed=0, temporal_ensemble_coeff=None):
    """Verifies a release bundle and loads its policy: `reset()`, `select_action(observation)` (LeRobot's action
    queue; raw observations in, raw actions out for a bundle with the policy's pipeline),
    `predict_action_chunk(observation)`. See dsa.runtime.deploy."""
    from dsa.runtime.deploy import load as _load

    return _load(bundle, target, allow_nonfinite=allow_nonfinite, seed=seed,
                 temporal_ensemble_coeff=temporal_ensemble_coeff)
