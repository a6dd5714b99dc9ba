"""A stand-in for NCCL where several ranks share one GPU: CUDA tensors, their communication staged
through gloo on the host.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so on a single-GPU machine the
balanced layer's multi-rank paths cannot run over it. After :func:`install`, every rank computes on
the GPU, and each torch.distributed operation of the MoE layer's path (megatron's token all-to-all
and count gather, the balancer's load gather, the replica transfers' batched point-to-point calls
and the data plane's first collective) copies its tensors to the host, runs there over gloo, and
copies the results back on the current stream.

Follows the handles of torch 2.14's NCCL process group (``ProcessGroupNCCL``): ``wait()`` makes the
waiting stream wait for an event recorded after the copy back, and blocks no host; a batch of
point-to-point operations on CUDA tensors returns one handle, as NCCL's coalesced batch does. The
data plane takes its NCCL path (transfers on its own CUDA stream, ordered by events). The staging's
own waits for the device run with CUDA's sync debug mode off, so the mode reports the code under
test only. With CPU tensors (a dry run of a GPU check) the operations are staged the same way,
without events.

Fails as gloo does on a device tensor passed where NCCL takes one and gloo does not (split sizes,
for instance): only the positional tensors are staged.

Leaves out: the asynchrony. A staged operation has all but finished when it returns, where NCCL's
kernel may not have started, so a consumer that skips a ``wait()`` most likely reads the right data
anyway: a missing wait is not reliably caught.

Usage::

    cuda_staging.install()        # after init_process_group("gloo"), before the layer is built
    cuda_staging.staged_calls     # Counter of the operations staged so far, and of the data
                                  # plane's transfers by where they ran
"""

from __future__ import annotations

import collections
import contextlib
import functools

import torch
import torch.distributed as dist

#: operation name -> calls staged so far (this process).
staged_calls: collections.Counter = collections.Counter()
_ORIGINAL: dict = {}
#: Collectives whose first argument is their output (a tensor or a list of tensors).
_COLLECTIVES = (
    "all_to_all_single",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_reduce",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "broadcast",
    "all_gather",
)


@contextlib.contextmanager
def device_waits_allowed():
    """CUDA's sync debug mode off inside: the staging's own waits for the device are not the code
    under test's (see the module docstring), nor is a check's designated wait."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


class _StagedWork:
    """The handle of a staged operation: complete on the host; ``wait()`` orders the waiting stream
    after the copy of its results back to the device (CUDA tensors)."""

    def __init__(self, on_cuda: bool):
        self._event = None
        if on_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self, timeout=None) -> bool:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return True


def _to_host(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(v, torch.Tensor) for v in value)
    ):
        return [v.detach().to("cpu", copy=True) for v in value]
    return value


def _on_cuda(value) -> bool:
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)


def _staged_collective(name: str):
    original = _ORIGINAL[name]

    @functools.wraps(original)
    def staged(*args, async_op: bool = False, **kwargs):
        if not args:
            raise TypeError(
                f"cuda_staging: {name} needs its output as the first positional argument"
            )
        with device_waits_allowed():
            # The data: the positional tensors (output, input). Anything else (split sizes, the
            # group) passes as given: a device tensor there fails over gloo rather than being hidden.
            host_args = [_to_host(a) for a in args]
            original(*host_args, **kwargs)
            output, host_output = args[0], host_args[0]
            if isinstance(output, torch.Tensor):
                output.copy_(host_output)
            else:
                for target, result in zip(output, host_output):
                    target.copy_(result)
            staged_calls[name] += 1
            work = _StagedWork(_on_cuda(output))
        return work if async_op else None

    return staged


def _staged_batch_isend_irecv(p2p_op_list):
    """Every send's data copied to the host, the batch run there, every receive copied back."""
    original = _ORIGINAL["batch_isend_irecv"]
    with device_waits_allowed():
        host_ops, receives = [], []
        for op in p2p_op_list:
            sending = op.op in (dist.isend, dist.send)
            buffer = (
                op.tensor.detach().to("cpu", copy=True)
                if sending
                else torch.empty(op.tensor.shape, dtype=op.tensor.dtype, device="cpu")
            )
            peer = (
                dict(group_peer=op.group_peer)
                if getattr(op, "group_peer", None) is not None
                else dict(peer=op.peer)
            )
            host_ops.append(dist.P2POp(op.op, buffer, group=op.group, tag=op.tag, **peer))
            if not sending:
                receives.append((op.tensor, buffer))
        for work in original(host_ops):
            work.wait()
        for target, buffer in receives:
            target.copy_(buffer)
        staged_calls["batch_isend_irecv"] += 1
        if any(op.tensor.is_cuda for op in p2p_op_list):
            return [_StagedWork(True)]  # NCCL coalesces a batch: one handle for all of it
        return [_StagedWork(False) for _ in p2p_op_list]


def install() -> None:
    """Stage the operations of the MoE layer's path (idempotent); see the module docstring."""
    if _ORIGINAL:
        return
    from megatron.core.tensor_parallel import mappings

    from ultraep_megatron.dataplane import handle as dataplane_handle

    for name in _COLLECTIVES + ("batch_isend_irecv",):
        _ORIGINAL[name] = getattr(dist, name)
    for name in _COLLECTIVES:
        setattr(dist, name, _staged_collective(name))
    dist.batch_isend_irecv = _staged_batch_isend_irecv
    # megatron binds its gather / reduce-scatter functions at import.
    mappings.dist_all_gather_func = getattr(dist, mappings.dist_all_gather_func.__name__)
    mappings.dist_reduce_scatter_func = getattr(dist, mappings.dist_reduce_scatter_func.__name__)
    # The data plane's NCCL path: transfers issued on the buffer's CUDA stream, ordered by events.
    _ORIGINAL["_stream_ordered"] = dataplane_handle._stream_ordered

    def stream_ordered(device, group) -> bool:
        staged_calls[
            "transfers on a CUDA stream" if device.type == "cuda" else "transfers on the host"
        ] += 1
        return device.type == "cuda"

    dataplane_handle._stream_ordered = stream_ordered
