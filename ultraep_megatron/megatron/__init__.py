"""Megatron-core integration of UltraEP: the only package that imports megatron.

Kept light on purpose: importing ``ultraep_megatron.megatron`` imports neither torch nor
megatron. Submodules:

* :mod:`~ultraep_megatron.megatron.cpu_backend` -- run megatron-core on CPU processes over gloo;
* :mod:`~ultraep_megatron.megatron.arguments` -- the ``--moe-balancer`` argument group;
* :mod:`~ultraep_megatron.megatron.layer_spec` -- the layer-spec hook ``pretrain_gpt.py`` calls;
* :mod:`~ultraep_megatron.megatron.telemetry` -- per-layer expert-load imbalance in the log.
"""
