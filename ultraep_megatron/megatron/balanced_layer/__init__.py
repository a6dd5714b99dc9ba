"""The balanced layer, the training hot path: ``BalancedMoELayer``, its dispatchers, one
invocation's object (plan handle, host plan, replica transfers), the per-model context (buffer,
ring, observers, planner), the replica autograd and the redundant slots' module. Imports nothing
of ``run/``."""
