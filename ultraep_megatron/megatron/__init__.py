"""Megatron-core integration of UltraEP: the only package that imports megatron.

Kept light on purpose: importing ``ultraep_megatron.megatron`` imports neither torch nor megatron,
nor any of its submodules. ``pretrain_gpt.py`` (or a patched Megatron-LM one) uses the first group;
the others are what it builds on. docs/integration.md describes each.

Its subpackages, split by what a reader comes for, bottom first (each imports nothing of those after
it; ``tests/test_architecture_layer.py``): ``release/`` (what differs between megatron-core
releases), ``balanced_layer/`` (the training hot path: the layer, its dispatchers, the invocation's
record, the per-model context, the replica autograd), ``run/`` (what ``pretrain_gpt.py`` calls
around megatron's loop: flags, startup checks, layer spec, iteration hook, telemetry), then the
recipe checker ``recipe_check/``; the CPU backend ``cpu/`` beside them.

Selecting the balancer (startup):

* :mod:`~ultraep_megatron.megatron.run.arguments` -- the ``--moe-balancer*`` flags (the settings
  layer's table, :data:`~ultraep_megatron.settings.knobs.KNOBS`, shared with the ``ultraep``
  command) added to Megatron's parser and checked against Megatron's arguments; builds the model's
  balancing context from them;
* :mod:`~ultraep_megatron.megatron.release.capabilities` -- what a balanced layer cannot run: the Megatron
  settings refused at startup and by the layer, each named by its flag;
* :mod:`~ultraep_megatron.megatron.run.startup` -- ``pretrain_gpt.py``'s checks of its command line
  before Megatron starts (CPU flags, one line per problem on rank 0, exit status 2);
* :mod:`~ultraep_megatron.megatron.run.layer_spec` -- the layer-spec hook: every MoE layer of the GPT
  model (decoder and MTP block) built as a ``BalancedMoELayer``;
* :mod:`~ultraep_megatron.megatron.run.telemetry` -- per-layer expert-load imbalance in the training log
  (and the balancer's figures); :mod:`~ultraep_megatron.megatron.run.dashboards` -- its summaries and
  heatmap.

The balanced layer (the training hot path):

* :mod:`~ultraep_megatron.megatron.balanced_layer.balanced_moe` -- ``BalancedMoELayer``, megatron's ``MoELayer``
  balancing every microbatch (its docstring walks through one forward and backward);
* :mod:`~ultraep_megatron.megatron.balanced_layer.dispatchers` -- megatron's token dispatchers over physical slots:
  the exact load to the host once, the plan, the reroute;
* :mod:`~ultraep_megatron.megatron.balanced_layer.replica_autograd` -- the autograd functions that re-materialize
  the replica weights and reduce the replica gradients in the backward;
* :mod:`~ultraep_megatron.megatron.balanced_layer.context` -- ``BalancingContext``, what the balanced layers of one
  model share: the redundant-slot buffers, the ring, the transfer in flight;
* :mod:`~ultraep_megatron.megatron.balanced_layer.invocation` -- ``Invocation``, one layer-microbatch planned on
  the host;
* :mod:`~ultraep_megatron.megatron.balanced_layer.observers` -- per-layer statistics and the load trace recorder;
* :mod:`~ultraep_megatron.megatron.balanced_layer.ring` -- the virtual-layer ring carrying each plan to its
  backward;
* :mod:`~ultraep_megatron.megatron.balanced_layer.expert_slots` -- where an expert's parameters live in megatron's
  experts modules, and the module that runs the redundant slots;
* :mod:`~ultraep_megatron.megatron.balanced_layer.layer_ids` -- the id naming an MoE layer (MTP layers after the
  decoder's);
* :mod:`~ultraep_megatron.megatron.balanced_layer.native_torch` -- the decorator that runs the balancer's host
  code without the CPU backend's device mapping.

megatron-core releases (0.19.x, 0.18.x):

* :mod:`~ultraep_megatron.megatron.release.compat` -- everything that differs between them, keyed on the
  installed release: the training API, what 0.18 refuses;
* :mod:`~ultraep_megatron.megatron.release.legacy_model` -- 0.18's GPT model provider (0.18 has no
  ``GPTModelConfig``).

Development, CI and tools:

* :mod:`~ultraep_megatron.megatron.cpu` -- the CPU backend: megatron-core's MoE layer and
  training loop on CPU processes over gloo;
* :mod:`~ultraep_megatron.megatron.recipe_check` -- ``ultraep check-recipe``: a launch recipe's
  arguments, rank layout and memory per rank, checked without GPUs;
* :mod:`~ultraep_megatron.megatron.run.checkpoint_args` -- the arguments a Megatron checkpoint was
  saved with (``ultraep resume-experiment``).
"""
