"""``finetune --teacher-samples``: blocks sampled from the teacher join the training blocks (issue 55)."""

from __future__ import annotations

import json

import pytest
import torch
from tool_helpers import BOOK, run_cli, save_tiny_model

import hf_posenc
from hf_posenc.tools.finetune.teacher_samples import draw_samples

BATCH = 4  # rows per generate call in these tests
from hf_posenc.tools.models import load_model

pytestmark = pytest.mark.skipif(not BOOK.is_file(), reason="../shared/data is not there")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def original(tiny_dir):
    model, tokenizer = load_model(str(tiny_dir), dtype=torch.float32, verbose=False)
    return model.eval(), tokenizer


def greedy_without_eos(model, start: int, rows: int, length: int) -> torch.Tensor:
    """Greedy continuation by full forwards (no cache), the end-of-text token never chosen."""
    ids = torch.full((rows, 1), start)
    with torch.no_grad():
        while ids.shape[1] < length:
            logits = model(ids).logits[:, -1].clone()
            logits[:, start] = -float("inf")
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids


def test_a_cold_sample_is_the_greedy_continuation_without_end_of_text(tiny_dir):
    """At a temperature near 0 sampling is the argmax: the cached generate equals full forwards step by step."""
    model, tokenizer = original(tiny_dir)
    eos = tokenizer.eos_token_id
    drawn = draw_samples(model, 3, 24, eos, temperature=1e-7, seed=0)
    assert list(drawn) == [0]
    assert torch.equal(drawn[0], greedy_without_eos(model, eos, 3, 24))


def test_a_top_1_sample_is_greedy_at_any_temperature(tiny_dir):
    model, tokenizer = original(tiny_dir)
    eos = tokenizer.eos_token_id
    drawn = draw_samples(model, 3, 24, eos, temperature=2.0, seed=1, top_k=1)
    assert torch.equal(drawn[0], greedy_without_eos(model, eos, 3, 24))
    assert not torch.equal(draw_samples(model, 3, 24, eos, temperature=2.0, seed=1)[0], drawn[0])


def test_samples_are_seeded_per_batch_and_leave_the_global_rng_alone(tiny_dir):
    model, tokenizer = original(tiny_dir)
    eos, n = tokenizer.eos_token_id, 2 * BATCH + 3
    state = torch.random.get_rng_state()
    every = draw_samples(model, n, 16, eos, temperature=1.0, seed=5, batch_size=BATCH)
    assert torch.equal(torch.random.get_rng_state(), state)
    blocks = torch.cat([every[i] for i in range(3)])
    assert blocks.shape == (n, 16) and (blocks[:, 0] == eos).all() and not (blocks[:, 1:] == eos).any()
    # The batches a process draws alone (its share under several processes) are those of the whole draw.
    shares = {**draw_samples(model, n, 16, eos, 1.0, 5, batches=[0, 2], batch_size=BATCH),
              **draw_samples(model, n, 16, eos, 1.0, 5, batches=[1], batch_size=BATCH)}
    assert all(torch.equal(shares[i], every[i]) for i in range(3))
    other = draw_samples(model, n, 16, eos, temperature=1.0, seed=6, batch_size=BATCH)
    assert not torch.equal(other[0], every[0])
    assert len(set(map(tuple, blocks.tolist()))) == n  # T = 1 draws, not one row repeated


def finetune_argv(tiny_dir, out, samples_file, *extra):
    return ["--model", str(tiny_dir), "--method", "alibi:trainable=true", "--text-file", str(BOOK), "--text-fraction",
            "0:0.02", "--max-length", "32", "--max-steps", "4", "--lr", "1e-3", "--distill-from", "original",
            "--distill-alpha", "1", "--teacher-samples", "20", "--teacher-sample-batch", str(BATCH),
            "--teacher-samples-file", str(samples_file),
            "--output-dir", str(out), "--no-progress", *extra]


def digest(out):
    return json.loads((out / "training_args.json").read_text())["weights_sha256_per_process"][0]


@pytest.mark.parametrize("train_only,mode", [("positional", "unpatched view"), ("qkvo", "frozen copy")])
def test_the_command_trains_on_the_originals_samples_and_keeps_them(tiny_dir, tmp_path, train_only, mode):
    samples_file = tmp_path / "samples.pt"
    out = tmp_path / "ft"
    assert run_cli("finetune", [*finetune_argv(tiny_dir, out, samples_file), "--train-only", train_only]) == 0
    summary = json.loads((out / "training_args.json").read_text())
    assert summary["distillation"]["mode"] == mode
    assert summary["teacher_samples"]["blocks"] == 20 and summary["teacher_samples"]["read_from"] is None
    # Drawn from the model before the patch (not the ALiBi student), with the run's seed.
    model, tokenizer = original(tiny_dir)
    expected = draw_samples(model, 20, 32, tokenizer.eos_token_id, 1.0, seed=0, batch_size=BATCH)
    kept = torch.load(samples_file, weights_only=True)
    assert torch.equal(kept["blocks"], torch.cat([expected[i] for i in sorted(expected)]))
    patched = hf_posenc.patch_model(model, "alibi")
    student = draw_samples(patched, 20, 32, tokenizer.eos_token_id, 1.0, seed=0, batch_size=BATCH)
    assert not torch.equal(student[0], expected[0])
    # The text alone packs into fewer blocks: the samples were added to them.
    text_only = tmp_path / "text-only"
    argv = finetune_argv(tiny_dir, text_only, samples_file, "--train-only", train_only)
    cut = argv.index("--teacher-samples")
    assert run_cli("finetune", argv[:cut] + argv[cut + 6:]) == 0
    plain = json.loads((text_only / "training_args.json").read_text())
    assert summary["data"]["train_blocks"] == plain["data"]["train_blocks"] + 20
    assert plain["teacher_samples"] is None and digest(text_only) != digest(out)
    # A second run reads the kept samples instead of sampling, and trains the same weights.
    again = tmp_path / "again"
    assert run_cli("finetune", [*finetune_argv(tiny_dir, again, samples_file), "--train-only", train_only]) == 0
    assert json.loads((again / "training_args.json").read_text())["teacher_samples"]["read_from"] == str(samples_file)
    assert digest(again) == digest(out)


def test_a_resumed_run_reads_the_kept_samples_and_equals_the_straight_one(tiny_dir, tmp_path):
    samples_file = tmp_path / "samples.pt"
    common = ["--train-only", "qkvo"]
    assert run_cli("finetune", [*finetune_argv(tiny_dir, tmp_path / "straight", samples_file), *common]) == 0
    assert run_cli("finetune", [*finetune_argv(tiny_dir, tmp_path / "cut", samples_file), *common,
                                "--save-every", "2"]) == 0
    assert run_cli("finetune", [*finetune_argv(tiny_dir, tmp_path / "resumed", samples_file), *common,
                                "--resume-from", str(tmp_path / "cut-checkpoints" / "step-2")]) == 0
    assert digest(tmp_path / "resumed") == digest(tmp_path / "straight")


@pytest.mark.parametrize("change,message", [
    (["--teacher-sample-temperature", "0.5"], "temperature 1.0 (now 0.5)"),
    (["--seed", "3"], "seed 0 (now 3)"),
    (["--teacher-sample-top-k", "50"], "top_k 0 (now 50)"),
    (["--teacher-sample-batch", "5"], "batch 4 (now 5)")])
def test_kept_samples_made_otherwise_are_refused_and_nothing_written(tiny_dir, tmp_path, capsys, change, message):
    samples_file = tmp_path / "samples.pt"
    assert run_cli("finetune", finetune_argv(tiny_dir, tmp_path / "first", samples_file)) == 0
    before = samples_file.read_bytes()
    capsys.readouterr()
    assert run_cli("finetune", [*finetune_argv(tiny_dir, tmp_path / "second", samples_file), *change]) == 2
    err = capsys.readouterr().err
    assert "holds samples made with other settings" in err and message in err and "remove it" in err
    assert not (tmp_path / "second").exists() and samples_file.read_bytes() == before


@pytest.mark.parametrize("edit,message", [
    (lambda a: [x for i, x in enumerate(a) if a[i - 1:i + 1] != ["--distill-from", "original"]
                and x != "--distill-from"], "add --distill-from original"),
    (lambda a: [*a, "--teacher-sample-temperature", "0"], "--teacher-sample-temperature must be"),
    (lambda a: [*a, "--teacher-sample-top-k", "-1"], "--teacher-sample-top-k must be"),
    (lambda a: [*a, "--teacher-sample-batch", "0"], "--teacher-sample-batch must be"),
    (lambda a: [*a, "--teacher-samples", "0"], "--teacher-samples-file keeps the blocks of --teacher-samples"),
    (lambda a: [*a, "--max-length", "128"], "longer than the teacher's window (64)"),
    (lambda a: [*a[:a.index("--teacher-samples-file") + 1], "NOT-A-SAMPLES-FILE",
                *a[a.index("--teacher-samples-file") + 2:]], "not a samples file written by --teacher-samples"),
], ids=["no-teacher", "temperature", "top-k", "batch", "file-without-samples", "past-window", "foreign-file"])
def test_bad_sample_settings_are_refused_with_the_fix(tiny_dir, tmp_path, capsys, edit, message):
    (tmp_path / "NOT-A-SAMPLES-FILE").write_text("some text")
    argv = edit(finetune_argv(tiny_dir, tmp_path / "ft", tmp_path / "samples.pt"))
    argv = [str(tmp_path / x) if x == "NOT-A-SAMPLES-FILE" else x for x in argv]
    assert run_cli("finetune", argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "ft").exists() and not (tmp_path / "samples.pt").exists()


def test_two_processes_draw_their_shares_and_gather_the_same_samples(tiny_dir, tmp_path):
    """Each process draws every other batch; gathered, the blocks are those of one process, on both processes."""
    from tool_helpers import launch

    samples_file = tmp_path / "samples.pt"
    out = tmp_path / "ft"
    argv = [*finetune_argv(tiny_dir, out, samples_file), "--teacher-samples", str(2 * BATCH + 5),
            "--train-only", "positional", "--threads", "1"]
    done = launch("finetune", argv)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "training_args.json").read_text())
    assert summary["num_processes"] == 2 and summary["teacher_samples"]["blocks"] == 2 * BATCH + 5
    digests = summary["weights_sha256_per_process"]
    assert len(digests) == 2 and digests[0] == digests[1]
    model, tokenizer = original(tiny_dir)
    expected = draw_samples(model, 2 * BATCH + 5, 32, tokenizer.eos_token_id, 1.0, seed=0, batch_size=BATCH)
    kept = torch.load(samples_file, weights_only=True)["blocks"]
    assert torch.equal(kept, torch.cat([expected[i] for i in sorted(expected)]))
