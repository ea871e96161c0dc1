"""Passkey retrieval (hf-posenc passkey): the prompt, scoring, outputs."""

from __future__ import annotations

import json
import random

import pytest
from tool_helpers import BOOK, byte_tokenizer, launch, run_cli, save_tiny_model

from hf_posenc.tools import passkey


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_has_exact_length_and_depth(tok, depth):
    ids = passkey.build_prompt(tok, 1000, depth, 54321)
    assert len(ids) == 1000
    text = tok.decode(ids)
    assert text.startswith(passkey.TASK) and text.endswith(passkey.QUESTION)
    assert text.count("54321") == 2
    position = text.index(passkey.info_line(54321))
    body = len(text) - len(passkey.TASK) - len(passkey.QUESTION) - len(passkey.info_line(54321))
    assert abs((position - len(passkey.TASK)) / body - depth) < 0.02


def test_prompt_with_real_filler(tok):
    filler = tok(BOOK.read_text(encoding="utf-8")[:20000])["input_ids"]
    ids = passkey.build_prompt(tok, 2000, 0.25, 12345, filler, random.Random(0))
    text = tok.decode(ids)
    assert len(ids) == 2000 and passkey.GARBAGE not in text and passkey.info_line(12345) in text
    with pytest.raises(ValueError, match="filler text has"):
        passkey.build_prompt(tok, 40000, 0.25, 12345, filler)
    with pytest.raises(ValueError, match="too short"):
        passkey.build_prompt(tok, 50, 0.5, 12345)


def test_answer_scoring_and_table():
    assert passkey.answer_is(" 12345. Remember", 12345)
    assert not passkey.answer_is(" 1234", 12345) and not passkey.answer_is(" the key", 12345)
    trials = [passkey.Trial("m", "none", 100, 0.5, t, 11111, "", ok) for t, ok in enumerate([True, False, True, True])]
    assert passkey.accuracy_table(trials) == {("m", 100, 0.5): (0.75, 4)}


def test_end_to_end_outputs(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "pk"
    argv = ["--model", str(model_dir), "--method", "none", "--method", "alibi", "--lengths", "300,400",
            "--depths", "0,1", "--trials", "2", "--max-new-tokens", "3", "--output-dir", str(out), "--no-progress"]
    assert run_cli("passkey", argv) == 0
    rows = (out / "passkey.csv").read_text().splitlines()
    assert rows[0] == "model,length,depth,accuracy,trials" and len(rows) == 1 + 2 * 2 * 2
    data = json.loads((out / "passkey.json").read_text())
    assert len(data["trials"]) == 16 and all(len(str(t["passkey"])) == 5 for t in data["trials"])
    # the same (length, depth, trial) gets the same passkey for every method: methods are compared on equal prompts
    keys = {(t["length"], t["depth"], t["trial"], t["passkey"]) for t in data["trials"]}
    assert len(keys) == 8
    assert (out / "passkey.png").stat().st_size > 1000
    assert run_cli("passkey", [*argv[:-3], "--depths", "1.5", "--output-dir", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()


def test_bad_input_is_one_line(tmp_path, capsys):
    model_dir = save_tiny_model(tmp_path / "tiny")
    latin = tmp_path / "filler.txt"
    latin.write_bytes("na\u00efve filler ".encode("latin-1") * 500)
    argv = ["--model", str(model_dir), "--lengths", "300", "--depths", "0", "--trials", "1", "--max-new-tokens", "2",
            "--output-dir", str(tmp_path / "bad"), "--no-progress"]
    for bad, message in ((["--lengths", "nan"], "--lengths 'nan' must be whole numbers separated by commas"),
                         (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
                         (["--filler-file", str(latin)], f"{latin} is not valid utf-8 text"),
                         (["--filler-file", str(tmp_path)], f"{tmp_path} is a folder, not a text file")):
        assert run_cli("passkey", [*argv, *bad]) == 2
        err = capsys.readouterr().err
        assert err.rstrip().splitlines()[-1].startswith(f"error: {message}") and "Traceback" not in err, err
        assert not (tmp_path / "bad").exists()
    assert run_cli("passkey", [*argv, "--filler-file", str(latin), "--encoding", "latin-1"]) == 0


def test_two_processes_give_the_trials_of_one(tmp_path):
    """`accelerate launch` splits the (length, depth, trial) prompts across processes and gathers them in order:
    an odd number of prompts, so the processes get unequal shares."""
    model_dir = save_tiny_model(tmp_path / "tiny")
    argv = ["--model", str(model_dir), "--method", "alibi", "--lengths", "300", "--depths", "0,0.5,1",
            "--trials", "1", "--max-new-tokens", "3", "--no-progress"]
    assert run_cli("passkey", [*argv, "--output-dir", str(tmp_path / "one")]) == 0
    done = launch("passkey", [*argv, "--output-dir", str(tmp_path / "two")])
    assert done.returncode == 0, done.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "passkey.json").read_text())
    two = json.loads((tmp_path / "two" / "passkey.json").read_text())
    assert two["settings"]["num_processes"] == 2 and one["settings"]["num_processes"] == 1
    assert two["trials"] == one["trials"] and len(one["trials"]) == 3



def test_hard_variant_several_doors_one_asked(tok):
    rng = random.Random(3)
    passkey_value, door, distractors = passkey.plan_keys(rng, 4, 7)
    assert 10**6 <= passkey_value < 10**7 and len(distractors) == 3
    assert len({door, *(d.door for d in distractors)}) == 4 and all(10**6 <= d.passkey < 10**7 for d in distractors)
    ids = passkey.build_prompt(tok, 1500, 0.25, passkey_value, None, rng, door, distractors)
    text = tok.decode(ids)
    assert len(ids) == 1500 and text.endswith(passkey.question(door))
    assert all(passkey.info_line(d.passkey, d.door) in text for d in distractors)
    asked = text.index(passkey.info_line(passkey_value, door))
    doors = [(passkey_value, door)] + [(d.passkey, d.door) for d in distractors]
    body = len(text) - len(passkey.TASK) - len(passkey.question(door)) - sum(
        len(passkey.info_line(k, n)) + 2 for k, n in doors)
    earlier = sum(len(passkey.info_line(d.passkey, d.door)) + 2 for d in distractors if d.depth < 0.25)
    assert abs((asked - len(passkey.TASK) - 2 - earlier) / body - 0.25) < 0.01
    # a single 5-digit key draws exactly what the original prompt drew: earlier results stay comparable
    assert passkey.plan_keys(random.Random("0-100-0.5-0"), 1, 5) == (random.Random("0-100-0.5-0").randint(10000, 99999),
                                                                  None, ())


def test_hard_variant_end_to_end(tmp_path, capsys):
    model_dir = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "hard"
    argv = ["--model", str(model_dir), "--lengths", "600", "--depths", "0.5", "--trials", "2", "--keys", "3",
            "--key-digits", "6", "--max-new-tokens", "3", "--output-dir", str(out), "--no-progress"]
    assert run_cli("passkey", argv) == 0
    data = json.loads((out / "passkey.json").read_text())
    assert all(len(str(t["passkey"])) == 6 and t["door"] is not None for t in data["trials"])
    assert data["settings"]["keys"] == 3
    for bad, message in ((["--keys", "0"], "--keys must be an integer >= 1, got 0"),
                         (["--keys", "99"], "at most 98 doors"),
                         (["--lengths", "200"], "length 200 is too short")):
        assert run_cli("passkey", [*argv[:-3], "--output-dir", str(tmp_path / "bad"), "--no-progress", *bad]) == 2
        err = capsys.readouterr().err
        assert message in err.rstrip().splitlines()[-1] and "Traceback" not in err, err
        assert not (tmp_path / "bad").exists()


def test_a_patched_checkpoint_keeps_its_patch_for_every_method(tmp_path, monkeypatch):
    """On a fine-tuned patched checkpoint, a --method replaces its patch (the row says so) and --method none after
    it still evaluates the checkpoint as trained: it was the base model, unpatched by the method before it and
    labelled as the checkpoint (issue 19, item 1)."""
    import hf_posenc
    from hf_posenc.tools.models import load_model

    model, tokenizer = load_model(str(save_tiny_model(tmp_path / "tiny")), verbose=False)
    hf_posenc.patch_model(model, "kerple").save_pretrained(tmp_path / "kerple-ft")
    tokenizer.save_pretrained(tmp_path / "kerple-ft")
    seen = []
    real_run_trials = passkey.run_trials

    def run_trials(model, *args, **kwargs):
        config = hf_posenc.get_posenc_config(model)
        seen.append(config.method if config else None)
        return real_run_trials(model, *args, **kwargs)

    monkeypatch.setattr(passkey, "run_trials", run_trials)
    args = passkey.build_parser().parse_args(
        ["--model", str(tmp_path / "kerple-ft"), "--method", "yarn:factor=2", "--method", "none", "--lengths", "300",
         "--depths", "0", "--trials", "1", "--max-new-tokens", "2", "--no-progress"])
    trials, *_ = passkey.run_passkey(args)
    assert seen == ["yarn", "kerple"]
    assert [key[0] for key in passkey.accuracy_table(trials)] == ["kerple-ft with its kerple replaced by yarn:factor=2",
                                                                  "kerple-ft"]
