"""The ``ultraep`` command: offline tools for UltraEP's expert-load balancing in Megatron-LM.

:mod:`.command` is the command (its parser, ``main``); one module per subcommand (:mod:`.replay`,
:mod:`.advise`, :mod:`.check_recipe`, :mod:`.resume_experiment`, :mod:`.trace`) adds its parser and
runs it; :mod:`.common` holds what they share (exit statuses, the trace, model-shape, hardware and
output flags, progress). What they compute and print is the packages' below.
"""

from .command import build_parser, main

__all__ = ["build_parser", "main"]
