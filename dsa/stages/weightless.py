"""Models built and exported without their weights in memory.

The export needs a policy's graph and the name, shape and dtype of every weight, never the weights' values:
they come from the checkpoint, by name, in the parameter stage. Building a 3.5B-parameter policy with real,
randomly initialised tensors costs 14 GB and minutes of initialisation; these two steps cost neither:

* `without_weights()`: while it is active, every `nn.Parameter` a module registers is moved to the meta
  device as it is registered (accelerate's `init_empty_weights` does the same), so the initialisers that
  follow (`reset_parameters`, `normal_`, ...) run on meta tensors, in no time and no memory. Buffers stay
  real: a non-persistent buffer (RoPE frequencies, position ids) is computed from the config and may be read
  by the graph as a constant; a persistent one is a weight like a parameter and is made fake by `as_fake`.
  A constructor that fills a parameter's tensor *before* registering it (`nn.Parameter(torch.randn(...))`)
  still allocates that tensor for a moment; torch's and transformers' layers create theirs with
  `torch.empty` and initialise after registration.

  An op that mixes such a weight with a real tensor (a constructor's dry run of a layer, to learn its output
  shape) computes on meta: it gets the shape, without values.

* `as_fake(module)`: replaces every parameter and persistent buffer by a `FakeTensor` of the same shape,
  dtype and strides on the cpu device: no storage. torch.export traces a module holding them (with real
  example inputs) exactly as it traces real weights, and iree-turbine's importer externalises them by
  name without reading a value: the MLIR is byte-identical (tests/tools/weightless_test.py). Tied weights
  (one tensor under two names) stay tied.

Code that needs a weight's values at build time (a check comparing two ways of computing a layer) must do so
before `as_fake`, with the weights it materialises itself (`is_weightless` tells it where it runs).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterator, Optional

_STATE = threading.local()


class ModelTooLarge(ValueError):
    """A model being built without its weights registered more parameters (or elements) than its budget
    allows (`without_weights(budget=...)`): its config asks for more than any policy this rule set builds."""

    def __init__(self, what: str, count: int, limit: int, name: str):
        super().__init__(f"{what}: {count:,} registered (at {name}), the limit is {limit:,}")
        self.what, self.count, self.limit, self.name = what, count, limit, name


class Budget:
    """What a model may register while it is built without weights: parameter tensors and their elements.
    Counted as parameters are registered, so a config asking for a million layers is stopped after the
    first `max_tensors`, in a fraction of a second, not when the machine runs out of memory."""

    def __init__(self, max_tensors: int, max_elements: int):
        self.max_tensors, self.max_elements = max_tensors, max_elements
        self.tensors = self.elements = 0

    def add(self, module, name: str, param) -> None:
        self.tensors += 1
        self.elements += int(param.numel())
        where = f"{type(module).__name__}.{name}"
        if self.tensors > self.max_tensors:
            raise ModelTooLarge("parameter tensors", self.tensors, self.max_tensors, where)
        if self.elements > self.max_elements:
            raise ModelTooLarge("parameter elements", self.elements, self.max_elements, where)


def is_weightless(tensor) -> bool:
    """Whether `tensor` holds no values (meta, or fake)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) or (isinstance(tensor, torch.Tensor) and tensor.is_meta)


def building_without_weights() -> bool:
    """Whether the caller runs inside `without_weights()`."""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def without_weights(budget: Optional[Budget] = None) -> Iterator[None]:
    """Modules built in this context register their parameters on the meta device (see the module doc).
    `budget` (the outermost context's counts): ModelTooLarge once the parameters registered exceed it."""
    import torch
    from torch import nn

    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        param = module._parameters.get(name)
        if param is not None and not param.is_meta:
            module._parameters[name] = _on_meta(param)
        counting = getattr(_STATE, "budget", None)
        if param is not None and counting is not None:
            counting.add(module, name, param)

    original_apply = nn.Module._apply

    def _apply(module, fn, *args, **kwargs):
        # `.to(device)`, `.float()`, `.to(torch.bfloat16)` of a module holding meta parameters (LeRobot's
        # policies move their model to config.device): a meta tensor takes the dtype the conversion would
        # give, and stays on meta.
        def keep_meta(tensor):
            if not tensor.is_meta:
                return fn(tensor)
            target = fn(torch.empty(0, dtype=tensor.dtype)).dtype
            return tensor if target == tensor.dtype else tensor.to(dtype=target)

        return original_apply(module, keep_meta, *args, **kwargs)

    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    outermost = _STATE.depth == 1
    if outermost:
        nn.Module.register_parameter = register_parameter
        nn.Module._apply = _apply
        _STATE.budget = budget
    try:
        with _MetaPropagation() if outermost else contextlib.nullcontext():
            yield
    finally:
        _STATE.depth -= 1
        if _STATE.depth == 0:
            nn.Module.register_parameter = original
            nn.Module._apply = original_apply
            _STATE.budget = None


def _meta_propagation_class():
    import torch
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    class MetaPropagation(TorchDispatchMode):
        """An op that mixes meta tensors (weights built without values) with real ones computes on meta: a
        constructor's dry run of a layer to learn its output shape (LeRobot's `get_output_shape`) gets the
        shape, without values."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(t.is_meta for t in tensors) and not all(t.is_meta for t in tensors):
                args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t if t.is_meta else t.to("meta"),
                                                    (args, kwargs))
            return func(*args, **kwargs)

    return MetaPropagation


def _MetaPropagation():
    return _meta_propagation_class()()


def _on_meta(param):
    """The parameter moved to the meta device, keeping a Parameter subclass and its attributes where the
    subclass allows it."""
    import copy

    from torch import nn

    if type(param) is nn.Parameter:
        return nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)
    try:
        meta = copy.copy(param)
        meta.data = param.data.to("meta")
        return meta
    except Exception:  # a subclass that refuses: a plain parameter of the same shape and dtype
        return nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)


def as_fake(module) -> "object":
    """Replaces `module`'s parameters and persistent buffers (real or meta) in place by storage-less fake
    tensors on the cpu device; non-persistent buffers are kept. Returns the FakeTensorMode they belong to.
    One tensor shared by several modules (tied weights) becomes one fake tensor."""
    import torch
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # id(original tensor) → (original, its replacement): the original is kept alive so that its id is not
    # reused by another tensor while this runs.
    done: Dict[int, tuple] = {}

    def fake_of(tensor):
        meta = tensor.detach() if tensor.is_meta else tensor.detach().to("meta")
        return FakeTensor(mode, meta, torch.device("cpu"))

    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None:
                continue
            if id(param) not in done:
                done[id(param)] = (param, nn.Parameter(fake_of(param), requires_grad=False))
            sub._parameters[name] = done[id(param)][1]
        for name, buffer in list(sub._buffers.items()):
            if buffer is None or name in sub._non_persistent_buffers_set:
                continue
            if id(buffer) not in done:
                done[id(buffer)] = (buffer, fake_of(buffer))
            sub._buffers[name] = done[id(buffer)][1]
    return mode


def stand_in_values(module, seed: int = 0) -> Dict[str, object]:
    """Real, seeded values (normal, std 0.02) for `module`'s weightless parameters and buffers, by name: what a
    build-time check runs the module with (`torch.func.functional_call(module, values, args)`) when the
    module was built without its weights. Empty when every weight is real. Meant for a few small layers: it
    allocates what it returns."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    values = {}
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if is_weightless(tensor):
            values[name] = (torch.randn(tuple(tensor.shape), generator=generator) * 0.02).to(tensor.dtype)
    return values


def materialise(module, read, names=None) -> None:
    """Gives a module built without its weights (`without_weights`) real ones, one tensor at a time:
    `read(name)` returns the value (a numpy array or torch tensor) of a state_dict entry, converted to the
    entry's dtype when it differs (a bf16 checkpoint of a float32 model is widened). Tied entries (one tensor
    under several names) get one tensor, read under whichever of their names `names` holds (default: every
    name is tried until one reads). Peak memory: the weights themselves, one copy; nothing is initialised.
    Raises KeyError naming an entry no name of which can be read."""
    import numpy as np
    import torch

    state = module.state_dict(keep_vars=True)
    groups: Dict[int, list] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    values = {}
    for group in groups.values():
        candidates = [n for n in sorted(group) if names is None or n in names]
        value = None
        for name in candidates:
            try:
                value = read(name)
                break
            except KeyError:
                continue
        if value is None:
            raise KeyError(f"no tensor for {' / '.join(sorted(group))}")
        tensor = value if isinstance(value, torch.Tensor) else torch_of(np.asarray(value))
        want = state[group[0]].dtype
        if tensor.dtype != want:
            tensor = tensor.to(want)
        for name in group:
            values[name] = tensor
    module.load_state_dict(values, strict=True, assign=True)


def torch_of(array):
    """A numpy array (bf16 as ml_dtypes.bfloat16) as a torch tensor sharing its memory."""
    import torch

    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view("uint16")).view(torch.bfloat16)
    return torch.from_numpy(array)
