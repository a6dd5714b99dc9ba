"""UltraEP for Megatron-LM: exact-load, real-time expert load balancing for MoE training.

Layers (each importable on its own):
  - ``ultraep_megatron.planner``: replication/reroute planning, pure functions on load matrices.
  - ``ultraep_megatron.dataplane``: expert weight distribution and replica-gradient reduction over
    torch.distributed.
  - ``ultraep_megatron.megatron``: the megatron-core integration (the only layer importing Megatron).
"""

__version__ = "0.1.0"
