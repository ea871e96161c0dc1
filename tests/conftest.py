"""Test settings and the fixtures shared by several test files.

tests/ is not a package: under pytest's default import mode its directory is on sys.path, so test modules import
the shared helpers as `helpers` (engine and checkpoint tests), `tiny_models` and `train_eval_helpers` (tools)."""

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download anything
# One intra-op thread per pytest-xdist worker: the workers already fill the cores, and on tiny models a second
# thread per worker only oversubscribes them (measured on 2 cores: the contract's decoding and padding tests took
# 5x as long with 2 threads per worker as with 1).
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="where the tests that take the `device` fixture run (the hand-written backwards and the "
                          "paths that differ off the CPU): e.g. `--device cuda` on a GPU machine; default cpu")


def pytest_configure(config):
    # The Triton kernels' tests run through Triton's interpreter unless they run on a GPU (--device cuda): it must be
    # set before triton is imported (the library imports triton only where a Triton path is chosen).
    if config.getoption("--device") == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device(request) -> torch.device:
    """The device of `--device`. Tests build their inputs on the CPU (seeded CPU generators) and move them here."""
    device = torch.device(request.config.getoption("--device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: torch sees no CUDA device on this machine")
    return device


@dataclass
class SavedCheckpoint:
    directory: Path
    ids: torch.Tensor
    logits: torch.Tensor  # of the model that was saved, on `ids`
    config: object  # its posenc config


@pytest.fixture(scope="session")
def contract_checkpoints(tmp_path_factory) -> dict[tuple[str, str], SavedCheckpoint]:
    """(method, model type) -> a checkpoint saved with standalone=True from a tiny model patched as helpers.CONTRACT
    says, its positional state moved off its initial values (for test_contract and test_checkpoint)."""
    import hf_posenc
    from helpers import contract_cases, patch_for_contract, perturb_positional_state
    from tiny_models import random_ids, tiny_model

    root = tmp_path_factory.mktemp("contract-checkpoints")
    ids = random_ids(2, 9)
    saved = {}
    for method, model_type in dict.fromkeys(contract_cases("save_load") + contract_cases("standalone")):
        model = patch_for_contract(tiny_model(model_type), method)
        perturb_positional_state(model)
        with torch.no_grad():
            logits = model(ids).logits
        directory = root / f"{model_type}-{method}"
        model.save_pretrained(directory, standalone=True)
        torch.save({"ids": ids, "logits": logits}, directory / "reference.pt")
        saved[method, model_type] = SavedCheckpoint(directory, ids, logits, hf_posenc.get_posenc_config(model))
    return saved


@pytest.fixture(scope="session")
def standalone_results(contract_checkpoints, tmp_path_factory) -> dict[str, list]:
    """The contract checkpoints loaded with trust_remote_code=True in one process where hf_posenc cannot be imported
    (see helpers.load_without_hf_posenc)."""
    from helpers import load_without_hf_posenc

    directories = [saved.directory for saved in contract_checkpoints.values()]
    return load_without_hf_posenc(directories, tmp_path_factory.mktemp("standalone"))
