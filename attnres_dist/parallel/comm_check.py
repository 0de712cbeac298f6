"""Check on a CPU-only machine that every tensor handed to torch.distributed is on the run's device.

On a CPU machine every tensor is on the CPU, so a tensor created without ``device=`` (which
would be a CPU tensor on a GPU run and make NCCL raise) cannot be told apart by its device.
``CommDeviceCheck`` makes the difference visible in two ways and applies both to every
torch.distributed call any code makes through the ``torch.distributed`` namespace (this
project, DeepSpeed's comm layer and pipeline p2p, Megatron's mappings):

1. **Exact device.** Every tensor argument (also inside lists and ``P2POp``s) must be on the
   declared device, ``tensor.device == declared``. Declaring another device than the tensors'
   (``meta``, ``cuda:0``) makes any CPU tensor a violation.
2. **Default-device taint.** While the check is active a ``TorchFunctionMode`` plays a second,
   phantom device: the default one. A tensor made by a factory (``torch.zeros``, ``tensor``,
   ``full``, ...) with no ``device=`` argument, or with the CPU named literally (``"cpu"``,
   ``.cpu()``), lives there, and so does whatever is computed from it alone; ``.to(device)``
   with a ``torch.device`` or another tensor's device moves it back. Any such tensor reaching a
   collective is a violation, even though its physical device equals the declared one.

Calls are counted per function (``counts``), so a test can assert that each kind it expects
was actually seen and checked. Object collectives (``gather_object``, ...) and ``barrier`` are
counted but carry no tensor of the caller's: torch places their buffers itself.

Blind spots: legacy constructors (``torch.LongTensor([...])``) are not seen by the mode; a
``torch.device("cpu")`` object is trusted; functions captured from ``torch.distributed`` before
``install()`` keep the unchecked original. ``tests/test_comm_device.py`` adds a static scan.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

TENSOR_CALLS = (
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
COUNT_ONLY = (
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
)

_TAINT = "_comm_check_default_device"
_FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.tensor,
    torch.as_tensor,
    torch.arange,
    torch.linspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.empty_strided,
}


class CommDeviceError(RuntimeError):
    """A tensor handed to torch.distributed is not on the run's device."""


def _tainted(t) -> bool:
    return isinstance(t, torch.Tensor) and bool(getattr(t, _TAINT, False))


def _mark(out, value: bool) -> None:
    for t in _tensors(out):
        with contextlib.suppress(AttributeError, RuntimeError):
            setattr(t, _TAINT, value)


def _tensors(obj, depth: int = 0):
    """Tensors in ``obj``: itself, or inside lists, tuples, dicts and P2POp-like objects."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(getattr(obj, "tensor", None), torch.Tensor):
        yield obj.tensor  # torch.distributed.P2POp


def _literal_cpu(device) -> bool:
    return isinstance(device, str) and torch.device(device).type == "cpu"


class DefaultDeviceTaint(TorchFunctionMode):
    """Tracks which tensors live on the (phantom) default device; see the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not any(True for _ in _tensors(out)):
            return out
        name = getattr(func, "__name__", "")
        if func in _FACTORIES:
            device = kwargs.get("device")
            _mark(out, device is None or _literal_cpu(device))
        elif name == "cpu":
            _mark(out, True)
        elif name == "cuda":
            _mark(out, False)
        elif name == "to" and _moves_device(args[1:], kwargs):
            _mark(out, _to_default(args[1:], kwargs))
        elif name.endswith("_") or (name.startswith("__i") and name != "__init__"):
            pass  # in place: the tensor stays where it was
        else:
            inputs = [t for t in _tensors((args, kwargs)) if t is not out]
            if any(_tainted(t) for t in inputs):
                # an op mixing devices runs on the non-default one (a 0-dim CPU operand is
                # allowed next to a CUDA tensor); only a computation from default tensors
                # alone stays on the default device
                _mark(out, all(_tainted(t) for t in inputs))
        return out


def _moves_device(args, kwargs) -> bool:
    if "device" in kwargs:
        return True
    return any(isinstance(a, (str, torch.device, int, torch.Tensor)) for a in args[:1])


def _to_default(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        return _tainted(target)
    return _literal_cpu(target)


class CommDeviceCheck:
    """Wrap torch.distributed's calls to verify devices (module docstring); a context manager.

    ``declared``: the run's device. ``strict``: raise ``CommDeviceError`` at the first
    violation (before the real call); otherwise record it in ``violations`` and go on, so a
    multi-rank job finishes and reports every violation at once.
    """

    def __init__(self, declared, *, strict: bool = False, taint: bool = True):
        self.declared = torch.device(declared)
        self.strict = strict
        self.taint = taint
        self.counts: Counter = Counter()
        self.tensors_checked: Counter = Counter()
        self.violations: list[str] = []
        self._originals: dict[str, object] = {}
        self._mode: DefaultDeviceTaint | None = None

    def __enter__(self) -> CommDeviceCheck:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def install(self) -> None:
        for name in TENSOR_CALLS + COUNT_ONLY:
            original = getattr(dist, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original, name in TENSOR_CALLS))
        if self.taint:
            self._mode = DefaultDeviceTaint()
            self._mode.__enter__()

    def uninstall(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original, has_tensors: bool):
        def checked(*args, **kwargs):
            self.counts[name] += 1
            if has_tensors:
                for tensor in _tensors((args, kwargs)):
                    self._verify(name, tensor)
            return original(*args, **kwargs)

        checked.__wrapped__ = original
        return checked

    def _verify(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors_checked[name] += 1
        problem = None
        if tensor.device != self.declared:
            problem = f"a tensor on {tensor.device}, but the run's device is {self.declared}"
        elif _tainted(tensor):
            problem = (
                "a tensor created on the default device (no device= argument, or the CPU "
                f"named literally), not on the run's device {self.declared}"
            )
        if problem is None:
            return
        message = f"torch.distributed.{name} got {problem}; called from {_caller()}"
        if self.strict:
            raise CommDeviceError(message)
        self.violations.append(message)

    def report(self) -> dict:
        return {
            "declared": str(self.declared),
            "calls": dict(self.counts),
            "tensors_checked": dict(self.tensors_checked),
            "violations": list(self.violations),
        }


def _caller() -> str:
    """The innermost frame outside torch and this module: where the call was made."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and not path.endswith("comm_check.py"):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "unknown"
