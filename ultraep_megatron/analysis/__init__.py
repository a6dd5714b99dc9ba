"""Offline analysis of routing loads and runs; no Megatron import (imports: the planner, the data
plane's transfer schedule for the cost model, and the traces).

* :mod:`.cost`: the MoE-layer cost model (an ESTIMATE), hardware presets, the hardware quota floor;
* :mod:`.replay`: recorded loads through every balancer (:func:`~.replay.replay`), next to the
  peers of :mod:`.peers`; its tables: :mod:`.summary`; the ``ultraep replay`` report:
  :mod:`.replay_report`, :mod:`.replay_plots`;
* :mod:`.advisor`: the slot advisor; the ``ultraep advise`` report: :mod:`.advise_report`;
* :mod:`.inputs`: hardware, quota floor, balancers and peers resolved from the user's choices;
* :mod:`.resume_experiment` (with :mod:`.resume_runs`): one checkpoint resumed under every balancer;
* :mod:`.plotting` (how every figure looks) and :mod:`.tables` (text tables, JSON, CSV).
"""
