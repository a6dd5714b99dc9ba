"""UltraEP for Megatron-LM: exact-load, real-time expert load balancing for MoE training.

Layers, each importing only the ones before it (docs/architecture.md):
  - ``planner``: replication/reroute planning, pure functions on load matrices;
  - ``dataplane``: expert weight distribution and replica-gradient reduction over torch.distributed;
  - ``traces``: load traces (the project's format, megatron-core's router traces, synthetic loads);
  - ``analysis``: cost model, replay, slot advisor, resume experiment, figures;
  - ``megatron``: the megatron-core integration (the only layer importing Megatron);
  - ``cli``: the ``ultraep`` command.
"""

__version__ = "0.1.0"
