"""CPU backend for megatron-core 0.19.2 and 0.18.2: run the real MoE layer and training loop over gloo.

Development and CI only. Megatron-core assumes a CUDA device everywhere on its training path. On a
machine without one (developer laptops, CI), :func:`backend.activate` makes "the CUDA device" an
alias of the CPU, at runtime and from outside the wheel (no file of site-packages is edited):

* allocations on ``'cuda'`` / ``cuda:N`` / device index N land on the CPU (a
  :class:`~torch.overrides.TorchFunctionMode` rewrites the device arguments; ``device_mapping``);
* ``torch.cuda`` calls that would raise without a device (streams, events, RNG state, memory
  statistics, ``current_device``) get their CPU meaning (``torch_cuda``);
* Megatron's own CUDA-only assumptions (its ``is_available()`` assert, the model-parallel and
  RNG-tracker set-up it skips when ``device_count() == 0``, split sizes for ``all_to_all_single``,
  fusion warm-up) are patched one by one (``megatron_patches``);
* the CUDA generator *is* the CPU generator (CPU dropout draws from it), so Megatron's RNG tracker
  swaps its named states in and out of the CPU generator, and building the data iterators must not
  draw from it (else a resumed run would diverge);
* resuming megatron's DistributedOptimizer around torch's Adam (no Apex/TE on a CPU) keeps each
  parameter's Adam step.

Every patch carries a one-line reason (``backend.PATCHES`` after activation) and is applied only
when ``torch.cuda.is_available()`` is False. The patches change where tensors live, never what is
computed, so CPU runs are exact (the expert-parallel equivalence tests compare EP=2/4 with EP=1
bit-for-bit or to 1e-6).

Torch-level ``torch.cuda.is_available()`` and ``device_count()`` stay truthful; only
``megatron.training.initialize`` sees one device. Run one thread per rank (``OMP_NUM_THREADS=1``)
and pass ``flags.REQUIRED_ARGS`` to ``pretrain`` (``pretrain_gpt.py`` applies the missing ones
itself, see :func:`flags.apply_required_args`).

Usage::

    from ultraep_megatron.megatron.cpu import backend
    backend.activate()          # before building Megatron models; idempotent

The balancer's own host code (planning, reroute, replica transfers) runs without the device mapping
(:func:`ultraep_megatron.megatron.balanced_layer.native_torch.native_torch`, which the hot path imports instead of
anything here): it names no CUDA device, and the mode's per-call dispatch would be most of its cost.

Limit: Python backward functions see the device mapping when the backward pass starts with
``Tensor.backward`` or ``torch.autograd.backward`` (what Megatron's schedules call), not with
``torch.autograd.grad``.

Submodules (this package imports none of them itself):

* :mod:`.backend` -- :func:`~.backend.activate`, the patch list, whether it is active;
* :mod:`.flags` -- the command-line flags a CPU run needs, applied to a ``pretrain`` command line;
* :mod:`.device_mapping` -- the torch-function mode that makes ``'cuda'`` mean the CPU;
* :mod:`.torch_cuda` -- ``torch.cuda`` stand-ins with their CPU meaning;
* :mod:`.megatron_patches` -- replacements for Megatron's CUDA-only set-up, RNG and optimizer code.
"""
