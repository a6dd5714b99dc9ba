"""Megatron-core integration of UltraEP: the only package that imports megatron.

Kept light on purpose: importing ``ultraep_megatron.megatron`` imports neither torch nor megatron,
nor any of its submodules. ``pretrain_gpt.py`` (or a patched Megatron-LM one) uses the first group;
the others are what it builds on. docs/integration.md describes each.

Selecting the balancer (startup):

* :mod:`~ultraep_megatron.megatron.arguments` -- the ``--moe-balancer*`` flags (the settings
  layer's table, :data:`~ultraep_megatron.settings.knobs.KNOBS`, shared with the ``ultraep``
  command) added to Megatron's parser and checked against Megatron's arguments; builds the model's
  balancing context from them;
* :mod:`~ultraep_megatron.megatron.capabilities` -- what a balanced layer cannot run: the Megatron
  settings refused at startup and by the layer, each named by its flag;
* :mod:`~ultraep_megatron.megatron.startup` -- ``pretrain_gpt.py``'s checks of its command line
  before Megatron starts (CPU flags, one line per problem on rank 0, exit status 2);
* :mod:`~ultraep_megatron.megatron.layer_spec` -- the layer-spec hook: every MoE layer of the GPT
  model (decoder and MTP block) built as a ``BalancedMoELayer``;
* :mod:`~ultraep_megatron.megatron.telemetry` -- per-layer expert-load imbalance in the training log
  (and the balancer's figures); :mod:`~ultraep_megatron.megatron.dashboards` -- its summaries and
  heatmap.

The balanced layer (the training hot path):

* :mod:`~ultraep_megatron.megatron.balanced_moe` -- ``BalancedMoELayer``, megatron's ``MoELayer``
  balancing every microbatch (its docstring walks through one forward and backward);
* :mod:`~ultraep_megatron.megatron.dispatchers` -- megatron's token dispatchers over physical slots:
  the exact load to the host once, the plan, the reroute;
* :mod:`~ultraep_megatron.megatron.replica_autograd` -- the autograd functions that re-materialize
  the replica weights and reduce the replica gradients in the backward;
* :mod:`~ultraep_megatron.megatron.context` -- ``BalancingContext``, what the balanced layers of one
  model share: the redundant-slot buffers, the ring, the transfer in flight;
* :mod:`~ultraep_megatron.megatron.invocation` -- ``Invocation``, one layer-microbatch planned on
  the host;
* :mod:`~ultraep_megatron.megatron.observers` -- per-layer statistics and the load trace recorder;
* :mod:`~ultraep_megatron.megatron.ring` -- the virtual-layer ring carrying each plan to its
  backward;
* :mod:`~ultraep_megatron.megatron.expert_slots` -- where an expert's parameters live in megatron's
  experts modules, and the module that runs the redundant slots;
* :mod:`~ultraep_megatron.megatron.layer_ids` -- the id naming an MoE layer (MTP layers after the
  decoder's);
* :mod:`~ultraep_megatron.megatron.native_torch` -- the decorator that runs the balancer's host
  code without the CPU backend's device mapping.

megatron-core releases (0.19.x, 0.18.x):

* :mod:`~ultraep_megatron.megatron.compat` -- everything that differs between them, keyed on the
  installed release: the training API, what 0.18 refuses;
* :mod:`~ultraep_megatron.megatron.legacy_model` -- 0.18's GPT model provider (0.18 has no
  ``GPTModelConfig``).

Development, CI and tools:

* :mod:`~ultraep_megatron.megatron.cpu` -- the CPU backend: megatron-core's MoE layer and
  training loop on CPU processes over gloo;
* :mod:`~ultraep_megatron.megatron.recipe_check` -- ``ultraep check-recipe``: a launch recipe's
  arguments, rank layout and memory per rank, checked without GPUs;
* :mod:`~ultraep_megatron.megatron.checkpoint_args` -- the arguments a Megatron checkpoint was
  saved with (``ultraep resume-experiment``).
"""
