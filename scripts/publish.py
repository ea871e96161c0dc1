#!/usr/bin/env python
"""Publish a saved hf_posenc checkpoint to the Hugging Face Hub (a thin front-end to hf_posenc.push_to_hub).

    python scripts/publish.py out/smollm2-alibi me/smollm2-alibi --private --evaluation runs/demo/results.csv \
        --plot runs/demo/perplexity.png --base-model HuggingFaceTB/SmolLM2-135M
    python scripts/publish.py out/smollm2-alibi me/smollm2-alibi --dry-run /tmp/upload   # writes, lists, uploads nothing

The token comes from --token, else HF_TOKEN, else `hf auth login`; the endpoint from HF_ENDPOINT.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import hf_posenc

    card = {k: v for k, v in dict(base_model=args.base_model, license=args.license,
                                  base_model_card=args.base_model_card, evaluation=args.evaluation,
                                  finetune_settings=args.finetune_settings).items() if v is not None}
    try:
        result = hf_posenc.push_to_hub(
            args.checkpoint, args.repo_id, token=args.token, private=args.private or None, revision=args.revision,
            commit_message=args.message, create_pr=args.create_pr, standalone=args.standalone,
            model_card=not args.no_card, plot=args.plot, dry_run=args.dry_run, **card)
    except hf_posenc.PosEncError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"dry run: {args.dry_run} holds what would be uploaded to {args.repo_id}:")
        for name in result:
            size = (Path(args.dry_run) / name).stat().st_size
            print(f"  {name}  ({size:,} bytes)")
    else:
        print(f"uploaded to {result.commit_url}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
