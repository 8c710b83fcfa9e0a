"""Loading and running compiled policies, pipelines and bundles; numpy and IREE's runtime only, never torch.

`dsa.runtime.load(bundle)` is the deployment API (dsa.runtime.deploy)."""


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
