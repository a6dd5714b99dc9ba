"""The balanced layer, the training hot path: ``BalancedMoELayer`` and its dispatchers, the record
of one invocation, the per-model context (buffer, ring, observers), the replica autograd, the
redundant slots' module, the device planner's caller, and the settings the layer refuses
(``capabilities``, which its constructor runs). Imports nothing of ``run/``."""
