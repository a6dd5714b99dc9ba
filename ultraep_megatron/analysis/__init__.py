"""Offline analysis of routing loads, no Megatron import: the cost model (``cost``), the replay of
recorded loads through every balancer (``replay``) and the slot advisor (``advisor``)."""
