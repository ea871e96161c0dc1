import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, torch.get_num_threads()))

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download anything
