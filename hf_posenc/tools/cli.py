"""The ``hf-posenc`` command: one subcommand per tool.

    hf-posenc methods
    hf-posenc eval-ppl --model smollm2 --method none --method yarn:factor=4 --lengths 512,1024 --text-file BOOK
    accelerate launch -m hf_posenc finetune --method alibi --text-file BOOK      # several processes

Each subcommand's module has ``build_parser()`` (its options) and ``run(args)`` (its body); this module parses,
runs, and turns every refusal into one line ``error: ...`` and exit code 2 (``runtime.run_command``).
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # in hf_posenc.tools, named as the command (lm_eval_run: `lm_eval` is the package it runs)
    help: str


COMMANDS = {
    "finetune": Command("finetune", "fine-tune a patched model with accelerate"),
    "eval-ppl": Command("eval_ppl", "perplexity vs context length for several models/methods"),
    "passkey": Command("passkey", "passkey retrieval accuracy over lengths and depths"),
    "niah": Command("niah", "needle in a haystack over real text: exact match and answer log-probability"),
    "lm-eval": Command("lm_eval_run", "short-context tasks through lm-eval on the patched model (HFLM)"),
    "report": Command("report", "several runs' results in one Markdown page with tables and plots"),
    "main-job": Command("main_job", "the whole loop on SmolLM2-135M-Instruct: fine-tune, evaluate, table and plot"),
    "demo": Command("demo", "patch SmolLM2-135M-Instruct with each method: perplexity, a continuation, exact unpatch"),
    "export": Command("export", "add the code that loads a saved checkpoint without hf_posenc"),
    "publish": Command("publish", "upload a saved checkpoint to the Hugging Face Hub, with its model card"),
}


def _usage() -> str:
    lines = ["usage: hf-posenc COMMAND [options]   (hf-posenc COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<10} {command.help}" for name, command in COMMANDS.items()]
    lines.append(f"  {'methods':<10} list the positional methods and their options (methods NAME: one in detail)")
    lines += ["", "  --version  the installed hf_posenc version"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .runtime import DefaultsHelpFormatter, fail, run_command

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("--version", "-V"):
        from ..version import __version__

        print(f"hf-posenc (hf_posenc) {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name == "methods":
        from .method_options import describe_method, list_methods

        if len(rest) > 1 or rest[:1] in (["-h"], ["--help"]):
            return fail("usage: hf-posenc methods [NAME]")
        return run_command(lambda: describe_method(rest[0]) if rest else list_methods())
    if name not in COMMANDS:
        return fail(f"unknown command {name!r}\n\n{_usage()}")
    command = COMMANDS[name]
    module = importlib.import_module(f"{__package__}.{command.module}")
    parser = module.build_parser()
    parser.formatter_class = DefaultsHelpFormatter  # every command's --help shows its defaults
    args = parser.parse_args(rest)
    return run_command(lambda: _with_library_bars(lambda: module.run(args)))


def _with_library_bars(run):
    from .progress import library_bars_on_a_terminal

    with library_bars_on_a_terminal():
        return run()


def demo_main() -> int:
    """The ``hf-posenc-demo`` console script: ``hf-posenc demo``."""
    return main(["demo", *sys.argv[1:]])


def export_main() -> int:
    """The ``hf-posenc-export`` console script: ``hf-posenc export``."""
    return main(["export", *sys.argv[1:]])
