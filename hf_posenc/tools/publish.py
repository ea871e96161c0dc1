"""``hf-posenc publish``: upload a saved checkpoint to the Hugging Face Hub, with its model card. The work is the
library's (``hf_posenc.push_to_hub``: model card, standalone code, upload); this only parses options and prints what
happened.

    hf-posenc publish out/smollm2-alibi me/smollm2-alibi --private --evaluation runs/demo/results.csv \\
        --plot runs/demo/perplexity.png --base-model HuggingFaceTB/SmolLM2-135M-Instruct
    hf-posenc publish out/smollm2-alibi me/smollm2-alibi --dry-run /tmp/upload   # writes, lists, uploads nothing

The token comes from --token, else HF_TOKEN, else `hf auth login`; the endpoint from HF_ENDPOINT.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-posenc publish", description=(
        "Publish a saved hf_posenc checkpoint to the Hugging Face Hub, with its model card."))
    parser.add_argument("checkpoint", help="directory written by save_pretrained on a patched model")
    parser.add_argument("repo_id", help="namespace/name on the Hub")
    parser.add_argument("--dry-run", metavar="DIR", help="write the folder that would be uploaded to DIR and list it")
    parser.add_argument("--private", action="store_true", help="create the repo private (if it does not exist)")
    parser.add_argument("--revision", help="branch to push to (created from main if missing)")
    parser.add_argument("--message", help="commit message")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    parser.add_argument("--token", help="Hugging Face token (default: HF_TOKEN or the saved login)")
    parser.add_argument("--standalone", action="store_true",
                        help="include the code that loads it with trust_remote_code=True, without hf_posenc")
    parser.add_argument("--no-card", action="store_true", help="do not write README.md (the model card)")
    parser.add_argument("--base-model", help="Hub id of the model it was made from (default: posenc_config.json)")
    parser.add_argument("--license", help="license id (default: the base model card's, with --base-model-card)")
    parser.add_argument("--base-model-card", help="the base model's README.md or local directory (for its license)")
    parser.add_argument("--evaluation", help="evaluation CSV (a row per model), e.g. runs/demo/results.csv")
    parser.add_argument("--plot", help="an image to upload and show in the card, e.g. runs/demo/perplexity.png")
    parser.add_argument("--finetune-settings", help="the fine-tuning run's saved settings (JSON)")
    return parser


def run(args: argparse.Namespace) -> None:
    from hf_posenc import push_to_hub

    card = {key: value for key, value in dict(base_model=args.base_model, license=args.license,
                                              base_model_card=args.base_model_card, evaluation=args.evaluation,
                                              finetune_settings=args.finetune_settings).items() if value is not None}
    result = push_to_hub(args.checkpoint, args.repo_id, token=args.token, private=args.private or None,
                         revision=args.revision, commit_message=args.message, create_pr=args.create_pr,
                         standalone=args.standalone, model_card=not args.no_card, plot=args.plot,
                         dry_run=args.dry_run, **card)
    if args.dry_run:
        print(f"dry run: {args.dry_run} holds what would be uploaded to {args.repo_id}:")
        for name in result:
            print(f"  {name}  ({(Path(args.dry_run) / name).stat().st_size:,} bytes)")
    else:
        print(f"uploaded to {result.commit_url}")
