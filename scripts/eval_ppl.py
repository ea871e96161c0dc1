#!/usr/bin/env python
"""Perplexity vs context length for several models/methods (see hf_posenc.evaluate; `--help`).

    python scripts/eval_ppl.py --model smollm2 --method none --method yarn:factor=4 --lengths 256,512
    accelerate launch --num_processes 2 scripts/eval_ppl.py ...
"""
import sys

from hf_posenc.tools.eval_ppl import main

if __name__ == "__main__":
    sys.exit(main())
