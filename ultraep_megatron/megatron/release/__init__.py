"""What megatron-core's releases (0.18.x, 0.19.x) give and which of their settings a balanced layer
runs: ``compat`` (what differs between releases), ``capabilities`` (the settings a balanced layer
refuses, each named by its flag: checked at startup, by ``check-recipe`` and by the layer's
constructor; not part of an invocation) and 0.18's GPT model provider. Imports nothing of
``balanced_layer/`` or ``run/``."""
