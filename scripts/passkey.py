#!/usr/bin/env python
"""Passkey retrieval over lengths and depths (see hf_posenc.passkey; `--help`).

    python scripts/passkey.py --model smollm2 --method none --method yarn:factor=4 --lengths 1024,2048 --trials 3
"""
import sys

from hf_posenc.tools.passkey import main

if __name__ == "__main__":
    sys.exit(main())
