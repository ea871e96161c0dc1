"""The ``hf-posenc`` command: ``finetune``, ``eval-ppl``, ``passkey``, ``main-job`` and ``methods``.

    hf-posenc methods
    hf-posenc eval-ppl --model smollm2 --method none --method yarn:factor=4 --lengths 512,1024
    accelerate launch -m hf_posenc.cli finetune --method alibi --text-file BOOK    # several processes
"""

from __future__ import annotations

import sys

COMMANDS = {
    "finetune": ("hf_posenc.tools.finetune", "fine-tune a patched model with accelerate"),
    "eval-ppl": ("hf_posenc.tools.eval_ppl", "perplexity vs context length for several models/methods"),
    "passkey": ("hf_posenc.tools.passkey", "passkey retrieval accuracy over lengths and depths"),
    "main-job": ("hf_posenc.tools.main_job", "the whole loop on SmolLM2-135M: fine-tune, evaluate, table and plot"),
}


def _usage() -> str:
    lines = ["usage: hf-posenc COMMAND [options]   (hf-posenc COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append(f"  {'methods':<10} list the positional methods and their options")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "methods":
        import hf_posenc
        from hf_posenc.registry import get_method

        for name in hf_posenc.available_methods():
            print(f"{name:<14} {', '.join(get_method(name).config_class.option_names()) or '-'}")
        return 0
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
