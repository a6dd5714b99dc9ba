"""Megatron-Bridge integration: UltraEP inside Bridge's own ``pretrain()``.

Kept light: importing this package imports neither torch, megatron nor Bridge.
:mod:`~ultraep_megatron.megatron.bridge.imports` is the import hook for Bridge's CUDA-only imports
(installed at interpreter start by the layered environment's ``.pth`` file, ``ULTRAEP_BRIDGE=1``).
"""
