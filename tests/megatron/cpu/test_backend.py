"""The CPU backend (``megatron/cpu/``: its activation, device mapping, ``torch.cuda`` stand-ins and
Megatron patches), activated in a fresh single-rank process (never in the pytest process: it
patches torch for the life of the process; ``probe`` in tests/megatron/conftest.py)."""

from ultraep_megatron.megatron.cpu import backend as cpu_backend


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
    assert "TorchFunctionMode CudaAsCpuMode" in targets


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


def test_coalesced_bucket_collectives_keep_their_dtypes(probe):
    """megatron's buffers gather a uint8 bucket (fp8 parameters) and a bf16 one in one coalesced
    call: the backend's manager returns both as sent; torch's over gloo (the negative control)
    runs them as one dtype and garbles both."""
    gathered = probe["coalesced_mixed_dtypes"]
    assert gathered["megatron"] == [[10] * 4, [1.5] * 4], gathered
    assert gathered["torch"] != gathered["megatron"], gathered


def test_dataset_helper_build_is_skipped(probe):
    assert probe["compile_helpers_skipped"] is True


def test_pytest_process_is_not_patched():
    assert not cpu_backend.is_active()
    assert cpu_backend.PATCHES == []


def test_only_the_cpu_machine_s_warnings_are_filtered():
    """TE/Apex absent and pin_memory without an accelerator are filtered on CPU; any other
    warning (the negative control) still shows."""
    import warnings

    shown = [
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
        "Apex is not installed. Falling back to Torch Norm",
        "Only transformer-engine>=1.7.0 supports MoE experts, but your version is 0.0.0.",
        "'pin_memory' argument is set as true but no accelerator is found, then ...",
        "Transformer Engine is slow here",  # near a filtered message, not one of them
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu_backend._filter_cpu_only_warnings()
        for message in shown:
            warnings.warn(message, UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["Transformer Engine is slow here"]


def test_a_cuda_machine_keeps_every_warning(monkeypatch):
    import warnings

    monkeypatch.setattr(cpu_backend, "cuda_present", lambda: True)
    monkeypatch.setattr(cpu_backend, "_ACTIVE", False)
    with warnings.catch_warnings():
        before = list(warnings.filters)
        assert cpu_backend.activate() is False
        assert warnings.filters == before
