"""The deployment API: a release bundle as a policy object, driven as LeRobot drives a policy.

    import dsa.runtime

    policy = dsa.runtime.load("pi0_bundle.tar")      # verified (digests, format, lock) before anything loads
    policy.reset()                                    # at the start of an episode
    action = policy.select_action(observation)        # one control step: [batch, action dim]

`select_action` keeps LeRobot's action queue: when the queue is empty it runs the compiled module on the
observation, keeps the first `n_action_steps` actions of the chunk (the manifest's runtime view) and returns
them one per call; `predict_action_chunk` runs the module every call. A step-count input (the flow or
denoising loop kept in the module) is set to the manifest's `flow_steps` unless the observation gives it.

The observation is what the compiled module takes — the export record's inputs by name (a bundle's inputs are
the network's: normalised state, images in the model's layout, token ids). Imports numpy and IREE's runtime
only: this runs on a robot without torch (//tests/runtime:torch_free_test runs it in an environment with
nothing else).
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

    def __init__(self, bundle: Union[str, Path], target: Optional[str] = None, *, allow_nonfinite: bool = False):
        from dsa.runtime.bundle import open_bundle, user_path

        self._stack = contextlib.ExitStack()
        try:
            opened = self._stack.enter_context(open_bundle(user_path(str(bundle))))
            stage = opened.select_target(target)  # a pipeline bundle is refused here, saying how to run it
            self.bundle = opened
            self.target = opened.selected or opened.targets[0]
            self.compiled = CompiledPolicy(stage.index_path, allow_nonfinite=allow_nonfinite)
        except BaseException:
            self._stack.close()
            raise
        view = self.compiled.runtime_view
        self.model_id = self.compiled.model_id
        self.n_action_steps = int(view["n_action_steps"])
        self.flow_steps = int(view["flow_steps"])
        record = self.compiled.modules[0].record
        self._step_input = next((s["name"] for s in record["inputs"] if "value_range" in s), None)
        self._queue: Deque[np.ndarray] = collections.deque()

    # -- LeRobot's policy interface --------------------------------------------------------------------
    def reset(self) -> None:
        """Empties the action queue (call at the start of every episode)."""
        self._queue.clear()

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

    def select_action(self, observation: Dict[str, np.ndarray]) -> np.ndarray:
        """One control step's action, [batch, action dim]: the next queued action, running the module on
        `observation` when the queue is empty (the observation of the other steps is not read)."""
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


def load(bundle: Union[str, Path], target: Optional[str] = None, *, allow_nonfinite: bool = False) -> DeployedPolicy:
    """Verifies a release bundle and loads its policy (a multi-target bundle: `target`, else the first of its
    targets this machine runs)."""
    return DeployedPolicy(bundle, target, allow_nonfinite=allow_nonfinite)
