"""``megatron/cpu/native_torch.py``: the balanced layer's host code runs without the CPU backend's device
mapping, and only that mode is lifted (observed in the backend's probe process, ``probe`` in
tests/megatron/conftest.py)."""

import torch
from torch.overrides import TorchFunctionMode

from ultraep_megatron.megatron.cpu import native_torch


class Seen(TorchFunctionMode):
    """A torch-function mode recording the torch functions called under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


@native_torch.native_torch
def add_one(x):
    return torch.add(x, 1)


def test_nothing_is_lifted_where_the_backend_is_not_active():
    """No device mapping registered (a GPU, or this process, where the CPU backend is not active):
    the decorated function runs under every mode in force, the innermost one included, which sees
    its calls. Control: the same mode registered as the mapping is lifted, and sees none of them."""
    assert native_torch.device_mapping() is None
    with Seen() as seen:
        assert torch.equal(add_one(torch.zeros(1)), torch.ones(1))
    assert torch.add in seen.calls
    with Seen() as mapping:
        native_torch.register_device_mapping(mapping)
        try:
            assert torch.equal(add_one(torch.zeros(1)), torch.ones(1))
        finally:
            native_torch.register_device_mapping(None)
    assert torch.add not in mapping.calls and native_torch.device_mapping() is None


def test_native_torch_lifts_only_the_innermost_device_mapping(probe):
    assert probe["native_torch"] == {
        "alone": [],  # the balancer's host code runs without the mapping's per-call dispatch
        "under_another_mode": ["CudaAsCpuMode", "Outer"],  # a host-read counter keeps seeing it
        "after": ["CudaAsCpuMode"],
        "after_an_error": ["CudaAsCpuMode"],  # an exception inside does not lose the mapping
    }


def test_the_hot_path_list_names_the_balanced_layer_s_functions():
    """Every function the backend lifts exists where the list says (a rename fails here, not
    silently at activation), and the probe process wrapped them all."""
    for owner, names in native_torch.hot_path():
        for name in names:
            assert callable(vars(owner)[name.lstrip("*")]), (owner, name)


def test_negative_control_a_missing_hot_path_function_raises(monkeypatch):
    class Owner:
        pass

    monkeypatch.setattr(native_torch, "hot_path", lambda: [(Owner, ("renamed",))])
    try:
        native_torch.lift_hot_path()
    except KeyError as error:
        assert "renamed" in str(error)
    else:
        raise AssertionError("a missing hot-path function was not refused")
