"""Short-context regression through lm-eval (hf-posenc lm-eval): the patched model object is what lm-eval scores,
checked against a hand computation on a local task (no Hub)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tool_helpers import BOOK, launch, run_cli, save_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_posenc
from hf_posenc.tools import lm_eval_run
from hf_posenc.tools.runtime import UsageError

pytestmark = pytest.mark.skipif(not BOOK.is_file(), reason="../shared/data is not there")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = save_tiny_model(tmp_path_factory.mktemp("lm-eval") / "tiny")
    return directory, AutoTokenizer.from_pretrained(directory)


def hand_scores(model, tokenizer, docs):
    """acc and acc_norm as lm-eval defines them: the choice with the highest log-likelihood of " " + choice after
    the context (acc_norm: divided by the choice's length in characters)."""
    acc = acc_norm = 0
    every_score = []
    for doc in docs:
        context = tokenizer(doc["context"])["input_ids"]
        scores = []
        for choice in doc["choices"]:
            continuation = tokenizer(" " + choice)["input_ids"]
            ids = torch.tensor([context + continuation])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0, len(context) - 1 : -1].double(), dim=-1)
            scores.append(logprobs.gather(1, torch.tensor(continuation)[:, None]).sum().item())
        every_score += scores
        acc += max(range(len(scores)), key=scores.__getitem__) == doc["label"]
        normed = [s / len(" " + c) for s, c in zip(scores, doc["choices"])]
        acc_norm += max(range(len(normed)), key=normed.__getitem__) == doc["label"]
    return acc / len(docs), acc_norm / len(docs), every_score


def test_cloze_documents_from_real_text():
    docs = lm_eval_run.cloze_documents(BOOK.read_text(encoding="utf-8"), 30, seed=1)
    text = " ".join(BOOK.read_text(encoding="utf-8").split())
    assert len(docs) == 30 and len({d["context"] for d in docs}) == 30
    for doc in docs:
        assert len(doc["choices"]) == lm_eval_run.CLOZE_CHOICES and len(set(doc["choices"])) == 4
        assert doc["context"] + " " + doc["choices"][doc["label"]] in text  # the real next sentence
    assert {d["label"] for d in docs} != {0}  # shuffled
    with pytest.raises(ValueError, match="usable sentences; 5 cloze documents need"):
        lm_eval_run.cloze_documents("Too short a text to build anything from.", 5)


def test_lm_eval_scores_the_patched_model_as_a_hand_computation(tiny, tmp_path):
    directory, tokenizer = tiny
    task_dir = lm_eval_run.build_cloze_task(BOOK.read_text(encoding="utf-8"), tmp_path / "tasks", n_docs=12,
                                            context_sentences=1, max_words=14)
    docs = [json.loads(line) for line in (task_dir / "cloze.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(directory)
    *_, native_scores = hand_scores(model, tokenizer, docs)
    hf_posenc.patch_model(model, "alibi")
    acc, acc_norm, patched_scores = hand_scores(model, tokenizer, docs)
    assert patched_scores != pytest.approx(native_scores, abs=1e-3)  # the patch changes what is scored
    manager = lm_eval_run.task_manager(["cloze"], task_dir, defaults=False)
    results = lm_eval_run.evaluate_model(model, tokenizer, ["cloze"], task_dir, max_length=512,
                                         manager=manager)["cloze"]
    assert results["acc,none"] == pytest.approx(acc) and results["acc_norm,none"] == pytest.approx(acc_norm)
    rows = lm_eval_run.metric_rows("tiny + alibi", {"cloze": results})
    assert {r["metric"]: r["value"] for r in rows} == {"acc": pytest.approx(acc), "acc_norm": pytest.approx(acc_norm)}


def test_task_index_holds_lm_evals_own_tasks_unless_only_ours_are_asked_for(tmp_path):
    task_dir = lm_eval_run.build_cloze_task(BOOK.read_text(encoding="utf-8"), tmp_path / "tasks", n_docs=4)
    assert lm_eval_run.task_manager(["cloze"], task_dir, defaults=False).all_tasks == ["cloze"]
    with pytest.raises(UsageError, match="lm-eval knows no task 'hellaswag'"):
        lm_eval_run.task_manager(["hellaswag"], task_dir, defaults=False)
    # with lm-eval's own tasks indexed (hellaswag known, no_such_task not): test_command_outputs_and_bad_input


def test_command_outputs_and_bad_input(tiny, tmp_path, capsys):
    directory, _ = tiny
    out = tmp_path / "out"
    argv = ["--model", str(directory), "--method", "none", "--method", "alibi", "--tasks", "cloze", "--cloze-file",
            str(BOOK), "--cloze-documents", "4", "--max-length", "1024", "--output-dir", str(out)]
    assert run_cli("lm-eval", argv) == 0
    rows = (out / "lm_eval.csv").read_text().splitlines()
    assert rows[0] == "model,task,metric,value,stderr" and len(rows) == 1 + 2 * 2
    data = json.loads((out / "lm_eval.json").read_text())
    assert set(data["results"]) == {"tiny", "tiny + alibi"}
    assert (out / "lm_eval.png").stat().st_size > 1000
    capsys.readouterr()
    bad = tmp_path / "bad"
    for extra, message in ((["--tasks", "hellaswag,no_such_task"], "lm-eval knows no task 'no_such_task';"),
                           (["--include-path", str(tmp_path / "nowhere")], "is not a folder"),
                           (["--limit", "0"], "--limit must be an integer >= 1, got 0"),
                           (["--max-length", "16"], "and lm-eval takes inputs of at most 16; pass --max-length")):
        assert run_cli("lm-eval", [*argv[:-1], str(bad), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err.rstrip().splitlines()[-1] and "Traceback" not in err, err
        assert not bad.exists()


def test_two_processes_score_what_one_does(tiny, tmp_path):
    """Under accelerate launch the processes split each task's requests (5 documents x 4 choices: unequal shares)
    and lm-eval gathers them: the same scores as one process."""
    directory, _ = tiny
    argv = ["--model", str(directory), "--method", "alibi", "--tasks", "cloze", "--cloze-file", str(BOOK),
            "--cloze-documents", "5", "--max-length", "1024"]
    assert run_cli("lm-eval", [*argv, "--output-dir", str(tmp_path / "one")]) == 0
    done = launch("lm-eval", [*argv, "--output-dir", str(tmp_path / "two")])
    assert done.returncode == 0, done.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "lm_eval.json").read_text())
    two = json.loads((tmp_path / "two" / "lm_eval.json").read_text())
    assert (one["settings"]["num_processes"], two["settings"]["num_processes"]) == (1, 2)
    assert len(one["rows"]) == 2
    for a, b in zip(one["rows"], two["rows"]):
        assert (a["model"], a["metric"], a["value"]) == (b["model"], b["metric"], b["value"])
        assert a["stderr"] == pytest.approx(b["stderr"])  # summed in another order
    # the main process (the one lm-eval shows progress for) scored 3 documents' 12 requests of the 20, not all (tqdm
    # may draw its finished bar twice, on the last update and on close, when the machine is busy)
    totals = re.findall(r"Running loglikelihood requests: 100%.*?\| *\d+/(\d+)", done.stderr)
    assert totals and set(totals) == {"12"}, totals
