"""The balanced token dispatchers: megatron's own, working in *physical-slot space*.

Both add to megatron's what :class:`~.physical_routing.PhysicalSlotRouting` holds (the exact load,
the invocation's record and plan, the reroute of the routed pairs to physical slots):

* :class:`BalancedAlltoAllDispatcher`: megatron's all-to-all dispatcher; splits and per-slot counts
  come from the host plan, and its unfused permutation and chunk sort are computed from the plan;
* :class:`BalancedFlexDispatcher`: megatron's flex dispatcher (DeepEP / HybridEP), GPU-only.

Vocabulary (docs/glossary.md): R EP ranks, E experts, G = E // R main experts per rank, S redundant
slots per rank, P = G + S physical slots per rank.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAlltoAllTokenDispatcher,
    MoEFlexTokenDispatcher,
    _HybridEPManager,
)

from ultraep_megatron.megatron.balanced_layer.capabilities import flex_backend_problem
from ultraep_megatron.megatron.balanced_layer.invocation import Invocation
from ultraep_megatron.megatron.balanced_layer.native_torch import native_torch
from ultraep_megatron.megatron.balanced_layer.physical_routing import (
    PhysicalSlotRouting,
    instances_of_positions,
)


class BalancedAlltoAllDispatcher(PhysicalSlotRouting, MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher over physical slots, driven by a per-microbatch plan.
    Its ``preprocess`` takes every split from the invocation's host metadata: no communication, no
    device-to-host copy, no host wait (megatron's own sync point stays unset)."""

    def preprocess(self, routing_map: torch.Tensor) -> Optional[torch.Tensor]:
        """All-to-all metadata from the plan: splits and per-slot row counts, on the host. A plan
        still on the device (device planner) leaves them to :meth:`_take_invocation`; only the fused
        chunk sort's device counts are there already."""
        self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
        if self.invocation is None:
            self.input_splits = self.output_splits = self.output_splits_tp = None
            self.num_global_tokens_per_local_expert = (
                self.state.device_plan.rows_per_source_slot
                if self.config.moe_permute_fusion
                else None
            )
            return None
        self._take_splits(self.invocation, upload=True)
        return self.invocation.rows_per_slot

    def _take_splits(self, invocation: Invocation, *, upload: bool) -> None:
        if self.ep_size > 1:
            self.input_splits = invocation.input_splits
            self.output_splits = invocation.output_splits
            self.output_splits_tp = np.array([invocation.output_splits.sum()])
        # [R_src, P]; megatron's fused chunk sort reads it on the device.
        rows = invocation.rows_per_source_slot
        if not self.config.moe_permute_fusion:
            self.num_global_tokens_per_local_expert = rows
        elif upload:
            self.num_global_tokens_per_local_expert = rows.to(self._table.device, non_blocking=True)

    def _take_invocation(self, invocation: Invocation) -> None:
        self._take_splits(invocation, upload=False)
        self.tokens_per_expert = invocation.rows_per_slot

    def can_defer(self) -> bool:
        """A host plan can wait for the dispatch node where the permutation is computed from the
        plan (:meth:`_deferred_dispatch_preprocess`), not by megatron's fused kernel; a device plan
        always can."""
        return self._permutes_from_plan() or self.balancing.plans_on_device

    def _permutes_from_plan(self) -> bool:
        """Whether :meth:`dispatch_preprocess` permutes the tokens straight from the plan: megatron's
        unfused permutation, which it replaces (the fused one, TE's kernels on the physical map,
        stays megatron's)."""
        return not (
            self.config.moe_permute_fusion
            or self.drop_and_pad
            or self.tp_size > 1
            or self.config.moe_router_padding_for_quantization
        )

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """megatron's ``dispatch_preprocess`` (the same dispatcher state, its shared-expert and sync
        hooks), with the permutation computed from the plan instead of from a physical routing map.

        megatron's unfused permutation argsorts the whole ``[T, R * P]`` physical map to sort the
        (token, slot) pairs slot-major; the plan already says where each pair goes
        (:meth:`_permutation`), so neither the physical map nor that sort is built.

        Args:
            routing_map: [T, E] bool, logical experts, exactly ``topk`` per token.
            probs: [T, E] router probabilities.

        Returns:
            (permuted tokens [N, H], their probabilities [N]), ``N = T * topk``, physical-slot-major
            and token-ascending within a slot, as megatron's permutation of the physical map.
        """
        if self.deferred == "host":
            return self._deferred_dispatch_preprocess(hidden_states, routing_map, probs)
        if not self._permutes_from_plan():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        # Read only by megatron's fused or drop-and-pad unpermute, neither of which runs here; None
        # so that nothing can mistake the logical map for the physical one.
        self.routing_map = None
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
            "before_permutation_1", self.tokens_per_expert
        )
        self.hidden_shape_before_permute = hidden_states.shape
        sorted_tokens, permuted_probs = self._permutation(probs)
        self.reversed_local_input_permutation_mapping = sorted_tokens
        permuted = hidden_states.index_select(0, sorted_tokens)
        if self.deferred is None:
            self._complete_plan()
        return permuted, permuted_probs

    def _deferred_dispatch_preprocess(self, hidden_states, routing_map, probs):
        """A deferred host plan's pre-dispatch part (overlapped schedule): the routed pairs sorted
        expert-major by *logical* expert, which needs no plan (megatron's permutation of the
        logical routing, computed as :meth:`_permutation` computes the physical one), so megatron
        can free this node's outputs after the dispatch as it frees its own permuted tokens. The
        dispatch node then moves each expert's run of pairs to its instances' rows
        (:meth:`_dispatch_inputs_of_plan`).

        Returns:
            (tokens [N, H] and their probabilities [N], expert-major), ``N = T * topk``.
        """
        if not self._permutes_from_plan():
            raise RuntimeError("a deferred plan needs the permutation from the plan (can_defer)")
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = None  # as in dispatch_preprocess: never the logical map for the physical
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.hidden_shape_before_permute = hidden_states.shape
        self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
        self.input_splits = self.output_splits = self.output_splits_tp = None
        self.state.expert_major = order = self._expert_major_order()
        topk = self.topk_ids.size(1)
        tokens = hidden_states.index_select(0, torch.div(order, topk, rounding_mode="floor"))
        pair_probs = probs.gather(1, self.topk_ids).reshape(-1).index_select(0, order)
        return tokens, pair_probs

    @native_torch
    def _dispatch_inputs_of_plan(self, hidden_states, probs, routing_map):
        """The all-to-all's send buffer from the expert-major pairs, exactly per the plan: the same
        rows :meth:`dispatch_preprocess` builds without deferral (the send row of expert-major
        position ``i`` is row 3 of the reroute table at its instance, plus ``i``)."""
        self._take_invocation(self.invocation)
        order, self.state.expert_major = self.state.expert_major, None
        positions = torch.arange(order.numel(), device=order.device)
        instance = instances_of_positions(self._table[0], positions, binary_search=order.is_cuda)
        row = self._table[3].index_select(0, instance) + positions
        # position of each send row: a permutation, so the gathers' backward scatters exactly
        source = torch.empty_like(row).scatter_(0, row, positions)
        topk = self.topk_ids.size(1)
        self.reversed_local_input_permutation_mapping = torch.div(
            order, topk, rounding_mode="floor"
        ).index_select(0, source)
        return hidden_states.index_select(0, source), probs.index_select(0, source)

    @native_torch
    def _permutation(self, probs: torch.Tensor):
        """Where each routed (token, expert) pair goes in the all-to-all's send buffer, exactly per
        the plan. Device work only: no host read, fixed shapes, nothing over ``[T, E]`` but the
        gather of the pairs' probabilities.

        A pair's expert-major position picks its instance (:meth:`_pairs`); row 3 of the plan's
        reroute table turns the position into its send-buffer row (the instance's slot's first
        row, plus the pair's rank among the instance's pairs, which the plan hands out in token
        order).

        Args:
            probs: [T, E] router probabilities (differentiable).

        Returns:
            (sorted_tokens [N] int64: the token of each send-buffer row, permuted_probs [N],
            differentiable in ``probs``), ``N = T * topk``.
        """
        t0 = time.perf_counter()
        topk = self.topk_ids.size(1)
        order, positions, instance = self._pairs()
        row = self._table[3].index_select(0, instance) + positions
        # Every row is written once; -1 would fail the token gather loudly if the routing ever
        # left one unwritten (a routing other than the plan's load).
        sorted_tokens = torch.full_like(order, -1).scatter_(
            0, row, torch.div(order, topk, rounding_mode="floor")
        )
        pair_probs = probs.gather(1, self.topk_ids).reshape(-1).index_select(0, order)
        permuted_probs = pair_probs.new_zeros(pair_probs.shape).scatter(0, row, pair_probs)
        self.balancing.add_reroute_seconds(time.perf_counter() - t0)
        return sorted_tokens, permuted_probs

    def _sorts_chunks_on_host(self) -> bool:
        """Whether megatron's chunk sort here is the unfused split-and-concatenate over (physical
        slot, source rank) chunks, which the two ``*_parts`` methods reproduce directly. Other paths
        (fused sort, expert TP, capacity padding, one slot per rank) go through megatron's."""
        # Capacity padding and expert TP are refused at startup (unsupported_moe_settings); tested
        # here as well, so that lifting a refusal cannot silently take the wrong chunk order.
        return not (
            self.config.moe_permute_fusion
            or self.drop_and_pad
            or self.tp_size > 1
            or self.num_local_experts == 1
        )

    def dispatch_postprocess_parts(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """``dispatch_postprocess`` split into main and replica parts, concatenating each part's
        chunks directly (unfused sort).

        megatron's unfused sort splits the all-to-all output into (source rank, physical slot)
        chunks and concatenates them slot-major; concatenating the main slots' and the redundant
        slots' chunks separately gives the two parts with the same copy, and no split whose backward
        copies the whole gradient once more. Chunk sizes and order come from the host plan.
        """
        if not self._sorts_chunks_on_host():
            return super().dispatch_postprocess_parts(hidden_states, probs)
        rows = self.invocation.rows_per_source_slot.numpy()  # [R_src, P], host
        R, P = rows.shape
        G = P - self.num_slots
        sizes = rows.ravel().tolist()  # source-major: source r, slot p
        parts = []
        for tensor in (hidden_states, probs):
            chunks = tensor.split(sizes)
            parts.append(
                [
                    torch.cat([chunks[r * P + p] for p in slots for r in range(R)])
                    for slots in (range(G), range(G, P))
                ]
            )
        (main_tokens, replica_tokens), (main_probs, replica_probs) = parts
        self.tokens_per_expert = None  # as megatron's postprocess leaves it
        return main_tokens, replica_tokens, self.invocation.rows_per_slot, main_probs, replica_probs

    def combine_preprocess_parts(
        self, main_out: torch.Tensor, replica_out: torch.Tensor
    ) -> torch.Tensor:
        """``combine_preprocess`` of the main experts' and the redundant slots' outputs stacked
        (``[main rows + replica rows, H]``), without stacking them first (unfused sort).

        megatron's unfused chunk sort splits its input into (physical slot, source rank) chunks and
        concatenates them source-major; taking the chunks from the two parts directly makes one
        copy of the expert outputs instead of two. Chunk sizes and order come from the host plan.
        """
        if not self._sorts_chunks_on_host():
            return super().combine_preprocess_parts(main_out, replica_out)
        rows = self.invocation.rows_per_source_slot.numpy()  # [R_src, P], host
        R, P = rows.shape
        G = P - self.num_slots
        chunks = [
            *main_out.split(rows[:, :G].T.ravel().tolist()),  # slot-major: slot p, source r
            *replica_out.split(rows[:, G:].T.ravel().tolist()),
        ]
        return torch.cat([chunks[p * R + r] for r in range(R) for p in range(P)])


class BalancedFlexDispatcher(PhysicalSlotRouting, MoEFlexTokenDispatcher):
    """megatron's flex dispatcher (DeepEP / HybridEP fused all-to-all) over physical slots.

    The fused kernels route on the physical routing as they would on the logical one; what is added
    is what the plan already knows. HybridEP gets every local slot's row count from the host plan
    (``num_permuted_tokens`` and the per-slot counts), so its dispatch does not wait for the GPU and
    the experts get host counts: the layer's one host wait is the plan's. DeepEP's dispatch (megatron's
    ``fused_dispatch``, DeepEP's normal kernels) polls for its received counts on the host itself,
    whatever it is told: one wait more. GPU-only: :func:`flex_backend_problem` says why it cannot run
    where it cannot.

    When the fused kernels pad each local slot's rows (HybridEP under fp8 / fp4, to the quantization
    alignment; DeepEP's fused permute-and-pad), the main experts and the redundant slots take their
    padded rows alike, as megatron's experts do.
    """

    def __init__(
        self, num_local_experts, local_expert_indices, config, pg_collection, *, balancing, balancer
    ):
        problem = flex_backend_problem(config)
        if problem:
            raise ValueError(f"--moe-balancer {balancer.config.name}: {problem}")
        super().__init__(
            num_local_experts,
            local_expert_indices,
            config,
            pg_collection,
            balancing=balancing,
            balancer=balancer,
        )
        self._replica_rows: tuple = ()  # per redundant slot, as dispatched (padding included)
        self._rows_past_slots = 0  # dispatched rows past the last local slot

    def can_defer(self) -> bool:
        """The fused dispatch permutes: a plan can always wait for the dispatch node."""
        return True

    def _deferred_dispatch_preprocess(self, hidden_states, routing_map, probs):
        """A deferred host plan's pre-dispatch part (overlapped schedule): nothing that needs the
        plan. The fused dispatch permutes, so the tokens go on as they are (megatron keeps the
        flex dispatcher's dispatch inputs for the backward) and the router's probabilities are
        rerouted in the dispatch node (:meth:`_dispatch_inputs_of_plan`)."""
        self._deferred_hidden_shape = hidden_states.shape
        return hidden_states.view(-1, hidden_states.shape[-1]), probs

    def _dispatch_inputs_of_plan(self, hidden_states, probs, routing_map):
        """The fused dispatch's inputs per the plan: megatron's ``dispatch_preprocess`` on the
        rerouted (physical) routing map and probabilities, in the dispatch node."""
        physical_map, physical_probs = self._reroute(routing_map, probs)
        hidden_states, token_probs = super(PhysicalSlotRouting, self).dispatch_preprocess(
            hidden_states, physical_map, physical_probs
        )
        self.hidden_shape = self._deferred_hidden_shape  # the layer's [S, B, H], for the combine
        return hidden_states, token_probs

    def _hybridep_alignment(self) -> int:
        """The multiple HybridEP pads each local slot's rows to: megatron's ``pad_multiple`` rule (the
        quantization alignment under fp8 / fp4), 1 for none."""
        if self.config.fp8 or self.config.fp4:
            return get_align_size_for_quantization(self.config)
        return self._comm_manager.pad_multiple or 1

    def token_dispatch(
        self, hidden_states, probs=None, async_finish=True, allocate_on_comm_stream=True
    ):
        """megatron's fused dispatch; HybridEP is told the permuted size and per-slot counts from
        the plan (host integers), so it neither waits for the GPU nor returns device counts."""
        manager = self._comm_manager
        if not isinstance(manager, _HybridEPManager):
            return super().token_dispatch(
                hidden_states, probs, async_finish, allocate_on_comm_stream
            )
        align = self._hybridep_alignment()
        rows = self.invocation.rows_per_slot  # [P] int64, host
        padded = (rows + align - 1) // align * align
        # megatron's manager reads the size from the GPU only when it is None (and then sets the
        # counts from the device); it is reset after every combine.
        manager.num_permuted_tokens = int(padded.sum())
        dispatched = super().token_dispatch(
            hidden_states, probs, async_finish, allocate_on_comm_stream
        )
        manager.tokens_per_expert = padded
        return dispatched

    def dispatch_postprocess_parts(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """``dispatch_postprocess`` split into the main experts' rows and the redundant slots' rows,
        each as dispatched: where the kernels pad every local slot's rows (HybridEP under fp8 /
        fp4, to the GEMM alignment), the replica experts take their slots' padded rows as the main
        experts take theirs (built from the layer's config, they skip their own padding as the main
        experts do, and fp8 GEMMs need aligned row counts); padding rows are zero and carry
        probability 0. Rows past the last slot (a kernel's over-allocation) are kept aside and get
        zero outputs in :meth:`combine_preprocess_parts`. Sizes from host counts only (HybridEP: the
        plan's, handed over in :meth:`token_dispatch`; DeepEP: its own host list)."""
        tokens, rows_per_slot, permuted_probs = self.dispatch_postprocess(hidden_states, probs)
        dispatched = [int(n) for n in rows_per_slot.tolist()]  # host tensor
        G = self.slots_per_rank - self.num_slots
        main_rows, replica_rows = sum(dispatched[:G]), sum(dispatched[G:])
        self._replica_rows = tuple(dispatched[G:])
        self._rows_past_slots = tokens.shape[0] - main_rows - replica_rows
        sizes = [main_rows, replica_rows, self._rows_past_slots]
        (main_tokens, replica_tokens, _), (main_probs, replica_probs, _) = (
            torch.split(tokens, sizes),
            torch.split(permuted_probs, sizes),
        )
        return main_tokens, replica_tokens, rows_per_slot, main_probs, replica_probs

    @property
    def replica_rows(self):
        """Rows of each redundant slot as dispatched (padding included), from the latest
        :meth:`dispatch_postprocess_parts`."""
        return self._replica_rows

    def combine_preprocess_parts(
        self, main_out: torch.Tensor, replica_out: torch.Tensor
    ) -> torch.Tensor:
        """``combine_preprocess`` of the main experts' and the redundant slots' outputs in the
        dispatched layout (zero rows past the last slot)."""
        pieces = [main_out, replica_out]
        if self._rows_past_slots:
            pieces.append(main_out.new_zeros((self._rows_past_slots, main_out.shape[1])))
        return self.combine_preprocess(torch.cat(pieces))


def balanced_dispatcher_class(config):
    """The balanced dispatcher for ``--moe-token-dispatcher-type``."""
    if config.moe_token_dispatcher_type == "flex":
        return BalancedFlexDispatcher
    return BalancedAlltoAllDispatcher
