"""The CPU backend, activated in a fresh single-rank process (never in the pytest process:
it patches torch for the life of the process)."""

import json

import pytest
import torch

from gloo_launch import WORKERS, launch_gloo_ranks

from ultraep_megatron.megatron import cpu_backend
from ultraep_megatron.megatron.telemetry import load_imbalance, per_rank_load


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu_backend") / "probe.json"
    launch_gloo_ranks(WORKERS / "cpu_backend_probe.py", 1, ["--out", out], timeout_s=300)
    return json.loads(out.read_text())


def test_activate_is_idempotent_and_logs_once(probe):
    assert probe["first_activate"] is True and probe["second_activate"] is True
    assert probe["patches_after_second"] == 0
    assert probe["activation_log_lines"] == 1


def test_every_patch_has_a_reason(probe):
    assert len(probe["patches"]) >= 20
    for target, reason in probe["patches"]:
        assert target and len(reason) > 15, (target, reason)
    targets = {target for target, _ in probe["patches"]}
    assert "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu" in targets
    assert "megatron.training.initialize.torch" in targets
    # megatron's router tracer (--moe-routing-trace-path) asks it at every MoE layer.
    assert "torch.cuda.is_current_stream_capturing" in targets


def test_cuda_allocations_land_on_cpu(probe):
    assert probe["devices"] == {name: "cpu" for name in probe["devices"]}
    assert len(probe["devices"]) == 8
    # Megatron's optimizers dispatch on CUDA type names.
    assert probe["type_string"] == "torch.cuda.FloatTensor"


def test_cuda_availability_stays_truthful_outside_megatron_initialize(probe):
    assert probe["torch_cuda_is_available"] is False
    assert probe["initialize_sees_cuda"] == [True, 1]


def test_backward_functions_see_the_device_mapping(probe):
    assert probe["backward_grads"] == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]


def test_native_torch_lifts_only_the_innermost_device_mapping(probe):
    assert probe["native_torch"] == {
        "alone": [],  # the balancer's host code runs without the mapping's per-call dispatch
        "under_another_mode": ["_CudaAsCpuMode", "Outer"],  # a host-read counter keeps seeing it
        "after": ["_CudaAsCpuMode"],
        "after_an_error": ["_CudaAsCpuMode"],  # an exception inside does not lose the mapping
    }


def test_alltoall_split_sizes_are_numpy(probe):
    assert probe["splits"] == ["numpy", [3, 1]]


def test_rng_tracker_states_are_cpu_generators_seeded_like_megatron(probe):
    rng, reference = probe["rng"], probe["rng_reference"]
    # Forks leave the default stream alone: its draws continue one seeded sequence.
    assert rng["default_first"] + rng["default_second"] == reference["default"]
    # A forked state continues where it stopped.
    assert rng["model_parallel"] + rng["model_parallel_continued"] == reference["model_parallel"]
    assert rng["expert_parallel"] == reference["expert_parallel"]
    assert rng["model_parallel"] != rng["expert_parallel"] != rng["default_first"]
    assert probe["rng_warnings"] == 0


def test_rng_snapshot_restore_replays_draws(probe):
    before, after = probe["rng_replay"]
    assert before == after


def test_dataset_helper_build_is_skipped(probe):
    assert probe["compile_helpers_skipped"] is True


def test_pytest_process_is_not_patched():
    assert not cpu_backend.is_active()
    assert cpu_backend.PATCHES == []


def test_per_rank_load_and_imbalance_by_hand():
    # 2 layers, 4 experts, EP=2: rank 0 holds experts 0-1, rank 1 experts 2-3.
    tokens = torch.tensor([[3.0, 1.0, 0.0, 4.0],
                           [2.0, 2.0, 2.0, 2.0]])
    load = per_rank_load(tokens, ep_size=2)
    assert load.tolist() == [[4.0, 4.0], [4.0, 4.0]]
    tokens[0, 0] = 8.0  # rank 0 now gets 9 of 13 tokens
    assert load_imbalance(per_rank_load(tokens, 2)).tolist() == pytest.approx([9 / 6.5, 1.0])
    assert load_imbalance(torch.zeros(1, 4)).tolist() == [1.0]
    with pytest.raises(ValueError):
        per_rank_load(tokens, ep_size=3)


def test_missing_cpu_flags_are_applied_with_their_reasons():
    argv = ["--num-layers", "2", "--transformer-impl=local", "--no-rope-fusion"]
    completed, applied = cpu_backend.apply_required_args(argv)
    assert completed[:4] == argv, "the given arguments are kept"
    assert sorted(completed[4:]) == sorted(
        token for flag, (value, _) in cpu_backend.CPU_FLAGS.items()
        if flag not in ("--transformer-impl", "--no-rope-fusion") for token in (flag, value)
        if token is not None)
    assert applied[0] == "--distributed-backend gloo (NCCL needs GPUs)"
    assert len(applied) == len(cpu_backend.CPU_FLAGS) - 2
    assert cpu_backend.apply_required_args(completed) == (completed, []), "nothing left to apply"


@pytest.mark.parametrize("argv", [["--transformer-impl", "transformer_engine"],
                                  ["--distributed-backend=nccl"]])
def test_conflicting_cpu_flag_is_refused_naming_what_to_pass(argv):
    flag = argv[0].split("=")[0]
    with pytest.raises(ValueError, match=f"pass {flag} {cpu_backend.CPU_FLAGS[flag][0]}"):
        cpu_backend.apply_required_args(argv)
