"""What differs between the supported megatron-core releases (0.18.x, 0.19.x): ``compat`` and 0.18's
GPT model provider. Imports nothing of ``balanced_layer/`` or ``run/``."""
