"""A CPU stand-in for megatron-core's ``TELinear``, the linear megatron's MoE layer builds its
latent projections with (``--moe-latent-size``: ``fc1_latent_proj`` hidden -> latent before the
dispatch, ``fc2_latent_proj`` latent -> hidden after the combine), for tests without TE.

Follows megatron-core 0.19.2's ``extensions/transformer_engine.py`` (``TELinear`` with
``parallel_mode="duplicated"``, ``is_expert=False``, as ``MoELayer`` builds it) over TE 2.x's
``transformer_engine/pytorch/module/linear.py`` (``Linear``), in high precision: ``weight`` [out,
in] and a zero ``bias`` [out] of ``config.params_dtype``; ``init_method(weight)`` under the
data-parallel RNG tracker, skipped without ``config.perform_initialization``; ``forward(x)`` returns
``(x @ weight^T + bias, None)``, or ``(x @ weight^T, bias)`` under ``skip_bias_add``;
``is_first_microbatch`` passed as megatron's wrapper passes it (``None`` under
``config.disable_parameter_transpose_cache``; it only selects TE's cached fp8 weight); the
parameters marked ``allreduce=True``, ``tensor_model_parallel=False``,
``sequence_parallel=config.sequence_parallel``.

Fails at construction as TE does on ``skip_weight_param_allocation`` (``ValueError``), and with
``NotImplementedError`` on what it leaves out: fp8 / fp4, fused weight-gradient accumulation,
delayed weight gradients, the ``column`` / ``row`` TP modes and expert linears.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class TELinearStandin(torch.nn.Module):
    """megatron's ``TELinear`` over TE's ``Linear`` in high precision (module docstring).

    ``forward(x [..., in])`` -> ``(y [..., out], bias [out] or None)``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: Optional[str],
        config,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool,
        tp_comm_buffer_name: Optional[str] = None,
        is_expert: bool = False,
        symmetric_ar_type=None,
        tp_group=None,
        name: Optional[str] = None,
        gtp_remat_group=None,
    ):
        super().__init__()
        if parallel_mode != "duplicated" or is_expert:
            raise NotImplementedError(
                "the TELinear stand-in covers duplicated non-expert linears only "
                "(megatron's MoE latent projections)"
            )
        if skip_weight_param_allocation:
            raise ValueError(
                "Transformer Engine linear layers do not support skip_weight_param_allocation"
            )
        if config.fp8 or getattr(config, "fp4", None):
            raise NotImplementedError("the TELinear stand-in computes in high precision only")
        if config.gradient_accumulation_fusion or config.delay_wgrad_compute:
            raise NotImplementedError(
                "the TELinear stand-in has no fused or delayed weight gradients"
            )
        self.config = config
        self.te_return_bias = skip_bias_add and bias
        self.is_first_microbatch = True
        self.disable_parameter_transpose_cache = config.disable_parameter_transpose_cache
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype, device=device)
        )
        self.bias = (
            torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype, device=device))
            if bias
            else None
        )
        if config.perform_initialization:
            from megatron.core.tensor_parallel.random import (
                get_cuda_rng_tracker,
                get_data_parallel_rng_tracker_name,
            )

            tracker = get_cuda_rng_tracker()
            with (
                tracker.fork(get_data_parallel_rng_tracker_name())
                if tracker.is_initialized()
                else torch.random.fork_rng(devices=[])
            ):
                init_method(self.weight)
        for param in self.parameters():
            param.allreduce = True
            param.sequence_parallel = config.sequence_parallel
            param.tensor_model_parallel = False

    def te_forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """TE's ``Linear.forward``: ``y`` or, with ``return_bias``, ``(y, bias)``."""
        add_bias = self.bias is not None and not self.te_return_bias
        out = torch.nn.functional.linear(inp, self.weight, self.bias if add_bias else None)
        return (out, self.bias) if self.te_return_bias else out

    def forward(self, x: torch.Tensor):
        first = None if self.disable_parameter_transpose_cache else self.is_first_microbatch
        out = self.te_forward(x, is_first_microbatch=first)
        self.is_first_microbatch = False
        if self.te_return_bias:
            return out
        return out, None


def install() -> None:
    """Let megatron's ``MoELayer`` build its latent projections without TE: ``HAVE_TE`` and
    ``TELinear`` of its module (process-wide; tests run it in worker processes)."""
    from megatron.core.transformer.moe import moe_layer

    moe_layer.HAVE_TE = True
    moe_layer.TELinear = TELinearStandin
