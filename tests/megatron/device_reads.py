"""Count the host reads of device data that code would make on a GPU, while it runs on the CPU.

On the CPU backend every tensor lives in host memory, so a ``.tolist()`` that would stall a GPU's
queue costs nothing here and goes unnoticed. :class:`DeviceReadCounter` keeps a model of which
tensors would live on the GPU and counts every operation that would read them on the host:

* *device tensors*: the ones tagged with :meth:`DeviceReadCounter.tag` (activations, parameters,
  gradients), every output of a torch operation that takes a device tensor (including in-place and
  ``out=`` operations, which make their target and its base a device tensor), every allocation on
  ``'cuda'`` / a CUDA ordinal (what megatron-core asks for) and every upload (``.to(...,
  non_blocking=True)`` of a host tensor, which returns a new tensor as it would on a GPU);
* *host reads*, counted by kind:
  ``sync``: a read the host must wait for (``item``, ``tolist``, ``numpy``, ``bool``/``int``/
  ``float`` of a tensor, ``nonzero``, ``masked_select``, ``unique``, ``bincount``, ``equal``,
  ``repeat_interleave`` without ``output_size``, a blocking copy to the host such as ``.cpu()``)
  and every CUDA event / stream / device synchronization;
  ``copy``: an asynchronous device-to-host copy (``copy_`` into pinned host memory with
  ``non_blocking=True``, megatron's ``maybe_move_tensor_to_cpu``), whose result is host data.

It is a model, not a GPU: a device tensor made by an allocation on ``x.device`` (the CPU here) and
never written from device data is taken for host data. Everything the balanced layer computes from
the activations, routing or weights is covered.
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from ultraep_megatron.megatron.cpu.device_mapping import is_cuda_device
from ultraep_megatron.megatron.cpu.native_torch import device_mapping

_SYNC_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.__array__,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.masked_select,
    torch.masked_select,
    torch.Tensor.unique,
    torch.unique,
    torch.unique_consecutive,
    torch.Tensor.bincount,
    torch.bincount,
    torch.equal,
    torch.Tensor.equal,
    torch.Tensor.cpu,
    torch.repeat_interleave,
}
_IN_PLACE_DUNDERS = {
    "__setitem__",
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
    "__ior__",
    "__iand__",
}
_CUDA_SYNCS = (("Event", "synchronize"), ("Stream", "synchronize"))


class DeviceReadCounter(TorchFunctionMode):
    """A torch function mode that counts host reads of (modelled) device tensors; see the module
    docstring. Use it around the code to measure, after :func:`install_sync_counting`::

        counter = DeviceReadCounter()
        counter.tag(*layer.parameters(), x)
        with counter:
            out = layer(x); out.sum().backward()
        counter.counts  # Counter({'sync': 1, 'copy': 1})
    """

    def __init__(self):
        super().__init__()
        self._device = WeakIdKeyDictionary()
        self._pinned = WeakIdKeyDictionary()
        self.counts: collections.Counter = collections.Counter()
        self.events: list[tuple[str, str, str]] = []  # (kind, operation, where)

    # -- the model -----------------------------------------------------------------------------------
    def tag(self, *tensors) -> None:
        """Mark tensors as device tensors."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._device[t] = True

    def untag(self, tensor: torch.Tensor) -> torch.Tensor:
        self._device.pop(tensor, None)
        return tensor

    def on_device(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor in self._device

    def count(self, kind: str, operation: str) -> None:
        self.counts[kind] += 1
        where = next(
            (
                f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                for f in reversed(traceback.extract_stack()[:-2])
                if "device_reads.py" not in f.filename and "/torch/" not in f.filename
            ),
            "?",
        )
        self.events.append((kind, operation, where))

    # -- torch functions ---------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            return self._backward(func, args, kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        from_device = any(t in self._device for t in tensors)
        name = getattr(func, "__name__", str(func))
        if (
            from_device
            and func in _SYNC_READS
            and not (func is torch.repeat_interleave and kwargs.get("output_size") is not None)
        ):
            self.count("sync", name)
        if func is torch.Tensor.to and from_device and _to_host(args, kwargs):
            self.count("copy" if kwargs.get("non_blocking") else "sync", "to(cpu)")
        if (
            func is torch.Tensor.copy_
            and len(args) > 1
            and self.on_device(args[1])
            and args[0] in self._pinned
        ):
            self.count(
                "copy" if (kwargs.get("non_blocking") or args[2:3] == (True,)) else "sync",
                "copy_ to pinned",
            )
            return func(*args, **kwargs)  # host data: not a device tensor
        result = func(*args, **kwargs)
        upload = func is torch.Tensor.to and bool(kwargs.get("non_blocking")) and not from_device
        if upload and result is args[0]:  # on a GPU this is a new device tensor, not the host one
            result = result.view_as(result)
        outputs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        if kwargs.get("pin_memory"):
            for t in outputs:
                self._pinned[t] = True
        device_output = (
            (
                from_device
                and func not in _SYNC_READS
                and not (func is torch.Tensor.to and _to_host(args, kwargs))
            )
            or is_cuda_device(kwargs.get("device"))
            or upload
        )
        if device_output:
            for t in outputs:
                self._device[t] = True
            written = [kwargs["out"]] if isinstance(kwargs.get("out"), torch.Tensor) else []
            in_place = (
                name.endswith("_") and not name.startswith("__")
            ) or name in _IN_PLACE_DUNDERS
            if in_place and args and isinstance(args[0], torch.Tensor):
                written.append(args[0])
            for t in written:  # device data written into a tensor (and the storage it views)
                self._device[t] = True
                if t._base is not None:
                    self._device[t._base] = True
        return result

    def _backward(self, func, args, kwargs):
        """Run the backward with this mode (and the CPU backend's) active inside it: autograd
        captures the mode stack when a backward pass starts, and a mode is off in its own handler."""
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        if func is torch.Tensor.backward:
            tensors, grads = args[0], (args[1] if len(args) > 1 else kwargs.get("gradient"))
        else:
            tensors, grads = args[0], (args[1] if len(args) > 1 else kwargs.get("grad_tensors"))
        tensors = (tensors,) if torch.is_tensor(tensors) else tuple(tensors)
        grads = _make_grads(
            tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)), is_grads_batched=False
        )
        self.tag(*grads)
        modes = [m for m in (device_mapping(), self) if m is not None]
        for mode in modes:
            torch._C._push_on_torch_function_stack(mode)
        try:
            _engine_run_backward(
                tensors, grads, False, False, (), allow_unreachable=True, accumulate_grad=True
            )
        finally:
            for _ in modes:
                torch._C._pop_torch_function_stack()


def _to_host(args, kwargs) -> bool:
    targets = list(args[1:2]) + [kwargs.get("device")]
    return any(
        (isinstance(d, str) and d == "cpu") or (isinstance(d, torch.device) and d.type == "cpu")
        for d in targets
    )


def install_sync_counting(counter_of) -> None:
    """Count CUDA synchronizations (events, streams, the device) and megatron's asynchronous
    device-to-host copies in the counter ``counter_of()`` returns (``None``: not counting).

    Call after ``cpu.backend.activate()``: it wraps the backend's stand-ins and megatron's helper.
    """
    from megatron.core.transformer.moe import token_dispatcher

    for cls_name, method in _CUDA_SYNCS:
        cls = getattr(torch.cuda, cls_name)
        original = getattr(cls, method)

        def counting(self, *a, _original=original, _name=f"{cls_name}.{method}", **k):
            counter = counter_of()
            if counter is not None:
                counter.count("sync", _name)
            return _original(self, *a, **k)

        setattr(cls, method, counting)
    device_sync = torch.cuda.synchronize

    def counting_device_sync(*a, **k):
        counter = counter_of()
        if counter is not None:
            counter.count("sync", "cuda.synchronize")
        return device_sync(*a, **k)

    torch.cuda.synchronize = counting_device_sync
    move = token_dispatcher.maybe_move_tensor_to_cpu

    def counting_move(tensor, as_numpy=False, record_stream=False):
        counter = counter_of()
        if counter is None or not counter.on_device(tensor):
            return move(tensor, as_numpy=as_numpy, record_stream=record_stream)
        counter.count("copy", "maybe_move_tensor_to_cpu")
        host = counter.untag(tensor.detach().clone())  # what a GPU's copy would give: host data
        return host.numpy() if as_numpy else host

    token_dispatcher.maybe_move_tensor_to_cpu = counting_move
