"""Perplexity vs length (hf-posenc eval-ppl and its engine, hf_posenc.tools.perplexity): hand computation,
2 processes == 1, outputs, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from tool_helpers import BOOK, DATA, WIKI, assert_failed_cleanly, byte_tokenizer, launch, run_cli, save_tiny_model

from hf_posenc.evaluate import perplexity_at_length
from hf_posenc.tools.models import load_model
from hf_posenc.tools.text import load_documents, tokenize_documents

pytestmark = pytest.mark.skipif(not BOOK.is_file(), reason="../shared/data is not there")


def eval_ppl_main(argv: list[str]) -> int:
    return run_cli("eval-ppl", argv)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def hand_ppl(model, docs, length, stride, max_windows):
    """exp(mean NLL) over the tokens the protocol scores: each window's tokens past the previous window's end."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in docs:
            if ids.numel() < length:
                continue
            prev_end, n = 0, 0
            for start in range(0, ids.numel() - length + 1, stride):
                if max_windows is not None and n >= max_windows:
                    break
                window = ids[start : start + length]
                logp = torch.log_softmax(model(window[None]).logits[0].double(), -1)
                for j in range(max(1, prev_end - start), length):  # past the overlap only
                    total -= logp[j - 1, window[j]].item()
                    count += 1
                prev_end, n = start + length, n + 1
    return math.exp(total / count), count


@pytest.mark.parametrize("length, stride, max_windows", [(48, 16, 4), (40, 40, 3)])
def test_matches_hand_computation(tiny_dir, length, stride, max_windows):
    model, tok = load_model(str(tiny_dir), verbose=False)
    docs = tokenize_documents(tok, load_documents([str(BOOK), str(WIKI)]), 400)
    ppl, nll, n_scored, n_windows = perplexity_at_length(model, docs, length, stride, max_windows=max_windows,
                                                         progress=False)
    expected, count = hand_ppl(model, docs, length, stride, max_windows)
    assert n_scored == count and n_windows == 2 * max_windows
    assert ppl == pytest.approx(expected, rel=1e-5)
    # a batch of windows gives the same numbers as one window at a time
    ppl_batched = perplexity_at_length(model, docs, length, stride, max_windows, batch_size=3, progress=False).ppl
    assert ppl_batched == pytest.approx(ppl, rel=1e-5)


def _args(tiny_dir, out, *extra):
    return ["--model", str(tiny_dir), "--method", "none", "--method", "alibi", "--lengths", "32,64",
            "--text-file", str(BOOK), "--text-file", str(WIKI), "--max-windows", "3", "--sliding-window", "16",
            "--output-dir", str(out), "--no-progress", *extra]


@pytest.mark.parametrize("cpu_mpirun", [False, True], ids=["ddp.yaml", "--cpu with mpirun"])
def test_two_processes_equal_one(tiny_dir, tmp_path, cpu_mpirun):
    assert eval_ppl_main(_args(tiny_dir, tmp_path / "one")) == 0
    done = launch("eval-ppl", _args(tiny_dir, tmp_path / "two", "--threads", "1"), cpu_mpirun=cpu_mpirun)
    assert done.returncode == 0, done.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "perplexity.json").read_text())
    two = json.loads((tmp_path / "two" / "perplexity.json").read_text())
    assert two["settings"]["num_processes"] == 2 and one["settings"]["num_processes"] == 1
    assert len(one["results"]) == 4
    for a, b in zip(one["results"], two["results"]):
        assert (a["method"], a["length"], a["n_windows"], a["n_scored_tokens"]) == \
               (b["method"], b["length"], b["n_windows"], b["n_scored_tokens"])
        assert b["nll_sum"] == pytest.approx(a["nll_sum"], rel=1e-6)
    # the CSV: a row per model/method, a column per length
    lines = (tmp_path / "one" / "perplexity.csv").read_text().splitlines()
    assert lines[0] == "model,32,64"
    assert lines[1].startswith("tiny-llama,") and lines[2].startswith("tiny-llama + alibi,")
    assert (tmp_path / "one" / "perplexity.png").stat().st_size > 1000


@pytest.mark.parametrize("extra, message", [
    (["--lengths", "32,5000000"], "needs a document of at least 5000000 tokens"),
    (["--method", "yarn:factr=4"], "Unknown option(s) 'factr'"),
    (["--text-file", "/nonexistent/book.txt"], "no such file"),
    (["--lengths", "32", "--text-fraction", "0.5:0.2"], "START < END"),
    (["--length-step", "0"], "--length-step must be an integer >= 1, got 0"),
    (["--max-windows", "0"], "--max-windows must be an integer >= 1, got 0"),
    (["--threads", "0"], "--threads must be an integer >= 1, got 0"),
    (["--lengths", "", "--min-length", "64", "--max-length", "32"], "no length from --min-length 64 to --max-length"),
    (["--text-file", str(DATA)], "is a folder, not a text file"),
    (["--encoding", "rot13"], "--encoding 'rot13': 'rot13' is not a text encoding"),
])
def test_bad_input_fails_cleanly(tiny_dir, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    assert_failed_cleanly(eval_ppl_main(_args(tiny_dir, out, *extra)), capsys, message, out)


def test_text_files_that_do_not_read(tiny_dir, tmp_path, capsys):
    """A file in another encoding is named with the byte and the fix, and reads with --encoding; an empty file is
    named too."""
    latin = tmp_path / "cp1252.txt"
    latin.write_bytes(("\u201cCaf\u00e9\u201d, she said. " * 100).encode("cp1252"))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    out = tmp_path / "out"
    argv = ["--model", str(tiny_dir), "--lengths", "32", "--max-windows", "1", "--output-dir", str(out),
            "--no-progress"]
    assert_failed_cleanly(eval_ppl_main([*argv, "--text-file", str(latin)]), capsys,
                          f"{latin} is not valid utf-8 text (invalid start byte: byte 0x93 at offset 0, line 1); "
                          "pass --encoding with the file's encoding, e.g. --encoding cp1252", out)
    assert_failed_cleanly(eval_ppl_main([*argv, "--text-file", str(empty)]), capsys,
                          "the text is empty (no non-blank document in empty.txt)", out)
    assert eval_ppl_main([*argv, "--text-file", str(latin), "--encoding", "cp1252"]) == 0
    assert json.loads((out / "perplexity.json").read_text())["results"][0]["n_scored_tokens"] == 31


def test_memory_estimate_refuses(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("hf_posenc.tools.estimates.available_memory_bytes", lambda: 2**20)  # 1 MiB "available"
    assert eval_ppl_main(_args(tiny_dir, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "GiB of memory by estimate" in err and "0.0 GiB is available" in err
    assert not (tmp_path / "out").exists()


def test_unpatchable_model(tmp_path, capsys):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    directory = tmp_path / "neox"
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=257, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64)).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    assert eval_ppl_main(["--model", str(directory), "--method", "alibi", "--lengths", "32", "--text-file",
                          str(BOOK), "--max-windows", "1", "--output-dir", str(tmp_path / "out"),
                          "--no-progress"]) == 2
    assert "gpt_neox" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_min_document_tokens_counts_the_whole_document_before_the_window_cut(tiny_dir, tmp_path):
    """--min-document-tokens with --truncate / --max-windows (YaRN's "minimum length + truncate" protocol): the
    filter measures each document before it is cut to the tokens the windows reach (issue 19, item 2)."""
    from hf_posenc.tools import eval_ppl

    for extra in ({"truncate": True}, {"max_windows": 1}):
        run = eval_ppl.run_eval(eval_ppl.settings(
            model=[str(tiny_dir)], lengths=[32], min_document_tokens=2000, text_file=[str(BOOK)],
            no_progress=True, **extra))
        assert run.results[0].n_documents == 1 and run.results[0].n_windows == 1
    with pytest.raises(Exception, match="at least 10000000 tokens; the longest of 1 document"):
        eval_ppl.run_eval(eval_ppl.settings(model=[str(tiny_dir)], lengths=[32], min_document_tokens=10_000_000,
                                            text_file=[str(BOOK)], truncate=True, no_progress=True))


def test_rows_say_what_was_evaluated(tiny_dir, tmp_path):
    """A --method on a patched checkpoint replaces its trained patch: the row says so (not "kerple-ft + yarn");
    an untrained swap gets no training-length star; the checkpoint as trained and a RoPE scaling keep theirs
    (issue 19, items 1 and 10)."""
    import hf_posenc
    from hf_posenc.tools import eval_ppl

    finetuned = tmp_path / "kerple-ft"
    hf_posenc.patch_model(load_model(str(tiny_dir))[0], "kerple").save_pretrained(finetuned)
    load_model(str(tiny_dir))[1].save_pretrained(finetuned)
    common = dict(lengths=[32], max_windows=1, text_file=[str(BOOK)], no_progress=True)
    run = eval_ppl.run_eval(eval_ppl.settings(model=[str(finetuned)], method=["none", "yarn:factor=4"], **common))
    assert list(run.table()) == ["kerple-ft", "kerple-ft with its kerple replaced by yarn:factor=4"]
    run = eval_ppl.run_eval(eval_ppl.settings(model=[str(tiny_dir)], method=["none", "alibi", "yarn:factor=2"],
                                              **common))
    assert run.training_lengths == {"tiny-llama": 64, "tiny-llama + alibi": None, "tiny-llama + yarn:factor=2": 64}


def test_a_long_evaluation_is_announced_with_its_estimate(tiny_dir, tmp_path, capsys, monkeypatch):
    """Before the first window: the estimated run time, as a warning saying how to shorten it when it is long
    (a 4-hour evaluation started without a word; issue 19, item 10)."""
    argv = ["--model", str(tiny_dir), "--lengths", "32", "--max-windows", "1", "--text-file", str(BOOK),
            "--no-progress"]
    assert eval_ppl_main([*argv, "--output-dir", str(tmp_path / "short")]) == 0
    assert "this evaluation: about 0 min by estimate" in capsys.readouterr().err
    monkeypatch.setattr("hf_posenc.tools.eval_ppl.model_forward_seconds", lambda model, window: 3600.0)  # slow
    assert eval_ppl_main([*argv, "--output-dir", str(tmp_path / "long")]) == 0
    assert ("warning: this evaluation will take about 1.0 h by estimate (2 idle CPU cores; a loaded machine is "
            "slower); --max-windows N, --truncate or fewer --lengths shorten it") in capsys.readouterr().err


def test_plot_shows_perplexity_on_a_log_axis_and_stars_only_trained_rows():
    """Perplexity on a log axis (was log perplexity on a linear one); "trained at N" only where a length is known
    (an untrained swap has none; issue 19, item 10)."""
    from hf_posenc.tools import tables

    table = {"smollm2": {256: 30.0, 512: 25.0}, "smollm2 + kerple": {256: 180.0, 512: 190.0}}
    fig = tables.perplexity_figure([256, 512], {"text": (table, {"smollm2": 512, "smollm2 + kerple": None})})
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_ylabel().startswith("perplexity")
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["smollm2 (trained at 512)",
                                                                         "smollm2 + kerple"]
    assert list(ax.lines[0].get_ydata()) == [30.0, 25.0]  # the perplexity itself, not its log


def test_rename_model_renames_the_table_row():
    """main-job names the fine-tuned checkpoint's row (its folder is 'finetuned') after the swap: the table's row and
    the training length follow the new name."""
    from hf_posenc.tools.eval_ppl import EvalRun, LengthResult

    run = EvalRun(settings={}, training_lengths={"finetuned": 256, "smollm2 + alibi": None})
    run.results = [LengthResult("finetuned", "none", 64, 9.5, 0.0, 1, 1, 1, 64, 0.1, label="finetuned"),
                   LengthResult("smollm2", "alibi", 64, 20.0, 0.0, 1, 1, 1, 64, 0.1, label="smollm2 + alibi")]
    run.rename_model("finetuned", "kerple (fine-tuned)")
    assert run.table() == {"kerple (fine-tuned)": {64: 9.5}, "smollm2 + alibi": {64: 20.0}}
    assert run.training_lengths == {"kerple (fine-tuned)": 256, "smollm2 + alibi": None}


def test_a_hybrid_of_two_methods_is_evaluated_as_patched_by_hand(tiny_dir):
    """--method with parts joined by '+' (the main job's default swap): the row's perplexity is the one of the model
    patched part by part through the library."""
    import hf_posenc
    from hf_posenc.tools import eval_ppl

    hybrid = "kerple:layers=[1]+yarn:factor=2,layers=rest"
    run = eval_ppl.run_eval(eval_ppl.settings(model=[str(tiny_dir)], method=["none", hybrid], lengths=[32],
                                              max_windows=1, text_file=[str(BOOK)], no_progress=True))
    model, tokenizer = load_model(str(tiny_dir), verbose=False)
    hf_posenc.patch_model(model, "kerple", layers=[1])
    hf_posenc.patch_model(model, "yarn", factor=2, layers=[0])
    docs = tokenize_documents(tokenizer, load_documents([str(BOOK)]))
    expected = perplexity_at_length(model, docs, 32, 32, max_windows=1, progress=False)[0]
    rows = {r.method: r.ppl for r in run.results}
    assert rows[hybrid] == pytest.approx(expected, rel=1e-5) and rows[hybrid] != pytest.approx(rows["none"])


# --- a fine-tune's resumable checkpoints as models, and the curve along a run ------------------------------------
def _finetune(tiny_dir, out, steps, *extra):
    argv = ["--model", str(tiny_dir), "--method", "t5:per_layer=true", "--train-only", "all", "--text-file",
            str(BOOK), "--text-fraction", "0:0.8", "--max-length", "64", "--lr", "3e-3", "--lr-scheduler",
            "constant", "--warmup-steps", "0", "--max-steps", str(steps), "--output-dir", str(out), "--no-progress",
            "--threads", "1", *extra]
    assert run_cli("finetune", argv) == 0


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """A 3-step run with a checkpoint after steps 1 and 2, and a 1-step run of the same settings (a constant rate:
    its step 1 is the longer run's). GPT-2 ties its output layer to its embedding, as SmolLM2 does: the checkpoint
    holds that weight once."""
    root = tmp_path_factory.mktemp("curve")
    model_dir = save_tiny_model(root / "tiny-gpt2", "gpt2")
    _finetune(model_dir, root / "run", 3, "--save-every", "1", "--save-total-limit", "5")
    _finetune(model_dir, root / "one-step", 1)
    return root


def test_a_training_checkpoint_loads_as_its_run_stood_at_that_step(three_steps):
    """`--model RUN-checkpoints/step-1`: the run's model and method with the weights of step 1, the logits of a run
    that stopped there (was: "has no config.json (not a transformers checkpoint)")."""
    from hf_posenc import get_posenc_config
    from hf_posenc.tools.models import model_name

    step1 = three_steps / "run-checkpoints" / "step-1"
    loaded, tokenizer = load_model(str(step1))
    stopped, _ = load_model(str(three_steps / "one-step"))
    ended, _ = load_model(str(three_steps / "run"))
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = loaded(ids).logits
        assert torch.equal(logits, stopped(ids).logits)
        assert not torch.allclose(logits, ended(ids).logits)  # step 3's weights are others
    assert get_posenc_config(loaded).method == "t5" and get_posenc_config(loaded).per_layer
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied
    assert "lm_head.weight" not in load_file(step1 / "model.safetensors")  # saved once
    assert tokenizer is not None and model_name(str(step1)) == "run-checkpoints/step-1"


def test_points_of_a_run_give_the_curve_against_tokens(three_steps, tmp_path):
    from hf_posenc.tools import eval_ppl, tables

    run_dir = three_steps / "run"
    models = [str(run_dir), *(str(three_steps / "run-checkpoints" / f"step-{n}") for n in (2, 1)),
              str(three_steps / "one-step")]  # another run, of one point
    out = tmp_path / "curve"
    assert eval_ppl_main([*(a for m in models for a in ("--model", m)), "--lengths", "32,64", "--text-file",
                          str(BOOK), "--text-fraction", "0.8:1", "--max-windows", "2", "--non-overlapping",
                          "--output-dir", str(out), "--no-progress"]) == 0
    saved = json.loads((out / "perplexity.json").read_text())
    assert {label: (p["step"], p["tokens"], p["run"]) for label, p in saved["training_points"].items()} == {
        "run": (3, 192, "run"), "run-checkpoints/step-2": (2, 128, "run"), "run-checkpoints/step-1": (1, 64, "run"),
        "one-step": (1, 64, "one-step")}
    assert saved["training_lengths"]["run-checkpoints/step-1"] == 64  # the run's --max-length
    rows = (out / "training_curve.csv").read_text().splitlines()
    assert rows[0] == "run,model,step,tokens,32,64"
    assert [row.split(",")[:4] for row in rows[1:]] == [
        ["run", "run-checkpoints/step-1", "1", "64"], ["run", "run-checkpoints/step-2", "2", "128"],
        ["run", "run", "3", "192"], ["one-step", "one-step", "1", "64"]]
    for row in rows[1:]:
        label, *_, at32, at64 = row.split(",")[1:]
        assert float(at64) == pytest.approx(saved["table"][label]["64"], abs=1e-4)
    assert (out / "training_curve.png").stat().st_size > 1000
    table = {label: {int(n): v for n, v in row.items()} for label, row in saved["table"].items()}
    ax = tables.training_curve_figure([32, 64], table, saved["training_points"]).axes[0]
    assert [list(line.get_xdata()) for line in ax.lines] == [[64, 128, 192]] * 2  # the one-point run is no line
    one = eval_ppl.run_eval(eval_ppl.settings(model=[str(run_dir), str(three_steps / "one-step")], lengths=[32],
                                              max_windows=1, text_file=[str(BOOK)], no_progress=True))
    assert len(one.training_points) == 2 and not tables.has_training_curve(one.training_points)  # two runs, a point each


def test_curve_plot_has_a_line_per_run_and_length_against_tokens():
    from hf_posenc.tools import tables

    table = {"a": {512: 40.0, 2048: 50.0}, "b": {512: 30.0, 2048: 31.0}, "c": {512: 60.0, 2048: 70.0},
             "d": {512: 55.0, 2048: 65.0}}
    points = {"b": {"step": 40, "tokens": 20480, "run": "x", "checkpoint_dir": "/r/x-checkpoints"},
              "a": {"step": 20, "tokens": 10240, "run": "x", "checkpoint_dir": "/r/x-checkpoints"}}
    ax = tables.training_curve_figure([512, 2048], table, points).axes[0]
    assert [list(line.get_xdata()) for line in ax.lines] == [[10240, 20480]] * 2
    assert [list(line.get_ydata()) for line in ax.lines] == [[40.0, 30.0], [50.0, 31.0]]
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "tokens trained on"
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["at 512 tokens of context",
                                                                         "at 2048 tokens of context"]
    points.update(c={"step": 10, "tokens": 5120, "run": "y", "checkpoint_dir": "/r/y-checkpoints"},
                  d={"step": 20, "tokens": 10240, "run": "y", "checkpoint_dir": "/r/y-checkpoints"})
    ax = tables.training_curve_figure([512, 2048], table, points).axes[0]
    assert [text.get_text() for text in ax.get_legend().get_texts()] == [
        "x, at 512 tokens of context", "x, at 2048 tokens of context", "y, at 512 tokens of context",
        "y, at 2048 tokens of context"]
    assert list(ax.lines[2].get_ydata()) == [60.0, 55.0]


def test_training_checkpoints_that_cannot_be_evaluated_are_refused(three_steps, tmp_path, capsys):
    import shutil

    def refused(folder, message):
        out = tmp_path / "out"
        assert_failed_cleanly(eval_ppl_main(["--model", str(folder), "--lengths", "32", "--max-windows", "1",
                                             "--text-file", str(BOOK), "--output-dir", str(out), "--no-progress"]),
                              capsys, message, out)

    cut = tmp_path / "cut-checkpoints" / "step-1"
    shutil.copytree(three_steps / "run-checkpoints" / "step-1", cut)
    with open(cut / "model.safetensors", "r+b") as handle:
        handle.truncate(100)
    refused(cut, "a training checkpoint that is not complete (its model.safetensors has 100 of its")
    old = tmp_path / "old-checkpoints" / "step-1"
    shutil.copytree(three_steps / "run-checkpoints" / "step-1", old)
    state = json.loads((old / "trainer_state.json").read_text())
    (old / "trainer_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "settings"}))
    refused(old, "records no settings (saved by an older version): resume the run from it")
    lora = tmp_path / "lora-checkpoints" / "step-1"
    shutil.copytree(three_steps / "run-checkpoints" / "step-1", lora)
    (lora / "trainer_state.json").write_text(json.dumps({**state, "settings": {**state["settings"],
                                                                             "train_only": "lora"}}))
    refused(lora, "holds LoRA adapters inside the model's layers: evaluate the run's output folder")


@pytest.mark.parametrize("text", ["t5:per_layer=true,num_buckets=64", "yarn:factor=4",
                                  "kerple:layers=last:2+yarn:factor=2,layers=rest"])
def test_a_method_request_comes_back_from_its_recorded_settings(text):
    from hf_posenc.tools.runtime import MethodRequest

    recorded = MethodRequest.parse(text).settings()
    assert MethodRequest.from_settings(json.loads(json.dumps(recorded))).settings() == recorded
