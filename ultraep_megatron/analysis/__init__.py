"""Offline analysis of routing loads and runs; no Megatron import (imports: the planner, the
settings, the data plane's transfer schedule for the cost model, and the traces).

* :mod:`.cost`: the MoE-layer cost model (an ESTIMATE) on the settings layer's hardware presets;
* :mod:`.replay`: recorded loads through every balancer (:func:`~.replay.replay`), next to the
  peers of :mod:`.peers`; its tables: :mod:`.summary`; the ``ultraep replay`` report:
  :mod:`.replay_report`, :mod:`.replay_plots`;
* :mod:`.advisor`: the slot advisor; the ``ultraep advise`` report: :mod:`.advise_report`;
* :mod:`.inputs`: hardware, quota floor, balancers and peers resolved from the user's choices;
* :mod:`.resume_experiment` (with :mod:`.resume_runs`): one checkpoint resumed under every balancer;
* :mod:`.figures` (how every figure is drawn, and the layer x iteration heatmap a training run
  logs too), :mod:`.plotting` (each balancer's label and colour in comparisons) and :mod:`.tables`
  (text tables, JSON, CSV).
"""
