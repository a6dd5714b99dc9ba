"""The docs say nothing the commands contradict (README.md, docs/first_gpu_run.md,
docs/user_guide.md, docs/recipes.md), checked against the real parsers, without running anything:

* every command shown (bash blocks and inline code): a ``--flag`` given to ``pretrain_gpt.py``, to a
  recipe (its arguments go to ``pretrain_gpt.py``) or after ``ultraep check-recipe ... --`` exists in
  Megatron's parser with UltraEP's groups, with a value among its choices where it has choices;
  ``ultraep <command> [<subcommand>] --flag`` exists in that subcommand's parser; torchrun's own
  flags in torchrun's; a ``tools/*.py`` flag in that script; the scripts named exist; an
  environment variable set for a recipe is one the recipes read;
* every inline ``--flag`` exists in one of those parsers, and the README's and the user guide's flag
  tables name ``pretrain_gpt.py`` flags, with the choices the parser has;
* every repository path named in backticks exists (globs match something);
* the exit statuses documented for ``ultraep check-recipe`` are the ones its ``--help`` gives.

A made-up flag, path, choice or exit status in a doc snippet is caught (the negative controls).
"""

from __future__ import annotations

import argparse
import functools
import glob
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/first_gpu_run.md", "docs/user_guide.md", "docs/recipes.md")

#: Flags of other programs the docs show inline (pip, srun, wandb), by the program.
OTHER_PROGRAMS_FLAGS = {
    "pip": {
        "--dry-run",
        "--report",
        "--require-hashes",
        "--no-deps",
        "--no-index",
        "--find-links",
        "--ignore-installed",
    },
    "srun": {"--ntasks-per-node"},
}
#: Environment variables that programs other than the recipes read (set next to a recipe's launch).
OTHER_PROGRAMS_ENV = {
    "WANDB_MODE",
    "WANDB_SILENT",
    "NCCL_DEBUG",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONPATH",
    "OMP_NUM_THREADS",
    "PYTHONWARNINGS",
}
#: Scripts whose extra arguments go to pretrain_gpt.py.
LAUNCHERS = ("recipes/", "tools/main_job.sh")
#: Where a backticked path may start: the repository's top-level entries, the package's folders.
PATH_ROOTS = {
    REPO: (
        "ultraep_megatron",
        "tests",
        "tools",
        "recipes",
        "docs",
        "patches",
        "requirements",
        "pretrain_gpt.py",
        "pyproject.toml",
        "README.md",
    ),
    REPO / "ultraep_megatron": ("planner", "dataplane", "traces", "analysis", "megatron", "cli"),
}

FLAG = re.compile(r"--[A-Za-z0-9][\w-]*")


# ----------------------------------------------------------------------------------------------
# The real parsers.


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


@functools.cache
def pretrain_parser() -> argparse.ArgumentParser:
    """Megatron's parser with UltraEP's groups, as pretrain_gpt.py builds it."""
    from megatron.training.arguments import add_megatron_arguments

    from ultraep_megatron.megatron.run.arguments import add_ultraep_args

    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    return add_ultraep_args(add_megatron_arguments(parser))


@functools.cache
def pretrain_options() -> dict[str, argparse.Action]:
    return _options(pretrain_parser())


@functools.cache
def ultraep_parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every (sub)command parser of ``ultraep``, by its command path: (), ("replay",), ("trace",
    "info"), ..."""
    from ultraep_megatron.cli import build_parser

    found = {}

    def walk(parser, path):
        found[path] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))

    walk(build_parser(), ())
    return found


@functools.cache
def torchrun_options() -> dict[str, argparse.Action]:
    from torch.distributed.run import get_args_parser

    return _options(get_args_parser())


@functools.cache
def tool_flags(script: str) -> frozenset[str]:
    """The flags a tools/ script defines (its string literals that are flags)."""
    return frozenset(re.findall(r"""["'](--[\w-]+)["']""", (REPO / script).read_text()))


@functools.cache
def all_flags() -> frozenset[str]:
    flags = set(pretrain_options()) | set(torchrun_options())
    for parser in ultraep_parsers().values():
        flags |= set(_options(parser))
    for script in glob.glob("tools/*.py", root_dir=REPO):
        flags |= tool_flags(script)
    for program_flags in OTHER_PROGRAMS_FLAGS.values():
        flags |= program_flags
    return frozenset(flags)


@functools.cache
def recipe_env() -> frozenset[str]:
    """Environment variables the recipes (and the main job) read."""
    text = "".join(
        p.read_text() for p in [*(REPO / "recipes").glob("*.sh"), REPO / "tools/main_job.sh"]
    )
    return frozenset(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", text))


# ----------------------------------------------------------------------------------------------
# Reading a doc.


def _fences(text: str) -> tuple[list[tuple[str, str]], str]:
    """([(language, body)] of the fenced blocks, the prose outside them)."""
    blocks, prose, language, body = [], [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, body = line[3:].strip(), []
            else:
                blocks.append((language, "\n".join(body) + "\n"))
                language = None
        elif language is None:
            prose.append(line)
        else:
            body.append(line)
    return blocks, "\n".join(prose)


def code_blocks(text: str) -> list[str]:
    """The shell blocks (```bash, ```sh, ```console or unlabelled)."""
    return [
        body
        for language, body in _fences(text)[0]
        if language in ("", "bash", "sh", "shell", "console")
    ]


def inline_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _fences(text)[1])


def shell_lines(block: str) -> list[str]:
    """The block's commands: continuation lines joined, console prompts dropped."""
    lines = block.replace("\\\n", " ").splitlines()
    return [re.sub(r"^\$ ", "", line) for line in lines if line.strip()]


def segments(line: str) -> list[list[str]]:
    """One command line split into its simple commands (at pipes, ;, &&, ||), comments dropped."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split, lexer.commenters = True, "#"
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes in an illustrative line
        return []
    out, current = [], []
    for token in tokens:
        if token and set(token) <= set(";&|<>"):
            out.append(current)
            current = []
        else:
            current.append(token)
    return [seg for seg in [*out, current] if seg]


# ----------------------------------------------------------------------------------------------
# Checking commands.


def _placeholder(token: str) -> bool:
    """A value the reader fills in: ``...``, ``$VAR``, ``<x>``, ``RECIPE.sh``, ``TRACE_DIR``."""
    return (
        token == "..."
        or token.startswith(("$", "<", "{", '"$'))
        or "..." in token
        or re.fullmatch(r"[A-Z][A-Z0-9_]*(\.\w+)?", token) is not None
    )


def check_flags(tokens: list[str], options: dict[str, argparse.Action], who: str) -> list[str]:
    """Every ``--flag`` of ``tokens`` in ``options``; a literal value of a flag with choices among
    them."""
    problems, value_of_previous = [], False
    for i, token in enumerate(tokens):
        if value_of_previous or not token.startswith("--") or token == "--" or _placeholder(token):
            value_of_previous = False
            continue
        flag, _, inline_value = token.partition("=")
        action = options.get(flag)
        if action is None:
            problems.append(f"{who}: no flag {flag}")
            continue
        value_of_previous = action.nargs != 0 and not inline_value  # e.g. --ideal-args "--x 0"
        value = inline_value or (
            tokens[i + 1] if i + 1 < len(tokens) and action.nargs != 0 else None
        )
        if action.choices and value and not value.startswith("-") and not _placeholder(value):
            for choice in value.strip("{}").split(","):
                if choice not in map(str, action.choices):
                    problems.append(f"{who}: {flag} has no choice {choice!r}")
    return problems


def check_env(tokens: list[str], who: str) -> list[str]:
    problems = []
    for token in tokens:
        name = token.split("=", 1)[0]
        if (
            "=" in token
            and re.fullmatch(r"[A-Z][A-Z0-9_]*", name)
            and name not in recipe_env()
            and name not in OTHER_PROGRAMS_ENV
        ):
            problems.append(f"{who}: the recipes read no {name}")
    return problems


def check_command(tokens: list[str]) -> list[str]:
    """Problems of one simple command (``tokens``); commands of other programs are skipped."""
    env = []
    while tokens and (tokens[0] == "export" or re.fullmatch(r"[A-Za-z_]\w*=.*", tokens[0])):
        env += [tokens[0]] if tokens[0] != "export" else []
        tokens = tokens[1:]
    if not tokens:
        return []
    word, rest = tokens[0], tokens[1:]
    if word == "srun":
        for i, token in enumerate(rest):
            if token in ("bash", "python", "python3"):
                return check_command([*env, *rest[i:]])
        return []
    if word == "torchrun" or (
        word.startswith("python")
        and rest[:1] == ["-m"]
        and rest[1:2] in (["torch.distributed.run"], ["ultraep_megatron.megatron.run.torchrun"])
    ):
        rest = rest if word == "torchrun" else rest[2:]
        script = next((i for i, t in enumerate(rest) if t.endswith(".py")), len(rest))
        problems = check_flags(rest[:script], torchrun_options(), "torchrun")
        return problems + (check_script([*rest[script:]]) if script < len(rest) else [])
    if word.startswith("python") and rest[:2] == ["-m", "ultraep_megatron.cli"]:
        return check_ultraep(rest[2:])
    if word.startswith("python") and rest and rest[0].endswith(".py"):
        return check_script(rest)
    if word == "bash" and rest:
        return check_script(rest, env)
    if word == "ultraep" or word.endswith("/ultraep"):
        return check_ultraep(rest)
    return []


def check_script(tokens: list[str], env: list[str] = ()) -> list[str]:
    script, args = tokens[0], tokens[1:]
    if _placeholder(script):
        return []
    name = script.removeprefix(str(REPO) + "/").removeprefix("./")
    if name.endswith("pretrain_gpt.py"):
        return check_flags(args, pretrain_options(), "pretrain_gpt.py")
    if not glob.glob(name, root_dir=REPO):
        return (
            [f"no script {name}"]
            if "/" in name and name.split("/")[0] in ("recipes", "tools")
            else []
        )
    if name.startswith(LAUNCHERS):
        return check_flags(args, pretrain_options(), f"{name} (pretrain_gpt.py)") + check_env(
            env, name
        )
    if name.startswith("tools/") and name.endswith(".py"):
        return [
            f"{name}: no flag {t.split('=')[0]}"
            for t in args
            if t.startswith("--") and t.split("=")[0] not in tool_flags(name)
        ]
    return []


def check_ultraep(tokens: list[str]) -> list[str]:
    parsers, path = ultraep_parsers(), ()
    while tokens and (*path, tokens[0]) in parsers:
        path, tokens = (*path, tokens[0]), tokens[1:]
    if tokens and tokens[0].startswith("{"):  # ultraep trace {info,convert,...}
        return [
            f"ultraep {' '.join(path)}: no subcommand {name}"
            for name in tokens[0].strip("{}").split(",")
            if (*path, name) not in parsers
        ]
    if not path and tokens and not tokens[0].startswith("-"):
        return [f"ultraep: no command {tokens[0]}"]
    own, passthrough = (
        (tokens[: tokens.index("--")], tokens[tokens.index("--") + 1 :])
        if "--" in tokens
        else (tokens, [])
    )
    who = "ultraep " + " ".join(path)
    problems = check_flags(own, _options(parsers[path]), who)
    if path == ("check-recipe",):
        problems += [
            f"{who}: no recipe {t}"
            for i, t in enumerate(own)
            if t.endswith(".sh") and not _placeholder(t) and not glob.glob(t, root_dir=REPO)
        ]
        problems += check_flags(
            passthrough, pretrain_options(), "ultraep check-recipe -- (pretrain_gpt.py)"
        )
        problems += check_env([v for i, v in enumerate(own) if i and own[i - 1] == "--env"], who)
    elif path == ("resume-experiment",) and passthrough:
        problems += check_command(passthrough)
    return problems


# ----------------------------------------------------------------------------------------------
# Inline flags and tables, paths, exit statuses.


def span_flags(span: str) -> list[str]:
    """The flags an inline span starting with ``--`` names (``--a-b/-c`` names ``--a-b`` and
    ``--a-c``)."""
    flags = FLAG.findall(span)
    pair = re.match(r"(--[\w-]+-)(\w+)/-(\w+)", span)
    if pair:
        flags = [pair[1] + pair[2], pair[1] + pair[3]]
    return flags


def check_inline(span: str) -> list[str]:
    if span in {group.title for group in pretrain_parser()._action_groups}:  # `ultraep telemetry`
        return []
    if re.match(r"(python3?|bash|ultraep|torchrun|srun)\s", span):
        return [problem for seg in segments(span) for problem in check_command(seg)]
    if not span.startswith("--"):
        return []
    problems = [
        f"inline `{span}`: no flag {flag} in any parser"
        for flag in span_flags(span)
        if flag not in all_flags()
    ]
    choices = re.match(r"(--[\w-]+) \{([^}]*)\}", span)
    if choices and choices[1] in pretrain_options() and pretrain_options()[choices[1]].choices:
        shown, real = (
            set(choices[2].split(",")),
            set(map(str, pretrain_options()[choices[1]].choices)),
        )
        if shown != real:
            problems.append(f"inline `{span}`: {choices[1]} choices are {sorted(real)}")
    return problems


def check_flag_tables(text: str) -> list[str]:
    """Rows of a table whose first column is headed "flag": pretrain_gpt.py flags."""
    problems, in_flag_table = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_flag_table = False
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "flag":
            in_flag_table = True
        elif in_flag_table and cells[0].startswith("`--"):
            for span in re.findall(r"`([^`]+)`", cells[0]):
                problems += [
                    f"flag table: {flag} is not a pretrain_gpt.py flag"
                    for flag in span_flags(span)
                    if flag not in pretrain_options()
                ]
                problems += [p for p in check_inline(span) if "choices" in p]
    return problems


def check_path(span: str) -> list[str]:
    if " " in span or "/" not in span or span.startswith(("/", "~", "$", "<", ".", "http")):
        return []
    path = span.split("#")[0].split("::")[0].rstrip("/")
    if not re.fullmatch(r"[\w.*-]+(/[\w.*-]+)*", path):
        return []
    for root, entries in PATH_ROOTS.items():
        if path.split("/")[0] in entries:
            return [] if glob.glob(path, root_dir=root) else [f"no path {span}"]
    return []  # not a repository path (a run directory, a checkpoint, ...)


def check_recipe_exit_statuses() -> dict[int, str]:
    """{status: its class} from ``ultraep check-recipe --help``: 'pass', 'fail', 'usage'."""
    epilog = " ".join((ultraep_parsers()[("check-recipe",)].epilog or "").split())
    statuses = dict(
        re.findall(r"\b([0-2]) (?:when|on|if) ([^,.]*)", epilog.split("exit status", 1)[1])
    )
    return {int(code): _status_class(text) for code, text in statuses.items()}


def _status_class(text: str) -> str | None:
    text = text.lower()
    if "usage" in text or "argument" in text:
        return "usage"
    if "fail" in text or "not pass" in text:
        return "fail"
    if "pass" in text or "success" in text:
        return "pass"
    return None


def check_exit_statuses(text: str) -> list[str]:
    """Exit statuses said of ``ultraep check-recipe`` (in a paragraph naming it) match its help."""
    real, problems = check_recipe_exit_statuses(), []
    for paragraph in re.split(r"\n\s*\n", text):
        if "check-recipe" not in paragraph:
            continue
        flat = " ".join(paragraph.split())
        for sentence in re.findall(r"(?i)\bexit(?:s| status(?:es)?)\b:?([^.]*)", flat):
            for code, text_in, text_after in re.findall(
                r"(?<![\w.-])([0-2])\b\s*(?:\(([^)]*)\)|([^,;()]*))", sentence
            ):
                kind = _status_class(text_in or text_after)
                if kind is not None and real.get(int(code)) != kind:
                    problems.append(
                        f"check-recipe exit status {code} documented as {kind!r}; its help "
                        f"says {real.get(int(code))!r}"
                    )
    return problems


def doc_problems(text: str) -> list[str]:
    problems = []
    for block in code_blocks(text):
        for line in shell_lines(block):
            for seg in segments(line):
                problems += check_command(seg)
    for span in inline_spans(text):
        problems += check_inline(span) + check_path(span)
    return problems + check_flag_tables(text) + check_exit_statuses(text)


# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_commands_flags_and_paths_exist(doc):
    assert doc_problems((REPO / doc).read_text()) == []


def test_the_docs_show_commands_to_check():
    """The extraction finds what it should (so an empty problem list means something)."""
    guide = (REPO / "docs/user_guide.md").read_text()
    commands = [
        seg for block in code_blocks(guide) for line in shell_lines(block) for seg in segments(line)
    ]
    assert any(seg[:2] == ["ultraep", "check-recipe"] for seg in commands)
    assert any("recipes/qwen3_235b_a22b_ep64_dp4.sh" in seg for seg in commands)
    assert "--moe-balancer-num-slots N" in inline_spans((REPO / "README.md").read_text())
    assert check_recipe_exit_statuses() == {0: "pass", 1: "fail", 2: "usage"}


@pytest.mark.parametrize(
    "snippet,problem",
    [
        (
            "```bash\npython pretrain_gpt.py --num-layers 2 --moe-balancer-num-slotz 2\n```\n",
            "pretrain_gpt.py: no flag --moe-balancer-num-slotz",
        ),
        (
            "```bash\ntorchrun --nproc-per-node 8 pretrain_gpt.py --moe-balancer fastest\n```\n",
            "pretrain_gpt.py: --moe-balancer has no choice 'fastest'",
        ),
        (
            "```bash\nMOE_BALANCER=none bash recipes/qwen3_235b_a22b_ep64_dp4.sh --exit-intervall 20\n```\n",
            "no flag --exit-intervall",
        ),
        (
            "```bash\nsrun --ntasks-per-node 1 bash recipes/no_such_recipe.sh\n```\n",
            "no script recipes/no_such_recipe.sh",
        ),
        (
            "```bash\nNUM_NODES=4 bash recipes/qwen3_235b_a22b_ep64_dp4.sh\n```\n",
            "the recipes read no NUM_NODES",
        ),
        (
            "```bash\nultraep check-recipe --nodes 8 recipes/tiny_cpu.sh\n```\n",
            "ultraep check-recipe: no flag --nodes",
        ),
        (
            "```bash\nultraep check-recipe --world-size 8 -- --num-layer 2\n```\n",
            "no flag --num-layer",
        ),
        ("```bash\nultraep rebalance TRACE_DIR\n```\n", "ultraep: no command rebalance"),
        (
            "```bash\nultraep resume-experiment --load C -- bash recipes/tiny_cpu.sh --moe-balancer magic\n```\n",
            "--moe-balancer has no choice 'magic'",
        ),
        ("Run `ultraep replay --fast DIR` first.\n", "ultraep replay: no flag --fast"),
        (
            "Give `--moe-balancer-magic 3` to balance.\n",
            "no flag --moe-balancer-magic in any parser",
        ),
        (
            "| flag | meaning |\n| --- | --- |\n| `--moe-balancer-slots N` | slots |\n",
            "--moe-balancer-slots is not a pretrain_gpt.py flag",
        ),
        (
            "| flag | meaning |\n| --- | --- |\n| `--moe-balancer {none,ultraep,lplb}` | which |\n",
            "--moe-balancer choices are",
        ),
        (
            "See `tests/megatron/test_no_such_test.py`.\n",
            "no path tests/megatron/test_no_such_test.py",
        ),
        ("See `recipes/*hgx_typo*.sh`.\n", "no path recipes/*hgx_typo*.sh"),
        (
            "`ultraep check-recipe` exits 0 (passed), 2 (a recipe fails) or 1 (bad usage).\n",
            "check-recipe exit status 2 documented as 'fail'",
        ),
    ],
)
def test_a_made_up_flag_path_choice_or_status_is_caught(snippet, problem):
    problems = doc_problems(snippet)
    assert any(problem in p for p in problems), problems


def test_what_is_not_a_repository_path_or_another_programs_command_is_left_alone():
    text = (
        "Outputs go to `runs/tiny_cpu/wandb` and `/ckpt/qwen3`; the venv is `~/.cache/x`.\n"
        "```bash\npip install --no-deps -e .\nwandb sync DIR/wandb/offline-run-1\n```\n"
    )
    assert doc_problems(text) == []
