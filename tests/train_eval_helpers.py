"""Helpers of the fine-tuning / evaluation tests: a tiny LLaMA with a byte-level tokenizer saved to a folder, so
real text from ../shared/data can go through it (no downloads)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
BOOK = DATA / "pg84-frankenstein.txt"
WIKI = DATA / "wikitext-2-raw-test.txt"


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def save_tiny_model(directory: Path, model_type: str = "llama", seed: int = 0) -> Path:
    from tiny_models import CONFIGS
    from transformers import AutoModelForCausalLM

    tokenizer = byte_tokenizer()
    config = CONFIGS[model_type]()
    config.vocab_size = len(tokenizer)
    config.eos_token_id, config.bos_token_id, config.pad_token_id = len(tokenizer) - 1, None, None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def launch(script: str, args: list[str], num_processes: int = 2, timeout: int = 300,
           config: str = "ddp.yaml") -> subprocess.CompletedProcess:
    """`accelerate launch` with the shipped DDP config: on a CPU-only machine it starts CPU processes (gloo).
    (`accelerate launch --cpu --num_processes 2` starts a single process in accelerate 1.x without MPI.)"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with socket.socket() as sock:  # a free port: other test runs may hold accelerate's default 29500
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "scripts/accelerate_configs" / config), "--num_processes", str(num_processes),
           "--main_process_port", str(port), str(REPO / script), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
