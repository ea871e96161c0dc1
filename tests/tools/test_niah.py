"""Needle in a haystack (hf-posenc niah): the prompt, both scorers against hand computations, outputs, processes."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from tool_helpers import BOOK, byte_tokenizer, launch, run_cli, save_tiny_model

from hf_posenc.tools import niah

pytestmark = pytest.mark.skipif(not BOOK.is_file(), reason="../shared/data is not there")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def haystack(tok):
    return tok(BOOK.read_text(encoding="utf-8")[:30000])["input_ids"]


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_prompt_has_exact_length_and_the_needle_at_its_depth(tok, haystack, depth):
    needle = niah.Needle("oslo", 4821337, depth)
    ids = niah.build_prompt(tok, 3000, haystack, [needle], needle, start=100)
    assert len(ids) == 3000
    text = tok.decode(ids)
    assert text.startswith(niah.TASK) and text.endswith(niah.question("oslo"))
    line = "\n" + niah.fact("oslo", 4821337) + "\n"
    assert text.count("4821337") == 1
    filler_start = len(niah.TASK) + 1
    filler = len(text) - filler_start - len(line) - len("\n" + niah.question("oslo"))
    assert abs((text.index(line) - filler_start) / filler - depth) < 0.01  # bytes = tokens here
    assert tok.decode(haystack[100:140]) in text  # the haystack is the real text from the given start


def test_several_needles_and_distractors(tok, haystack):
    asked, others = niah.plan_needles(0.2, 3, 2, random.Random(1))
    assert [round(n.depth, 4) for n in asked] == [0.2, round(0.2 + 0.8 / 3, 4), round(0.2 + 1.6 / 3, 4)]
    assert len({n.key for n in asked + others}) == 5 and all(1_000_000 <= n.value <= 9_999_999 for n in asked)
    for needle in asked:
        ids = niah.build_prompt(tok, 2000, haystack, asked + others, needle)
        text = tok.decode(ids)
        assert len(ids) == 2000 and text.endswith(niah.question(needle.key))
        assert all(niah.fact(n.key, n.value) in text for n in asked + others)
        # every fact at its own depth of the haystack, in tokens: its offset less the task line and the facts before
        lines = {n: tok("\n" + niah.fact(n.key, n.value) + "\n")["input_ids"] for n in asked + others}
        head = len(tok(niah.TASK + "\n")["input_ids"])
        tail = len(tok("\n" + niah.question(needle.key))["input_ids"])
        n_filler = len(ids) - head - tail - sum(map(len, lines.values()))
        for n, line in lines.items():
            at = next(i for i in range(len(ids)) if ids[i : i + len(line)] == line)
            before = sum(len(lines[m]) for m in lines if m.depth < n.depth)
            assert at - head - before == round(n.depth * n_filler)
    with pytest.raises(ValueError, match="too short"):
        niah.build_prompt(tok, 100, haystack, asked + others, asked[0])
    with pytest.raises(ValueError, match="haystack text has"):
        niah.build_prompt(tok, 40000, haystack, asked, asked[0])


def test_the_log_probability_scorer_equals_a_hand_computation(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt, answer = torch.tensor([[5, 9, 13, 21, 8]]), [40, 41, 17]
    with torch.no_grad():
        got = niah.answer_logprob(model, prompt, answer)
        total = 0.0
        for i, token in enumerate(answer):  # one forward per answer token, each from its own prefix
            ids = torch.cat([prompt, torch.tensor([answer[:i]], dtype=torch.long)], dim=1)
            total += torch.log_softmax(model(ids).logits[0, -1].double(), dim=-1)[token].item()
    assert math.isclose(got, total / len(answer), rel_tol=1e-5)


def test_exact_match_scoring_and_table():
    assert niah.first_number(" 4821337.") == 4821337 and niah.first_number(" none") is None
    questions = [niah.Question("m", "none", 100, 0.5, t, "oslo", 1, 0.5, "", ok, lp)
                 for t, (ok, lp) in enumerate([(True, -1.0), (False, -3.0)])]
    assert niah.score_table(questions) == {("m", 100, 0.5): {"exact": 0.5, "logprob": -2.0, "questions": 2}}


def _argv(model_dir, out, *extra):
    return ["--model", str(model_dir), "--method", "none", "--method", "alibi", "--lengths", "500,600", "--depths",
            "0,1", "--trials", "1", "--needles", "2", "--distractors", "1", "--max-new-tokens", "2",
            "--haystack-file", str(BOOK), "--output-dir", str(out), "--no-progress", *extra]


def test_end_to_end_outputs_and_two_processes_equal_one(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny")
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_cli("niah", _argv(model_dir, one)) == 0
    rows = (one / "niah.csv").read_text().splitlines()
    assert rows[0] == "model,length,depth,exact,logprob,questions" and len(rows) == 1 + 2 * 2 * 2
    data = json.loads((one / "niah.json").read_text())
    assert len(data["questions"]) == 2 * 2 * 2 * 2  # methods x lengths x depths x needles
    assert all(math.isfinite(q["logprob"]) and q["logprob"] < 0 for q in data["questions"])
    # methods are compared on the same prompts
    assert len({(q["length"], q["depth"], q["key"], q["value"]) for q in data["questions"]}) == 8
    assert (one / "niah.png").stat().st_size > 1000
    result = launch("niah", _argv(model_dir, two))
    assert result.returncode == 0, result.stderr[-3000:]
    parallel = json.loads((two / "niah.json").read_text())
    for a, b in zip(data["questions"], parallel["questions"]):
        assert a["answer"] == b["answer"] and a["key"] == b["key"] and math.isclose(a["logprob"], b["logprob"],
                                                                                      abs_tol=1e-4)


def test_bad_input_is_one_line(tmp_path, capsys):
    model_dir = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "bad"
    for bad, message in ((["--depths", "1.5"], "--depths must lie in [0, 1]"),
                         (["--needles", "0"], "--needles must be an integer >= 1, got 0"),
                         (["--needles", "20", "--distractors", "10"], "at most 24 facts fit in one prompt"),
                         (["--lengths", "300"], "length 300 is too short"),
                         (["--haystack-file", str(tmp_path)], f"{tmp_path} is a folder, not a text file")):
        assert run_cli("niah", [*_argv(model_dir, out), *bad]) == 2
        err = capsys.readouterr().err
        assert err.rstrip().splitlines()[-1].startswith("error: ") and message in err and "Traceback" not in err, err
        assert not out.exists()


def test_each_method_on_a_patched_checkpoint_keeps_its_patch_for_none(tmp_path):
    """runtime.each_method, shared by passkey, niah and lm-eval: on a patched checkpoint a method replaces its patch
    (and says which), and 'none' after it is the checkpoint as trained, on a fresh copy."""
    import hf_posenc
    from hf_posenc.tools.models import load_model
    from hf_posenc.tools.runtime import MethodRequest, each_method

    model, _ = load_model(str(save_tiny_model(tmp_path / "tiny")), verbose=False)
    hf_posenc.patch_model(model, "kerple").save_pretrained(tmp_path / "kerple-ft")
    loaded = hf_posenc.from_pretrained(tmp_path / "kerple-ft")
    requests = [MethodRequest.parse("alibi"), MethodRequest.parse("none")]
    seen = [(request.name, type(hf_posenc.get_posenc_config(m)).__name__, replaced, m is loaded)
            for request, m, replaced in each_method(loaded, requests, lambda: hf_posenc.from_pretrained(
                tmp_path / "kerple-ft"))]
    assert seen == [("alibi", "AlibiConfig", "kerple", True), ("none", "KerpleConfig", "", False)]
    plain = load_model(str(tmp_path / "tiny"), verbose=False)[0]
    seen = [(hf_posenc.get_posenc_config(m) is not None, replaced) for _, m, replaced in each_method(
        plain, requests, lambda: pytest.fail("an unpatched model is never reloaded"))]
    assert seen == [(True, ""), (False, "")] and hf_posenc.get_posenc_config(plain) is None
