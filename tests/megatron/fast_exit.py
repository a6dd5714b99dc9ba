"""Run a script as a torchrun worker, then end the process without Python's teardown.

gloo_launch starts every rank as ``python fast_exit.py SCRIPT ARGS...``. SCRIPT runs as
``__main__`` with its own directory first on ``sys.path``, as ``python SCRIPT`` would run it. When it
returns or calls ``sys.exit``, what a normal exit does before the teardown still happens
(``threading._shutdown``: the threading atexit callbacks that stop idle ``concurrent.futures``
workers, then the join of non-daemon threads; then the atexit handlers, where wandb finishes its
run), then ``os._exit`` ends the process with the script's status. Objects are not finalized: a
script whose output a test reads closes its files itself (torch.save, the trace writer's close).
Tearing down a megatron-core process (thousands of modules, about 1 GB of heap per rank) took about
4 s of wall time per 4-rank launch on two cores, a fifth of a test launch; nothing a test checks
happens in it. An exception propagates as usual
(traceback, status 1, Python's normal exit).

Run:  torchrun ... fast_exit.py SCRIPT [ARGS...]
"""

import atexit
import os
import runpy
import sys
import threading


def _status(code) -> int:
    """Exit status for ``sys.exit(code)``, as the interpreter maps it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main() -> None:
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exit_request:
        status = _status(exit_request.code)
    threading._shutdown()  # what the interpreter runs first at exit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
