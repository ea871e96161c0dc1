"""Helpers of the tools' tests: the ``hf-posenc`` command in this process or under ``accelerate launch``, a tiny LLaMA
with a byte-level tokenizer saved to a folder, so real text from the shared folder can go through it (no downloads),
and checks that a refused run left its output folder as it was."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("HF_POSENC_DATA") or REPO.parent / "shared" / "data")  # as scripts/main.sh finds it
BOOK = DATA / "pg84-frankenstein.txt"
WIKI = DATA / "wikitext-2-raw-test.txt"


def run_cli(command: str, argv: list[str]) -> int:
    """``hf-posenc COMMAND ARGV...`` in this process; its exit code."""
    from hf_posenc.tools.cli import main

    return main([command, *argv])


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


def assert_failed_cleanly(exit_code: int, capsys, message: str, out: Path) -> None:
    """A bad request: exit code 2, `message` on stderr, and neither the output folder nor a leftover temporary
    folder beside it (see runtime.atomic_output_dir)."""
    assert exit_code == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes), to check that a refused or failed run changed nothing."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_refused(exit_code: int, capsys, message: str, folder: Path, before: dict[str, bytes]) -> None:
    """A refusal: exit code 2, one line ``error: ...`` holding `message` last on stderr (before it at most progress
    bars of model loading, no traceback), and ``folder`` as it was."""
    assert exit_code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.rstrip().splitlines()[-1].startswith("error: "), err
    assert message in err.rstrip().splitlines()[-1], err
    assert snapshot(folder) == before


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(command: str, args: list[str], num_processes: int = 2, timeout: int = 300,
           config: str = "ddp.yaml", cpu_mpirun: bool = False) -> subprocess.CompletedProcess:
    """`accelerate launch -m hf_posenc COMMAND ARGS...` of two processes, on a CPU-only machine too. By default with
    a shipped config (ddp.yaml: torchrun starts CPU processes, gloo). `cpu_mpirun`: the `--cpu` form, `accelerate
    launch --cpu --num_processes N --mpirun_hostfile FILE` (accelerate starts several CPU processes only through
    mpirun; MPICH comes from its PyPI wheel, so its mpiexec lies beside this Python)."""
    port = free_port()  # other test runs may hold accelerate's default 29500
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "MASTER_PORT": str(port)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if cpu_mpirun:
        hostfile = Path(tempfile.mkdtemp()) / "hostfile"
        hostfile.write_text(f"localhost:{num_processes}\n")  # MPICH's format
        # --main_process_port: in this form accelerate sets MASTER_PORT to 29500 unless told, whatever the
        # environment says, so two such runs at once (two test workers) met on one port and hung.
        cmd += ["--cpu", "--num_processes", str(num_processes), "--mpirun_hostfile", str(hostfile),
                "--main_process_port", str(port)]
    else:
        cmd += ["--config_file", str(REPO / "scripts/accelerate_configs" / config), "--num_processes",
                str(num_processes), "--main_process_port", str(port)]
    # A session of its own, so that a run past `timeout` is ended with every process it started (mpiexec's ranks
    # would otherwise go on holding the CPU), and the failure shows what they printed.
    process = subprocess.Popen([*cmd, "-m", "hf_posenc", command, *args], cwd=REPO, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"{' '.join(cmd[3:])} {command} ran past {timeout} s; it printed:\n"
                             f"{stdout[-2000:]}\n{stderr[-4000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def load_script(relative_path: str):
    """A script of the repository that is not in the package (benchmarks/...), imported as a module."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module
