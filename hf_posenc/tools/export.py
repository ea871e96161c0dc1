"""``hf-posenc export``: add the code that loads a saved checkpoint without hf_posenc (``trust_remote_code=True``).
The work is the library's (``hf_posenc.export_checkpoint``); this only parses options and prints what happened.

    hf-posenc export out/smollm2-alibi [out/smollm2-alibi-standalone]
"""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-posenc export", description=(
        "Add code to a saved hf_posenc checkpoint so that plain transformers loads it with "
        "trust_remote_code=True, without hf_posenc installed."))
    parser.add_argument("checkpoint", help="directory written by save_pretrained on a patched model")
    parser.add_argument("output", nargs="?", help="write to this new directory instead of in place")
    return parser


def run(args: argparse.Namespace) -> None:
    from hf_posenc.export import export_checkpoint

    print(f"standalone checkpoint: {export_checkpoint(args.checkpoint, args.output)}")
