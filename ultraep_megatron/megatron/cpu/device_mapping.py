"""The device mapping: a torch-function mode under which "cuda" means the CPU.

:func:`~.backend.activate` pushes one :class:`CudaAsCpuMode` for the life of the process and
registers it with :mod:`~ultraep_megatron.megatron.balanced_layer.native_torch`, which the balancer's host code
uses to run without it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def is_cuda_device(device: Any) -> bool:
    """True for 'cuda', 'cuda:N', torch.device('cuda', N) and a bare device index N."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    # A bare int is a CUDA ordinal in torch's device arguments (bool is an int, never a device).
    return isinstance(device, int) and not isinstance(device, bool)


class CudaAsCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU, for every torch call made while active.

    Megatron allocates with ``device='cuda'`` / ``torch.cuda.current_device()`` in about a
    hundred places, moves batches with ``.cuda()``, and checks ``tensor.type()`` strings.
    """

    _TENSOR_TYPE_AS_CUDA = {
        "torch.FloatTensor": "torch.cuda.FloatTensor",
        "torch.HalfTensor": "torch.cuda.HalfTensor",
        "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.backward:
            return self._backward(*_tensor_backward_to_autograd(*args, **kwargs))
        if func is torch.autograd.backward:
            return self._backward(*args, **kwargs)
        if "device" in kwargs and is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if kwargs.get("pin_memory"):
            # Pinning needs a CUDA driver; pageable CPU memory is what a CPU run uses anyway.
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizers and grad clipping dispatch on 'torch.cuda.*Tensor' names.
            name = func(*args)
            return self._TENSOR_TYPE_AS_CUDA.get(name, name)
        return func(*args, **kwargs)

    def _backward(
        self, tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None
    ):
        """``torch.autograd.backward`` with this mode active inside the backward pass.

        A mode is off while its handler runs, and autograd captures the mode stack when a
        backward pass starts; megatron's Python backward functions (all-to-all, gathers)
        allocate on CUDA, so the engine is started here with the mode pushed again.
        """
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        tensors = (tensors,) if torch.is_tensor(tensors) else tuple(tensors)
        if inputs is None:
            inputs = ()
        elif torch.is_tensor(inputs):
            inputs = (inputs,)
        else:
            inputs = tuple(inputs)
        grads = _make_grads(
            tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False
        )
        if retain_graph is None:
            retain_graph = create_graph
        torch._C._push_on_torch_function_stack(self)
        try:
            _engine_run_backward(
                tensors,
                grads,
                retain_graph,
                create_graph,
                inputs,
                allow_unreachable=True,
                accumulate_grad=True,
            )
        finally:
            torch._C._pop_torch_function_stack()


def _tensor_backward_to_autograd(
    tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None
):
    """Tensor.backward's arguments as torch.autograd.backward's."""
    return tensor, gradient, retain_graph, create_graph, inputs
