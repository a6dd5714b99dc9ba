"""What a user sets, as plain numbers and their flags; no torch.distributed, no Megatron.

Below the analysis, the Megatron integration and the ``ultraep`` command, which all read it; it
imports only the planner (the balancer names and :class:`~ultraep_megatron.planner.BalancerConfig`,
whose rules validate the planner's numbers). Imports none of its modules itself:

* :mod:`.knobs`: the ``--moe-balancer*`` flags (one table, ``KNOBS``), their argparse groups, their
  check naming each flag, and the :class:`~ultraep_megatron.planner.BalancerConfig` they give;
* :mod:`.hardware`: the hardware presets of ``--moe-balancer-hardware``, the expert's shape and the
  quota floor derived from them.
"""
