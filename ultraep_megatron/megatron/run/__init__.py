"""The run surface: what ``pretrain_gpt.py`` calls around megatron's training loop (the
``--moe-balancer*`` flags and startup checks, the layer-spec hook, the iteration hook, telemetry and
dashboards, a checkpoint's arguments). Builds on ``balanced_layer/`` and ``release/``."""
