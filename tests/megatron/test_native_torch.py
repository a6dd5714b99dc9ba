"""``megatron/native_torch.py``: the balancer's host code runs without the CPU backend's device
mapping, and only that mode is lifted (observed in the backend's probe process, ``probe`` in
tests/megatron/conftest.py)."""

from ultraep_megatron.megatron import native_torch


def test_nothing_is_lifted_where_the_backend_is_not_active():
    assert native_torch.device_mapping() is None
    assert native_torch.native_torch(lambda x: x + 1)(1) == 2


def test_native_torch_lifts_only_the_innermost_device_mapping(probe):
    assert probe["native_torch"] == {
        "alone": [],  # the balancer's host code runs without the mapping's per-call dispatch
        "under_another_mode": ["CudaAsCpuMode", "Outer"],  # a host-read counter keeps seeing it
        "after": ["CudaAsCpuMode"],
        "after_an_error": ["CudaAsCpuMode"],  # an exception inside does not lose the mapping
    }
