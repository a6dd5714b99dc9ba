"""Per-expert parameter layouts of megatron's experts modules (``expert_slots.expert_param_names``).

Real megatron modules are covered end to end by test_balanced_moe_layer.py (SequentialMLP and
TEGroupedMLP); here the layout rules themselves, on small stand-in modules with the same names.
"""

import pytest
import torch

import toy_fp8
from ultraep_megatron.dataplane import expert_views
from ultraep_megatron.megatron.balanced_layer.expert_slots import (
    DERIVED_PARTS,
    PART_ALIGNMENT,
    ExpertParamLookup,
    ExpertWeightLayout,
    expert_param_names,
)


def expert_params(module, names):
    """The named parameters, by a walk of the module tree (what the lookup must give)."""
    return [[module.get_parameter(n) for n in per_expert] for per_expert in names]


class Grouped(torch.nn.Module):
    """TEGroupedMLP's naming: ``linear_fc{1,2}.weight{j}`` / ``bias{j}``."""

    def __init__(self, num_experts, bias):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = torch.nn.Module(), torch.nn.Module()
        for j in range(num_experts):
            self.linear_fc1.register_parameter(
                f"weight{j}", torch.nn.Parameter(torch.full((6, 4), float(j)))
            )
            self.linear_fc2.register_parameter(
                f"weight{j}", torch.nn.Parameter(torch.full((4, 3), float(j)))
            )
            if bias:
                self.linear_fc1.register_parameter(
                    f"bias{j}", torch.nn.Parameter(torch.full((6,), float(j)))
                )


class Sequential(torch.nn.Module):
    """SequentialMLP's naming: ``local_experts.{j}.linear_fc{1,2}.weight``."""

    def __init__(self, num_experts):
        super().__init__()
        self.local_experts = torch.nn.ModuleList()
        for j in range(num_experts):
            mlp = torch.nn.Module()
            mlp.linear_fc1 = torch.nn.Linear(4, 6, bias=False)
            mlp.linear_fc2 = torch.nn.Linear(3, 4, bias=False)
            torch.nn.init.constant_(mlp.linear_fc1.weight, j)
            torch.nn.init.constant_(mlp.linear_fc2.weight, j)
            self.local_experts.append(mlp)


@pytest.mark.parametrize(
    "module",
    [Grouped(3, bias=False), Grouped(3, bias=True), Sequential(3)],
    ids=["grouped", "grouped-bias", "sequential"],
)
def test_every_parameter_belongs_to_exactly_one_expert(module):
    names = expert_param_names(module, 3)
    params = expert_params(module, names)
    flat = [n for per_expert in names for n in per_expert]
    assert sorted(flat) == sorted(n for n, _ in module.named_parameters())
    for j, per_expert in enumerate(params):
        # Each expert's tensors are its own (filled with its index), in one order for all experts.
        assert all(bool((p == j).all()) for p in per_expert)
        assert [tuple(p.shape) for p in per_expert] == [tuple(p.shape) for p in params[0]]


def test_a_fused_layout_is_refused_with_the_class_name():
    class FusedGroupedMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1_weight = torch.nn.Parameter(torch.zeros(3, 6, 4))  # all experts in one tensor

    with pytest.raises(ValueError, match="FusedGroupedMLP"):
        expert_param_names(FusedGroupedMLP(), 3)


def test_wrong_expert_count_is_refused():
    with pytest.raises(ValueError):
        expert_param_names(Grouped(3, bias=False), 2)  # weight2 would belong to no expert


@pytest.mark.parametrize(
    "make", [lambda: Grouped(3, bias=True), lambda: Sequential(3)], ids=["grouped", "sequential"]
)
def test_the_per_forward_lookup_gives_the_named_parameters_and_sees_a_replaced_one(make):
    module = make()
    names = expert_param_names(module, 3)
    lookup = ExpertParamLookup(module, names)
    assert [[id(p) for p in e] for e in lookup()] == [
        [id(p) for p in e] for e in expert_params(module, names)
    ]
    # A checkpoint load may put a new Parameter in place of one; the next forward must use it.
    path, _, attr = names[1][0].rpartition(".")
    fresh = torch.nn.Parameter(torch.full_like(module.get_parameter(names[1][0]), 7.0))
    setattr(module.get_submodule(path), attr, fresh)
    assert lookup()[1][0] is fresh
    assert [[id(p) for p in e] for e in lookup()] == [
        [id(p) for p in e] for e in expert_params(module, names)
    ]


def test_the_lookup_refuses_a_name_that_is_no_parameter():
    module = Sequential(2)
    names = expert_param_names(module, 2)
    names[0][0] = names[0][0].replace("weight", "bias")  # the stand-in's linears have no bias
    with pytest.raises(ValueError, match="not a parameter"):
        ExpertParamLookup(module, names)


def test_high_precision_weights_move_as_the_parameters_themselves():
    expert = [torch.randn(6, 4), torch.randn(4, 3)]
    layout = ExpertWeightLayout(expert)
    assert not layout.quantized and layout.dtype == torch.float32
    assert layout.shapes == [torch.Size([6, 4]), torch.Size([4, 3])]
    assert layout.main_weights(expert) == expert
    slot = torch.randn(36)
    views = expert_views(slot, layout.shapes)
    replica = layout.replica_weights(views, None)
    assert all(r.data_ptr() == v.data_ptr() and r.grad_fn is None for r, v in zip(replica, views))


@pytest.mark.parametrize("recipe", toy_fp8.CURRENT_SCALING_RECIPES)
def test_quantized_weights_move_as_aligned_bytes_and_come_back_bit_for_bit(recipe):
    """``--fp8-param-gather``: a quantized expert (TE's QuantizedTensor contract, here the toy
    classes; beside it a plain bias) moves as the bytes of its storage tensors, each part at a
    16-byte offset; the replica rebuilt over a slot holding them has its main expert's storages bit
    for bit, as views of the slot, and the metadata of the expert it was modelled on otherwise."""
    quantizer = toy_fp8.ToyQuantizer(recipe)
    gen = torch.Generator().manual_seed(3)

    def make_expert():
        return [
            quantizer.quantize(torch.randn(64, 32, generator=gen)),
            quantizer.quantize(torch.randn(32, 64, generator=gen)),
            torch.randn(7, generator=gen),
        ]

    expert, other = make_expert(), make_expert()
    layout = ExpertWeightLayout(expert)
    assert layout.quantized and layout.dtype == torch.uint8
    sizes = [s.numel() for s in layout.shapes]
    starts = [sum(sizes[:i]) for i, pad in enumerate(layout.padding) if pad is None]
    assert all(start % PART_ALIGNMENT == 0 for start in starts) and sum(sizes) % PART_ALIGNMENT == 0
    keys = [key for parts in layout.parts for key, _, _ in parts]
    # tensorwise's transpose is a cache made from its data (DERIVED_PARTS): not moved.
    kept = {"tensorwise": ["data", "fp8_scale_inv"]}.get(
        recipe, ["columnwise_data", "columnwise_scale_inv", "rowwise_data", "rowwise_scale_inv"]
    )
    assert keys == kept * 2 + [None]

    sent = layout.main_weights(expert)
    assert [t.shape for t in sent] == layout.shapes and all(t.dtype == torch.uint8 for t in sent)
    buffer = torch.full(
        (2, sum(sizes)), 0xAB, dtype=torch.uint8
    )  # slot 1 receives, as the data plane would
    views = expert_views(buffer[1], layout.shapes)
    for view, tensor in zip(views, sent):
        view.copy_(tensor)
    replica = layout.replica_weights(views, other)
    lo, hi = buffer[1].data_ptr(), buffer[1].data_ptr() + sum(sizes)
    for rebuilt, main in zip(replica[:2], expert[:2]):
        assert (
            type(rebuilt) is type(main)
            and rebuilt.shape == main.shape
            and rebuilt.dtype == main.dtype
        )
        assert rebuilt.get_metadata()["quantizer"] is other[0].get_metadata()["quantizer"]
        for key, value in main.get_metadata().items():
            if key in DERIVED_PARTS:  # the main expert's cache; the replica makes its own from data
                assert rebuilt.get_metadata()[key] is None, key
            elif isinstance(value, torch.Tensor):
                got = rebuilt.get_metadata()[key]
                assert (
                    got.dtype == value.dtype
                    and got.shape == value.shape
                    and lo <= got.data_ptr() < hi
                )
                assert torch.equal(got.view(torch.uint8), value.view(torch.uint8)), key
        assert torch.equal(rebuilt.dequantize(), main.dequantize())
        assert torch.equal(rebuilt.columnwise_values(), main.columnwise_values())
    assert torch.equal(replica[2], expert[2]) and lo <= replica[2].data_ptr() < hi

    # A parameter whose parts changed (its column-wise copy dropped) is refused, not misread; a
    # tensorwise weight without its transpose cache moves as before (the replica makes its own).
    rowwise_only = toy_fp8.ToyQuantizer(recipe, columnwise=False).quantize(
        torch.randn(64, 32, generator=gen)
    )
    if recipe == "tensorwise":
        assert [t.shape for t in layout.main_weights([rowwise_only, *expert[1:]])] == layout.shapes
    else:
        with pytest.raises(ValueError, match="differ from the replica slots' layout"):
            layout.main_weights([rowwise_only, *expert[1:]])
