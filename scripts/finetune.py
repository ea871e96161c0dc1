#!/usr/bin/env python
"""Fine-tune a patched model with accelerate (see hf_posenc.train; `--help`).

    accelerate launch scripts/finetune.py --model smollm2 --method alibi --text-file BOOK --max-steps 100
    accelerate launch --config_file scripts/accelerate_configs/ddp.yaml scripts/finetune.py ...
"""
import sys

from hf_posenc.tools.finetune import main

if __name__ == "__main__":
    sys.exit(main())
