"""The fine-tune's recipes (issue 18): PoSE position ids, positions that restart at each packed document, and
distillation from the original model (tools/finetune/positions.py, tools/finetune/teacher.py, tools/finetune/)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tool_helpers import BOOK, WIKI, run_cli, save_tiny_model

import hf_posenc
from hf_posenc.tools.finetune.positions import pack_documents, pose_chunks, pose_position_ids
from hf_posenc.tools.finetune.teacher import Teacher, distillation_loss, mixed_loss, unpatched
from tiny_models import random_ids, tiny_model


# --- PoSE -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunks", [2, 3, 5])
def test_pose_ids_cover_the_target_length_with_the_stated_chunking(chunks):
    window, target = 64, 1024
    generator = torch.Generator().manual_seed(0)
    seen = torch.zeros(target, dtype=torch.bool)
    for _ in range(400):
        ids = pose_position_ids(window, target, chunks, generator)
        assert ids.shape == (window,) and ids[0] == 0 and int(ids.max()) < target
        assert bool((ids[1:] > ids[:-1]).all())  # increasing
        runs = pose_chunks(ids)
        assert 1 <= len(runs) <= chunks  # consecutive within a chunk (a skip of 0 merges two chunks)
        if chunks == 2:  # the reference code's first chunk: at most half the window
            assert runs[0][1] <= (window + 1) // 2 or len(runs) == 1
        seen[ids] = True
    # over windows of 64 tokens, the ids reach (nearly) every position below the target length
    assert seen.float().mean() > 0.9 and seen[-8:].any()


def test_pose_refuses_a_target_shorter_than_the_window():
    with pytest.raises(ValueError, match="target length"):
        pose_position_ids(64, 32)


# --- document restarts ----------------------------------------------------------------------------------------------
def test_pack_documents_restarts_positions_at_each_document_and_block():
    docs = [torch.arange(10, 15), torch.arange(20, 23), torch.arange(30, 40)]
    blocks, positions = pack_documents(docs, 8, separator=99)
    from hf_posenc.tools.text import pack_blocks

    assert torch.equal(blocks, pack_blocks(docs, 8, 99))  # the same blocks as before
    # stream: 10..14 99 | 20 21 22 99 | 30..39; blocks of 8; a block starting inside a document starts at 0
    assert positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 0, 1, 2, 3, 4, 5]]
    assert blocks.tolist()[0] == [10, 11, 12, 13, 14, 99, 20, 21]


@pytest.mark.parametrize("model_type,method", [("llama", None), ("llama", "alibi"), ("qwen3", "fire"),
                                               ("gpt2", None), ("gpt2", "kerple")])
def test_packed_documents_with_restarts_equal_each_document_alone(model_type, method):
    """Ids that restart, no attention mask and no cache: transformers masks attention across the documents, so the
    logits of each document in the packed row equal that document run alone (positions and attention both restart).
    With a cache (use_cache left on, as a model in eval mode makes one) transformers does not look for packing."""
    model = tiny_model(model_type)
    if method:
        hf_posenc.patch_model(model, method)
    docs = [random_ids(1, n, seed=n)[0] for n in (7, 4, 9)]
    blocks, positions = pack_documents(docs, 22, separator=1)  # 7 + 1 + 4 + 1 + 9 = 22: one block
    with torch.no_grad():
        packed = model(blocks, position_ids=positions, use_cache=False).logits[0]
        start = 0
        for doc in docs:
            piece = blocks[0, start:start + len(doc) + 1][None]  # the document with its separator
            alone = model(piece).logits[0]
            assert (packed[start:start + piece.shape[1]] - alone).abs().max() <= 1e-5
            start += piece.shape[1]
        plain = model(blocks).logits[0]
    assert (plain[8:] - packed[8:]).abs().max() > 1e-3  # without restarts the later documents see the earlier ones


# --- distillation ---------------------------------------------------------------------------------------------------
def test_distillation_loss_equals_a_hand_computed_kl():
    teacher_model = tiny_model("llama")
    student = hf_posenc.patch_model(tiny_model("llama"), "alibi")
    ids = random_ids(2, 10)
    with torch.no_grad():
        s, t = student(ids).logits, teacher_model(ids).logits
    for temperature in (1.0, 2.0):
        total, count = 0.0, 0
        for b in range(2):
            for i in range(10):
                p = [math.exp(x / temperature) for x in t[b, i].double().tolist()]
                q = [math.exp(x / temperature) for x in s[b, i].double().tolist()]
                zp, zq = sum(p), sum(q)
                total += sum(pi / zp * math.log((pi / zp) / (qi / zq)) for pi, qi in zip(p, q))
                count += 1
        expected = total / count * temperature ** 2
        assert abs(float(distillation_loss(s, t, temperature)) - expected) <= 1e-6 * max(1.0, expected)
    lm = torch.tensor(3.0)
    kl = distillation_loss(s, t)
    assert torch.allclose(mixed_loss(lm, kl, 0.25), 0.25 * kl + 0.75 * lm)
    assert torch.equal(mixed_loss(lm, kl, 1.0), kl)
    # only the positions inside the teacher's window count
    assert torch.allclose(distillation_loss(s, t[:, :6], covered=6), distillation_loss(s[:, :6], t[:, :6]))


@pytest.mark.parametrize("frozen_base", [True, False], ids=["unpatched view", "frozen copy"])
def test_the_teachers_logits_are_the_unpatched_models_bit_for_bit(frozen_base):
    model = tiny_model("llama")
    ids = random_ids(2, 12)
    with torch.no_grad():
        original = model(ids).logits
    teacher = Teacher.original(model, frozen_base=frozen_base)
    hf_posenc.patch_model(model, "alibi", trainable=True)
    with torch.no_grad():
        hf_posenc.get_positional_module(model).slopes.mul_(1.5)  # trained positional weights
        patched = model(ids).logits
    assert torch.equal(teacher.logits(model, input_ids=ids), original)
    with torch.no_grad():  # the student is patched again, its trained weights kept
        assert torch.equal(model(ids).logits, patched)
    assert hf_posenc.get_posenc_config(model).method == "alibi"
    from hf_posenc.checkpoints.saving import changed_positional_state

    assert changed_positional_state(hf_posenc.get_positional_module(model))  # still counts as trained
    # the teacher sees at most its trained window (64 tokens for the tiny LLaMA)
    long_ids = random_ids(1, 80)
    assert teacher.logits(model, input_ids=long_ids).shape[1] == 64
    restarts = torch.arange(80)[None] % 40  # two documents, as the fine-tune passes them
    cut = teacher.logits(model, input_ids=long_ids, position_ids=restarts, use_cache=False)
    with torch.no_grad():
        hf_posenc.unpatch_model(model)
        assert torch.equal(cut, model(long_ids[:, :64], position_ids=restarts[:, :64], use_cache=False).logits)


@pytest.mark.parametrize("frozen_base", [True, False], ids=["unpatched view", "frozen copy"])
def test_the_teacher_of_a_patched_checkpoint_is_the_model_without_its_patch(tmp_path, frozen_base):
    """`finetune --model DIR --distill-from original` on a patched checkpoint: the teacher is the checkpoint's model
    with its patch taken off. (It was once a copy of the patched model itself: a KL near 0 from the first step.)"""
    model = tiny_model("llama")
    ids = random_ids(2, 12)
    with torch.no_grad():
        original = model(ids).logits
    hf_posenc.patch_model(model, "t5", per_layer=True)
    model.save_pretrained(tmp_path)
    loaded = hf_posenc.from_pretrained(tmp_path)
    with torch.no_grad():
        patched = loaded(ids).logits
    assert (patched - original).abs().max() > 1e-3  # the patch changes the model
    teacher = Teacher.original(loaded, frozen_base=frozen_base)
    assert (teacher.logits(loaded, input_ids=ids) - original).abs().max() <= 1e-6
    with torch.no_grad():  # the student keeps its patch and its loaded table
        assert torch.equal(loaded(ids).logits, patched)
    assert hf_posenc.get_posenc_config(loaded).method == "t5"


def test_the_memory_estimate_counts_the_teacher():
    from hf_posenc.tools.estimates import estimate_training_bytes

    model = tiny_model("llama")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab, length, batch = model.config.vocab_size, 256, 2
    alone = estimate_training_bytes(model, length, batch, trainable=100, checkpointing=False)
    view = estimate_training_bytes(model, length, batch, trainable=100, checkpointing=False,
                                   teacher=Teacher.original(model, frozen_base=True))
    copy = estimate_training_bytes(model, length, batch, trainable=100, checkpointing=False,
                                   teacher=Teacher.original(model, frozen_base=False))
    logits = batch * length * vocab * 4 * 2  # the teacher's fp32 logits and their softmax
    assert view - alone == pytest.approx(1.25 * logits, abs=1)
    assert copy - view == pytest.approx(1.25 * weights, abs=1)  # the frozen copy's own weights


def test_the_unpatched_view_disables_lora_adapters():
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama")
    ids = random_ids(1, 9)
    with torch.no_grad():
        original = model(ids).logits
    hf_posenc.patch_model(model, "nope")
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    with torch.no_grad():
        with unpatched(peft_model) as teacher:
            assert torch.equal(teacher(ids).logits, original)
        assert not torch.equal(peft_model(ids).logits, original)
    assert hf_posenc.get_posenc_config(model).method == "nope"


# --- the fine-tune with them ----------------------------------------------------------------------------------------
pytestmark_data = pytest.mark.skipif(not BOOK.is_file(), reason="../shared/data is not there")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytestmark_data
@pytest.mark.parametrize("extra,expect", [
    (["--pose-target-length", "256", "--pose-chunks", "3"], {"document_restarts_used": False}),
    (["--distill-from", "original", "--train-only", "positional"], {"mode": "unpatched view"}),
    (["--distill-from", "original", "--distill-alpha", "1", "--distill-temperature", "2", "--train-only", "all"],
     {"mode": "frozen copy"}),
    ([], {"document_restarts_used": True}),
], ids=["pose", "distill-view", "distill-copy", "restarts"])
def test_a_finetune_runs_with_each_recipe(tiny_dir, tmp_path, extra, expect):
    out = tmp_path / "ft"
    argv = ["--model", str(tiny_dir), "--method", "alibi", "--method-option", "trainable=true",
            "--text-file", str(BOOK), "--text-file", str(WIKI), "--text-fraction", "0:0.05", "--max-length", "32",
            "--max-steps", "2", "--lr", "1e-3", "--output-dir", str(out), "--no-progress", *extra]
    assert run_cli("finetune", argv) == 0
    summary = json.loads((out / "training_args.json").read_text())
    assert summary["steps_done"] == 2 and math.isfinite(summary["final_loss"])
    for key, value in expect.items():
        where = summary["distillation"] if key == "mode" else summary
        assert where[key] == value


def test_pose_target_must_exceed_the_window(tiny_dir, tmp_path, capsys):
    argv = ["--model", str(tiny_dir), "--text-file", str(BOOK), "--max-length", "32", "--pose-target-length", "16",
            "--output-dir", str(tmp_path / "ft"), "--no-progress"]
    assert run_cli("finetune", argv) == 2
    assert "--pose-target-length 16 must be longer than --max-length 32" in capsys.readouterr().err


@pytest.mark.parametrize("alpha", ["1.5", "-0.1", "nan"])
def test_distill_alpha_outside_0_1_is_refused(tiny_dir, tmp_path, capsys, alpha):
    argv = ["--model", str(tiny_dir), "--text-file", str(BOOK), "--max-length", "32", "--distill-from", "original",
            "--distill-alpha", alpha, "--output-dir", str(tmp_path / "ft"), "--no-progress"]
    assert run_cli("finetune", argv) == 2
    assert "--distill-alpha must be a finite number >= 0 and <= 1" in capsys.readouterr().err
    assert not (tmp_path / "ft").exists()


@pytestmark_data
def test_two_processes_distill_and_train_the_same_weights(tiny_dir, tmp_path):
    from tool_helpers import launch

    out = tmp_path / "ft"
    done = launch("finetune", ["--model", str(tiny_dir), "--method", "alibi", "--method-option", "trainable=true",
                               "--text-file", str(BOOK), "--text-fraction", "0:0.1", "--max-length", "32",
                               "--max-steps", "3", "--lr", "1e-3", "--output-dir", str(out), "--no-progress",
                               "--threads", "1", "--distill-from", "original", "--train-only", "lora"])
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "training_args.json").read_text())
    assert summary["num_processes"] == 2 and summary["distillation"]["mode"] == "unpatched view"
    digests = summary["weights_sha256_per_process"]
    assert len(digests) == 2 and digests[0] == digests[1]


# --- attention transfer (issue 55) ---------------------------------------------------------------------------------
@pytestmark_data
@pytest.mark.parametrize("train_only", ["positional", "qk", "qkvo", "lora"])
def test_attention_transfer_then_distillation_runs_and_records_its_settings(tiny_dir, tmp_path, train_only):
    out = tmp_path / "ft"
    argv = ["--model", str(tiny_dir), "--method", "drope", "--text-file", str(BOOK), "--text-fraction", "0:0.05",
            "--max-length", "80", "--max-steps", "3", "--transfer-steps", "2", "--distill-from", "original",
            "--train-only", train_only, "--lr", "1e-3", "--output-dir", str(out), "--no-progress"]
    assert run_cli("finetune", argv) == 0
    summary = json.loads((out / "training_args.json").read_text())
    assert summary["transfer_steps"] == 2 and summary["train_only"] == train_only
    # the tiny LLaMA's window is 64 tokens: the transfer stage reads the 80-token blocks' first 64
    assert summary["attention_transfer"] == {"steps": 2, "end_to_end_steps": 1, "blocks_cut_to_teacher_window": 64,
                                             "loss": "relative MSE of each changed layer's attention output, averaged"}
    assert summary["distillation"]["mode"] == ("unpatched view" if train_only in ("positional", "lora")
                                               else "frozen copy")
    log = json.loads((out / "loss_log.json").read_text())
    assert [entry["stage"] for entry in log] == ["transfer", "transfer", "end-to-end"]
    assert all(math.isfinite(entry["loss"]) for entry in log)
    # the tiny LLaMA, per layer: q 64 x 64, k 32 x 64 (v and o as large), DroPE's norms 64 + 32; two layers
    expected = {"positional": 2 * 96, "qk": 2 * (4096 + 2048 + 96), "qkvo": 2 * (2 * 4096 + 2 * 2048 + 96)}
    if train_only in expected:
        assert summary["trainable_parameters"] == expected[train_only]


@pytestmark_data
@pytest.mark.parametrize("extra,message", [
    (["--transfer-steps", "2"], "add --distill-from original"),
    (["--transfer-steps", "2", "--distill-from", "original", "--train-only", "all"],
     "use --train-only positional, qk, qkvo or lora"),
    (["--transfer-steps", "5", "--distill-from", "original", "--train-only", "qk"],
     "--transfer-steps must be an integer >= 0 and <= 3"),
    (["--transfer-steps", "1", "--distill-from", "original", "--train-only", "qk", "--method", "sinusoidal"],
     "use --distill-from alone (--transfer-steps 0)"),
])
def test_bad_attention_transfer_settings_are_refused_with_the_fix(tiny_dir, tmp_path, capsys, extra, message):
    out = tmp_path / "ft"
    argv = ["--model", str(tiny_dir), "--method", "drope", "--text-file", str(BOOK), "--text-fraction", "0:0.05",
            "--max-length", "32", "--max-steps", "3", "--output-dir", str(out), "--no-progress", *extra]
    assert run_cli("finetune", argv) == 2
    assert message in capsys.readouterr().err.rstrip().splitlines()[-1]
    assert not out.exists()


@pytestmark_data
def test_two_processes_transfer_then_distil_and_train_the_same_weights(tiny_dir, tmp_path):
    from tool_helpers import launch

    out = tmp_path / "ft"
    done = launch("finetune", ["--model", str(tiny_dir), "--method", "drope", "--text-file", str(BOOK),
                               "--text-fraction", "0:0.1", "--max-length", "32", "--max-steps", "3",
                               "--transfer-steps", "2", "--lr", "1e-3", "--output-dir", str(out), "--no-progress",
                               "--threads", "1", "--distill-from", "original", "--train-only", "qk"])
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "training_args.json").read_text())
    assert summary["num_processes"] == 2 and summary["attention_transfer"]["steps"] == 2
    digests = summary["weights_sha256_per_process"]
    assert len(digests) == 2 and digests[0] == digests[1]
