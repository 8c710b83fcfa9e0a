"""The deployment API: a release bundle as a policy object, driven as LeRobot drives a policy.

    import dsa.runtime

    policy = dsa.runtime.load("pi0_bundle.tar")      # verified (digests, format, lock) before anything loads
    policy.reset()                                    # at the start of an episode
    action = policy.select_action(observation)        # one control step: [batch, action dim]

`select_action` keeps LeRobot's action queue: when the queue is empty it runs the compiled module on the
observation, keeps the first `n_action_steps` actions of the chunk (the manifest's runtime view) and returns
them one per call; `predict_action_chunk` runs the module every call. A step-count input (the flow or
denoising loop kept in the module) is set to the manifest's `flow_steps` unless the observation gives it.

A bundle with the policy's whole pipeline (dsa_bundle with `processors`; docs/policy-pipeline.md) takes
the raw observation — camera frames as uint8 (H, W, C), the raw state, and `task=` text for the policies that
tokenise it — and returns the raw motor command, float32 [action dim]: LeRobot's preprocessor, the action
queue (or ACT's temporal ensembling, or Diffusion Policy's observation history) and postprocessor run in
the runtime (dsa.runtime.policy_pipeline), noise drawn from `seed`. Any other bundle takes what the compiled
module takes — the export record's inputs by name (normalised state, images in the model's layout, token
ids). Imports numpy and IREE's runtime (and `tokenizers` for a tokenising pipeline) only: this runs on a
robot without torch (//tests/runtime:torch_free_test runs it in an environment with nothing else).
"""

from __future__ import annotations

import collections
import contextlib
from pathlib import Path
from typing import Deque, Dict, Optional, Union

import numpy as np

from dsa.core.errors import DsaError
from dsa.runtime.policy import CompiledPolicy


class DeployedPolicy:
    """A verified bundle's compiled policy with LeRobot's action queue. Close it (or use it as a context
    manager) to remove the extracted files."""

    def __init__(self, bundle: Union[str, Path], target: Optional[str] = None, *, allow_nonfinite: bool = False,
                 seed: int = 0, temporal_ensemble_coeff: Optional[float] = None):
        from dsa.runtime.bundle import open_bundle, user_path

        self._stack = contextlib.ExitStack()
        try:
            opened = self._stack.enter_context(open_bundle(user_path(str(bundle))))
            stage = opened.select_target(target)  # a pipeline bundle is refused here, saying how to run it
            self.bundle = opened
            self.target = opened.selected or opened.targets[0]
            self.compiled = CompiledPolicy(stage.index_path, allow_nonfinite=allow_nonfinite, target=self.target)
            view = self.compiled.runtime_view
            self.model_id = self.compiled.model_id
            self.n_action_steps = int(view["n_action_steps"])
            self.flow_steps = int(view["flow_steps"])
            record = self.compiled.modules[0].record
            self._step_input = next((s["name"] for s in record["inputs"] if "value_range" in s), None)
            self._queue: Deque[np.ndarray] = collections.deque()
            self.pipeline = None  # the policy pipeline (raw observations), when the bundle has one
            spec_file = opened.meta.get("policy_pipeline")
            if spec_file is not None:
                from dsa.runtime.policy_pipeline import PolicyPipeline, read_spec

                spec = read_spec(opened.root, spec_file)
                self.pipeline = PolicyPipeline(opened.root, spec, self.predict_action_chunk, seed=seed,
                                               temporal_ensemble_coeff=temporal_ensemble_coeff)
            elif temporal_ensemble_coeff is not None:
                raise DsaError("temporal_ensemble_coeff", "needs a bundle with the policy's pipeline",
                               "build the bundle with processors (docs/policy-pipeline.md)")
        except BaseException:  # the extracted files go with any failure, whatever refused the bundle
            self._stack.close()
            raise

    # -- LeRobot's policy interface --------------------------------------------------------------------
    def reset(self) -> None:
        """Empties the action queue (call at the start of every episode); a policy pipeline also forgets its
        observation history and ensemble and restarts its noise from the seed."""
        self._queue.clear()
        if self.pipeline is not None:
            self.pipeline.reset()

    def predict_action_chunk(self, observation: Dict[str, np.ndarray]) -> np.ndarray:
        """The module's action chunk for `observation`: [batch, chunk_size, action dim]."""
        inputs = dict(observation)
        if self._step_input is not None and self._step_input not in inputs:
            inputs[self._step_input] = np.array(self.flow_steps, dtype=np.int64)
        (actions, *_), _ = self.compiled.run(inputs)
        if actions.ndim != 3:
            raise DsaError(f"{self.model_id}: output 0", f"has shape {list(actions.shape)}, not [batch, chunk, "
                           "action dim]", "this bundle's first output is not an action chunk")
        return actions

    def select_action(self, observation: Dict[str, np.ndarray], task: Optional[str] = None) -> np.ndarray:
        """One control step's action. With a policy pipeline: the raw motor command (float32 [action dim]) for
        the raw observation (and `task` text). Otherwise [batch, action dim]: the next queued action, running
        the module on `observation` when the queue is empty (the observation of the other steps is not read)."""
        if self.pipeline is not None:
            return self.pipeline.select_action(observation, task)
        if task is not None:
            raise DsaError("task", "this bundle has no policy pipeline: its module takes token ids, not text",
                           "pass the observation's token inputs")
        if not self._queue:
            chunk = self.predict_action_chunk(observation)
            if chunk.shape[1] < self.n_action_steps:
                raise DsaError(f"{self.model_id}: n_action_steps",
                               f"{self.n_action_steps} is more than the chunk's {chunk.shape[1]} actions",
                               "rebuild with n_action_steps <= chunk_size")
            self._queue.extend(np.array(chunk[:, i], copy=True) for i in range(self.n_action_steps))
        return self._queue.popleft()

    @property
    def queued(self) -> int:
        """Actions left in the queue."""
        return len(self._queue)

    # -- lifetime ----------------------------------------------------------------------------------------
    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "DeployedPolicy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(bundle: Union[str, Path], target: Optional[str] = None, *, allow_nonfinite: bool = False, seed: int = 0,
         temporal_ensemble_coeff: Optional[float] = None, require_signature: Optional[Union[str, Path]] = None,
         expect_model: Optional[str] = None, min_release: Optional[int] = None) -> DeployedPolicy:
    """Verifies a release bundle and loads its policy (a multi-target bundle: `target`, else the first of its
    targets this machine runs). `seed`: the noise of a flow / diffusion policy pipeline; `temporal_ensemble_coeff`:
    ACT's temporal ensembling (a pipeline bundle with n_action_steps 1). `require_signature` (a public key,
    KEY.pub.pem): refuse the bundle unless its signature (NAME.dsse.json beside it) is valid, before anything is
    extracted; with it, `expect_model` refuses a bundle signed as another model and `min_release` one signed with
    a lower release number (a rollback floor)."""
    statement = None
    if require_signature is not None:
        from dsa.runtime.signing import verify_signature

        statement = verify_signature(Path(bundle), Path(require_signature), expect_model=expect_model,
                                     min_release=min_release)
    elif expect_model is not None or min_release is not None:
        raise DsaError("expect_model / min_release", "need require_signature: only a signature binds a model id and "
                       "a release number", "pass require_signature=KEY.pub.pem")
    policy = DeployedPolicy(bundle, target, allow_nonfinite=allow_nonfinite, seed=seed,
                            temporal_ensemble_coeff=temporal_ensemble_coeff)
    if statement is not None:
        from dsa.runtime.signing import check_identity

        try:
            check_identity(statement, policy.bundle, Path(bundle))
        except BaseException:
            policy.close()
            raise
    return policy
