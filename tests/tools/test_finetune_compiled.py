"""A fine-tune under accelerate's --dynamo_backend (the prepared model wrapped by torch.compile): its first step is
checked against the uncompiled model on the same batch before the compiled graph trains, the weights it trains and
saves are the uncompiled run's, and a compiled step that disagrees or fails to compile gives way to the uncompiled
model. "aot_eager" traces forward and backward as inductor would, without the C++ compile time."""

from __future__ import annotations

import json

import pytest
import torch
import torch._dynamo
from safetensors.torch import load_file
from tool_helpers import BOOK, run_cli, save_tiny_model

pytestmark = pytest.mark.skipif(not BOOK.is_file(), reason="../shared/data is not there")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-gpt2", "gpt2")


def _fresh_accelerate_state():
    # accelerate keeps its state (the dynamo backend included) for the process; each run here reads its own
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    torch._dynamo.reset()


def finetune(model_dir, out, method, *extra, backend=None, monkeypatch=None):
    """One in-process fine-tune of 3 steps; under `backend`, accelerate compiles the prepared model."""
    if backend is None:
        monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", backend)
    _fresh_accelerate_state()
    try:
        code = run_cli("finetune", ["--model", str(model_dir), "--method", method, "--text-file", str(BOOK),
                                    "--text-fraction", "0:0.05", "--max-length", "32", "--max-steps", "3",
                                    "--lr", "1e-3", "--output-dir", str(out), "--no-progress", "--threads", "1",
                                    *extra])
    finally:
        monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
        _fresh_accelerate_state()
    assert code == 0
    return load_file(out / "model.safetensors"), json.loads((out / "training_args.json").read_text())


def max_weight_diff(a, b):
    assert set(a) == set(b)  # the same names: a compiled wrapper's "_orig_mod." prefix would show here
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("method, extra", [
    ("kerple", ["--train-only", "all"]),
    ("kerple", ["--train-only", "positional", "--distill-from", "original"]),  # teacher: the patch taken off
    # a content method refuses to be traced as one graph; dynamo breaks the graph there and runs that part uncompiled
    ("fox", ["--train-only", "all"]),
], ids=["lm", "distill-unpatched-view", "content-method"])
def test_a_compiled_finetune_is_checked_and_trains_the_uncompiled_weights(tiny_dir, tmp_path, monkeypatch, method,
                                                                          extra):
    eager, eager_summary = finetune(tiny_dir, tmp_path / "eager", method, *extra, monkeypatch=monkeypatch)
    compiled, summary = finetune(tiny_dir, tmp_path / "compiled", method, *extra, backend="aot_eager",
                                 monkeypatch=monkeypatch)
    assert eager_summary["compiled_step"] is None
    check = summary["compiled_step"]
    assert check["served"] and check["backend"] == "aot_eager" and check["compared"] == "training step"
    assert abs(check["compiled_loss"] - check["uncompiled_loss"]) < 1e-4
    assert check["uncompiled_loss"] == pytest.approx(eager_summary["first_loss"], abs=1e-5)
    assert max_weight_diff(compiled, eager) < 1e-4


def test_a_compiled_step_that_disagrees_gives_way_to_the_uncompiled_model(tiny_dir, tmp_path, monkeypatch, capsys):
    from accelerate.utils import TorchDynamoPlugin

    def wrong_backend(graph, example_inputs):  # a "compiler" whose every float output is off by 0.5
        def run(*args):
            return [o + 0.5 if torch.is_tensor(o) and o.is_floating_point() else o for o in graph(*args)]
        return run

    monkeypatch.setattr(TorchDynamoPlugin, "to_kwargs", lambda self: {"backend": wrong_backend})
    eager, _ = finetune(tiny_dir, tmp_path / "eager", "alibi", monkeypatch=monkeypatch)
    capsys.readouterr()
    served, summary = finetune(tiny_dir, tmp_path / "wrong", "alibi", backend="eager", monkeypatch=monkeypatch)
    check = summary["compiled_step"]
    assert not check["served"] and abs(check["compiled_loss"] - check["uncompiled_loss"]) > 0.1
    assert "compiled training step (eager) is not used" in capsys.readouterr().err
    assert max_weight_diff(served, eager) == 0.0  # it fell back before the first update


def test_a_compiler_that_fails_gives_way_to_the_uncompiled_model(tiny_dir, tmp_path, monkeypatch, capsys):
    from accelerate.utils import TorchDynamoPlugin

    def broken_backend(graph, example_inputs):
        raise RuntimeError("this compiler is broken")

    monkeypatch.setattr(TorchDynamoPlugin, "to_kwargs", lambda self: {"backend": broken_backend})
    eager, _ = finetune(tiny_dir, tmp_path / "eager", "kerple", monkeypatch=monkeypatch)
    capsys.readouterr()
    served, summary = finetune(tiny_dir, tmp_path / "broken", "kerple", backend="eager", monkeypatch=monkeypatch)
    check = summary["compiled_step"]
    assert not check["served"] and "this compiler is broken" in check["error"]
    assert "this compiler is broken" in capsys.readouterr().err
    assert max_weight_diff(served, eager) == 0.0


def test_a_model_with_dropout_is_checked_in_eval_mode(tiny_gpt2_dir, tmp_path, monkeypatch):
    _, summary = finetune(tiny_gpt2_dir, tmp_path / "compiled", "kerple", backend="aot_eager",
                          monkeypatch=monkeypatch)
    check = summary["compiled_step"]
    assert check["served"] and check["compared"].startswith("eval mode")
    assert abs(check["compiled_loss"] - check["uncompiled_loss"]) < 1e-4
