"""Worker: pretrain_gpt.py's argument checks, in its order, for many command lines.

Reads a JSON list of {"name", "argv"} from argv[1]; for each, runs pretrain_gpt.py's startup checks
(``startup.parse_megatron_args``: Megatron's parse, a refused flag or value one line with its "did
you mean"; then ``arguments.startup_problems``), then, if they pass, Megatron's own parse and
validation, and prints one JSON line {"name", "error", "errors", "warnings"} (error: None or the
first message; errors: every message of the startup checks). One process for all cases: parsing
needs no distributed setup.
"""

import contextlib
import io
import json
import sys

from ultraep_megatron.megatron.cpu import backend as cpu_backend

cpu_backend.activate()

from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator  # noqa: E402
from megatron.training.global_vars import destroy_global_vars  # noqa: E402

from ultraep_megatron.megatron.run.arguments import add_ultraep_args, startup_problems  # noqa: E402
from ultraep_megatron.megatron.run.startup import parse_megatron_args  # noqa: E402


def main():
    cases = json.loads(open(sys.argv[1]).read())
    for case in cases:
        sys.argv = ["pretrain_gpt.py", *case["argv"]]
        error, errors, warnings = None, [], []
        destroy_global_vars()  # each case parses from scratch
        destroy_num_microbatches_calculator()
        usage = io.StringIO()  # argparse reports a bad choice on stderr, then exits
        try:
            with contextlib.redirect_stderr(usage):
                args, errors = parse_megatron_args()
                if args is not None:
                    problems, warnings = startup_problems(args)
                    errors += problems
                if errors:
                    raise ValueError(errors[0])
                parse_and_validate_args(
                    extra_args_provider=add_ultraep_args,
                    args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
                )
        except (ValueError, AssertionError, SystemExit) as exc:
            error = f"{type(exc).__name__}: {exc} {usage.getvalue().strip().splitlines()[-1:]}"
        print(
            "RESULT "
            + json.dumps(
                {"name": case["name"], "error": error, "errors": errors, "warnings": warnings}
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
