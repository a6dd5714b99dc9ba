"""torchrun for the recipes: ``python -m ultraep_megatron.megatron.run.torchrun [torchrun args]``.

The same launcher as ``python -m torch.distributed.run`` (torch's own parser and agent, every option
it takes), except for how a worker's refusal ends. ``pretrain_gpt.py`` refuses a bad argument or
layout with one line naming the flag and exit status 2 (``docs/user_guide.md``); torchrun would
follow that line with its ``ChildFailedError`` traceback, its "closing signal SIGTERM" line for each
other worker and its "failed (exitcode: 2)" line, then exit 1. Here, when the first worker to fail
exited with 2, its line is all there is and the launcher exits 2. Any other failure keeps
torchrun's report (the rank, the host, the error file) and exits with that worker's status (1 for
a signal), so a crash still says where it happened.

Imports torch only (no megatron): the launcher process trains nothing.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

#: The exit status of a refusal (``pretrain_gpt.py``'s one line naming the flag).
REFUSED = 2
#: torchrun's lines that only echo a worker's failure (held back, dropped after a refusal).
_ECHOES = ("closing signal", "failed (exitcode")
#: The loggers of torchrun's agent that print them.
_AGENT_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
)


class _HoldEchoes(logging.Filter):
    """Holds back the agent's lines that echo a worker's failure; the rest pass at once."""

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if any(echo in str(record.msg) for echo in _ECHOES):
            self.held.append(record)
            return False
        return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run torchrun on ``argv`` (default ``sys.argv[1:]``); return the exit status: 0, 2 when
    the first failed worker refused (exit status 2), else that worker's status (1 for a signal)."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run
    except ModuleNotFoundError as missing:  # a python without the project's environment
        print(
            f"{sys.executable} has no {(missing.name or 'torch').split('.')[0]}: set ULTRAEP_PYTHON to the project's python "
            "(ULTRAEP_PYTHON=$(bash tools/ensure_env.sh)), or run tools/main_job.sh",
            file=sys.stderr,
        )
        return 2
    hold = _HoldEchoes()
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    for logger in loggers:
        logger.addFilter(hold)
    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
        status = 0
    except ChildFailedError as failed:
        _, first = failed.get_first_failure()
        status = first.exitcode if first.exitcode > 0 else 1
        if status != REFUSED:
            print(failed, file=sys.stderr)
    finally:
        for logger in loggers:
            logger.removeFilter(hold)
    if status != REFUSED:  # not a refusal: torchrun's own account of it, as torchrun gives it
        for record in hold.held:
            logging.getLogger(record.name).handle(record)
    return status


if __name__ == "__main__":
    sys.exit(main())
