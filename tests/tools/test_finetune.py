"""Fine-tuning (hf-posenc finetune): two accelerate processes, resume, LoRA, bad input."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tool_helpers import (BOOK, DATA, assert_failed_cleanly, assert_refused, launch, run_cli, save_tiny_model,
                          snapshot)

import hf_posenc
from hf_posenc.tools import finetune

pytestmark = pytest.mark.skipif(not BOOK.is_file(), reason="../shared/data is not there")


def finetune_main(argv: list[str]) -> int:
    return run_cli("finetune", argv)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def _args(tiny_dir, out, *extra):
    return ["--model", str(tiny_dir), "--method", "alibi", "--method-option", "trainable=true",
            "--method-option", 'slopes="geometric"', "--text-file", str(BOOK), "--text-fraction", "0:0.8",
            "--max-length", "64", "--lr", "3e-3", "--output-dir", str(out), "--no-progress", *extra]


@pytest.mark.parametrize("cpu_mpirun", [False, True], ids=["ddp.yaml", "--cpu with mpirun"])
def test_two_processes_train_the_same_weights(tiny_dir, tmp_path, cpu_mpirun):
    out = tmp_path / "ft"
    done = launch("finetune", _args(tiny_dir, out, "--max-steps", "8", "--train-only", "all",
                                               "--threads", "1"), cpu_mpirun=cpu_mpirun)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "training_args.json").read_text())
    assert summary["num_processes"] == 2 and summary["distributed_type"].endswith("MULTI_CPU")
    assert summary["deepspeed_zero_stage"] is None and summary["engine"] == "ddp"
    digests = summary["weights_sha256_per_process"]
    assert len(digests) == 2 and digests[0] == digests[1]
    log = json.loads((out / "loss_log.json").read_text())
    assert len(log) == 8 and log[-1]["tokens"] == 8 * 2 * 64
    assert sum(e["loss"] for e in log[-3:]) / 3 < sum(e["loss"] for e in log[:3]) / 3 - 0.2  # loss went down
    assert (out / "loss_log.csv").read_text().startswith("step,loss,eval_loss,lr,tokens,seconds")
    # one schedule step per optimizer step, as in one process (accelerate's default stepped it once per process)
    from transformers import get_scheduler

    schedule = get_scheduler("cosine", torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=3e-3),
                             num_warmup_steps=1, num_training_steps=8)
    expected = []
    for _ in range(8):
        schedule.optimizer.step()
        schedule.step()
        expected.append(schedule.get_last_lr()[0])
    assert [e["lr"] for e in log] == pytest.approx(expected, rel=1e-12)

    # the checkpoint reloads with its patch and its trained positional parameters
    model = hf_posenc.from_pretrained(out)
    config = hf_posenc.get_posenc_config(model)
    assert config.method == "alibi" and config.trainable and config.slopes == "geometric"
    assert summary["posenc_config"] == config.to_dict()
    saved = load_file(out / "model.safetensors")
    positional = {k: v for k, v in saved.items() if ".posenc." in k}
    assert positional, sorted(saved)[:5]
    module = hf_posenc.get_positional_module(model)
    prefix = next(name for name, m in model.named_modules() if m is module) + "."
    reloaded = {prefix + k: v for k, v in module.state_dict().items()}
    fresh = hf_posenc.get_positional_module(hf_posenc.patch_model(
        hf_posenc.from_pretrained(tiny_dir), "alibi", trainable=True, slopes="geometric"))
    for key, value in positional.items():
        assert torch.equal(reloaded[key], value)
        assert not torch.equal(fresh.state_dict()[key[len(prefix):]], value)  # it did train


def _digest(directory):
    return json.loads((directory / "training_args.json").read_text())["weights_sha256_per_process"][0]


def test_resume_gives_the_same_weights(tiny_dir, tmp_path):
    common = ["--max-steps", "4", "--train-only", "positional", "--lr", "0.05"]
    assert finetune_main(_args(tiny_dir, tmp_path / "straight", *common)) == 0
    assert finetune_main(_args(tiny_dir, tmp_path / "cut", *common, "--save-every", "2")) == 0
    assert (tmp_path / "cut-checkpoints" / "step-2" / "trainer_state.json").is_file()
    assert finetune_main(_args(tiny_dir, tmp_path / "resumed", *common, "--resume-from",
                            str(tmp_path / "cut-checkpoints" / "step-2"))) == 0
    assert _digest(tmp_path / "resumed") == _digest(tmp_path / "straight") == _digest(tmp_path / "cut")
    straight = json.loads((tmp_path / "straight" / "loss_log.json").read_text())
    resumed = json.loads((tmp_path / "resumed" / "loss_log.json").read_text())
    assert [e["loss"] for e in resumed] == pytest.approx([e["loss"] for e in straight], rel=1e-5)


def test_resume_refuses_other_settings(tiny_dir, tmp_path, capsys):
    """Another --method (was a raw "RuntimeError: Unexpected key(s)") or --max-length (went ahead silently) than
    the checkpoint was saved with is refused before anything loads; the same method spelled the other way resumes
    (issue 19, item 8)."""
    def argv(out, method, *extra):
        return ["--model", str(tiny_dir), "--method", method, "--text-file", str(BOOK), "--text-fraction", "0:0.8",
                "--lr", "3e-3", "--max-steps", "3", "--train-only", "positional", "--save-every", "2",
                "--no-progress", "--output-dir", str(out), *extra]

    assert finetune_main(argv(tmp_path / "cut", "kerple", "--max-length", "64")) == 0
    step = str(tmp_path / "cut-checkpoints" / "step-2")
    kerple = '--method kerple {"variant": "log", "init": "alibi"} there, fire'
    for method, extra, shown in (("fire", ["--max-length", "64"], kerple),
                                 ("kerple", ["--max-length", "32"], "--max-length 64 there, 32 now")):
        out = tmp_path / "other"
        assert_failed_cleanly(finetune_main(argv(out, method, *extra, "--resume-from", step)), capsys,
                              f"--resume-from {step} was saved with other settings ({shown}", out)
    respelled = argv(tmp_path / "respelled", "kerple:variant=\"log\"", "--max-length", "64", "--resume-from", step)
    assert finetune_main(respelled) == 0



def test_lora_is_merged_and_positional_parameters_train(tiny_dir, tmp_path):
    out = tmp_path / "lora"
    assert finetune_main(_args(tiny_dir, out, "--max-steps", "3", "--train-only", "lora", "--eval-blocks", "2",
                            "--eval-every", "3")) == 0
    summary = json.loads((out / "training_args.json").read_text())
    assert summary["final_eval_loss"] is not None
    saved = load_file(out / "model.safetensors")
    assert not any("lora" in k for k in saved)
    base = load_file(tiny_dir / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(saved[key], base[key])  # LoRA merged into the projection
    assert torch.equal(saved["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])
    assert hf_posenc.get_posenc_config(hf_posenc.from_pretrained(out)).trainable


def test_lora_distilled_from_the_original_is_saved_merged(tiny_dir, tmp_path):
    """--distill-from original takes the patch off for each teacher forward and puts it back while PEFT's layers are
    in the tree: the model saved merged must still be the architecture's (it was saved with its adapters unmerged,
    q_proj.base_layer / lora_A / lora_B, which a loader reads as random projections). The merged folder equals the
    same run saved as an adapter and merged on load."""
    runs = {}
    for save in ("merged", "adapter"):
        runs[save] = tmp_path / save
        assert finetune_main(_args(tiny_dir, runs[save], "--max-steps", "2", "--train-only", "lora", "--distill-from",
                                   "original", "--save", save, "--threads", "1")) == 0
    saved = load_file(runs["merged"] / "model.safetensors")
    assert not [k for k in saved if "lora" in k or "base_layer" in k]
    base = load_file(tiny_dir / "model.safetensors")
    assert set(base) <= set(saved)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(saved[key], base[key])  # LoRA merged into the projection
    merged, info = hf_posenc.from_pretrained(runs["merged"], output_loading_info=True)
    assert not info["missing_keys"]
    adapter = hf_posenc.load_adapter(runs["adapter"], base_model=str(tiny_dir)).merge_and_unload()
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter(ids).logits, rtol=1e-5, atol=1e-5)


def test_lora_adapter_only_output_reloads_with_its_trained_patch(tiny_dir, tmp_path):
    """--save adapter writes the PEFT adapter alone (no merged model), with the patch and its trained positional
    weights; hf_posenc.from_pretrained on it gives the base model patched as trained, with the adapter."""
    from safetensors import safe_open

    out = tmp_path / "adapter"
    assert finetune_main(_args(tiny_dir, out, "--max-steps", "2", "--train-only", "lora", "--save", "adapter")) == 0
    assert not (out / "model.safetensors").exists() and (out / "adapter_config.json").is_file()
    loaded = hf_posenc.load_adapter(out, base_model=str(tiny_dir))
    slopes = hf_posenc.get_positional_module(loaded.get_base_model()).state_dict()
    with safe_open(out / "adapter_model.safetensors", framework="pt") as handle:
        for name, value in slopes.items():
            assert torch.equal(handle.get_tensor(f"base_model.model.model.posenc.{name}"), value)
    fresh = hf_posenc.patch_model(hf_posenc.from_pretrained(tiny_dir), "alibi", trainable=True, slopes="geometric")
    assert any(not torch.equal(value, fresh_value) for value, fresh_value in
               zip(slopes.values(), hf_posenc.get_positional_module(fresh).state_dict().values()))  # they trained


@pytest.mark.parametrize("extra, message", [
    (["--text-file", "/nonexistent/*.txt"], "matches no file"),
    (["--max-length", "400000"], "need at least 400000 tokens"),
    (["--method-option", "slops=1"], "Unknown option(s) 'slops'"),
    (["--method", "yarn", "--train-only", "positional"], "'trainable' for method 'yarn'"),
    # nonsense settings are refused before anything runs
    (["--lr", "nan"], "--lr must be a finite number > 0 and <= 3.40282e+37, got nan"),
    (["--lr", "0"], "--lr must be a finite number > 0 and <= 3.40282e+37, got 0; AdamW's first step"),
    (["--positional-lr=-1e-3"], "--positional-lr must be a finite number > 0"),
    (["--max-grad-norm", "nan"], "--max-grad-norm must be a finite number >= 0, got nan; 0 turns clipping off"),
    (["--max-grad-norm", "inf"], "--max-grad-norm must be a finite number >= 0, got inf"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be an integer >= 0 and <= 1, got -1"),
    (["--warmup-steps", "5"], "warm-up is part of --max-steps"),
    (["--log-every", "0"], "--log-every must be an integer >= 1, got 0"),
    (["--save-total-limit", "0"], "--save-total-limit must be an integer >= 1"),
    (["--seed", "-1"], "--seed must be an integer >= 0"),
    (["--threads", "-2"], "--threads must be an integer >= 1"),
    (["--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    (["--save", "adapter"], "--save adapter needs --train-only lora"),
    (["--encoding", "no-such-codec"], "--encoding 'no-such-codec' is not an encoding Python knows"),
    (["--attention-path", "fast"],
     "--attention-path 'fast' is unknown; use one of auto, blocked, flex, flash, compiled"),
    # inputs that ended in tracebacks
    (["--text-file", str(DATA)], "is a folder, not a text file; pass a glob such as"),
])
def test_bad_input_fails_cleanly(tiny_dir, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    assert_failed_cleanly(finetune_main(_args(tiny_dir, out, "--max-steps", "1", *extra)), capsys, message, out)


def test_a_non_utf8_text_file_is_named_with_the_fix(tiny_dir, tmp_path, capsys):
    latin = tmp_path / "latin-1.txt"
    latin.write_bytes(("Caf\u00e9 au lait, s'il vous pla\u00eet. " * 200).encode("latin-1"))
    out = tmp_path / "out"
    argv = ["--model", str(tiny_dir), "--text-file", str(latin), "--max-length", "64", "--max-steps", "1",
            "--output-dir", str(out), "--no-progress"]
    assert_failed_cleanly(finetune_main(argv), capsys, f"{latin} is not valid utf-8 text (invalid continuation byte: "
                          "byte 0xe9 at offset 3, line 1); pass --encoding with the file's encoding", out)
    assert finetune_main([*argv, "--encoding", "latin-1"]) == 0
    assert json.loads((out / "training_args.json").read_text())["encoding"] == "latin-1"


def test_a_diverging_run_stops_and_keeps_the_previous_output(tiny_dir, tmp_path, capsys, monkeypatch):
    """--lr 1e30 is a legal number that blows training up: the loss, checked every step, stops the run with one
    line and exit 2, and the good model saved before stays as it was. Weights made non-finite by the last update,
    after the last loss was checked, are caught before saving."""
    out = tmp_path / "out"
    assert finetune_main(_args(tiny_dir, out, "--max-steps", "1")) == 0
    good = snapshot(out)
    assert_refused(finetune_main(_args(tiny_dir, out, "--max-steps", "4", "--lr", "1e30")), capsys,
                   "the training loss is nan at step 2; training stopped and nothing was saved to --output-dir", out,
                   good)
    # an --lr whose first AdamW step float32 cannot hold is refused up front (AdamW raised an overflow error)
    assert_refused(finetune_main(_args(tiny_dir, out, "--max-steps", "1", "--lr", "1e38")), capsys,
                   "--lr must be a finite number > 0 and <= 3.40282e+37, got 1e+38", out, good)

    real_step = torch.optim.AdamW.step

    def step_then_overflow(self, *args, **kwargs):  # stands in for an update that overflows the weights
        result = real_step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].fill_(float("inf"))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_overflow)
    assert_refused(finetune_main(_args(tiny_dir, out, "--max-steps", "1")), capsys,
                   "the update of step 1 left weights that are not finite", out, good)


def test_a_run_stopped_by_a_raise_still_releases_what_it_prepared(tiny_dir, tmp_path, capsys, monkeypatch):
    """A run that stops mid-training on a raise (here the diverging loss above) drops its prepared objects and then
    ends the accelerator's training, as a finished run does: DDP's reducer goes before the process group (see
    `release_prepared`), and the group is destroyed."""
    from accelerate import Accelerator

    calls = []
    release, end = finetune.release_prepared, Accelerator.end_training
    monkeypatch.setattr(finetune, "release_prepared", lambda training: (calls.append("release"), release(training)))
    monkeypatch.setattr(Accelerator, "end_training", lambda self: (calls.append("end"), end(self)))
    assert finetune_main(_args(tiny_dir, tmp_path / "out", "--max-steps", "4", "--lr", "1e30")) == 2
    assert "the training loss is nan" in capsys.readouterr().err
    assert calls == ["release", "end"]


def test_two_processes_stop_together_on_a_diverging_loss(tiny_dir, tmp_path):
    out = tmp_path / "out"
    assert finetune_main(_args(tiny_dir, out, "--max-steps", "1")) == 0
    good = snapshot(out)
    done = launch("finetune", _args(tiny_dir, out, "--max-steps", "4", "--lr", "1e30", "--threads", "1"),
                  timeout=240)
    assert done.returncode != 0  # and not a timeout: a process that stopped alone would leave the other waiting
    assert done.stderr.count("error: the training loss is nan at step 2; training stopped") == 2, done.stderr[-3000:]
    assert snapshot(out) == good


def test_checkpoints_inside_the_output_dir_survive(tiny_dir, tmp_path):
    """--checkpoint-dir o/ckpts inside --output-dir o is not ours to remove, neither is a step-* folder of the user's
    in it when old checkpoints are pruned."""
    out = tmp_path / "o"
    checkpoints = ["--save-every", "1", "--checkpoint-dir", str(out / "ckpts"), "--train-only", "positional"]
    assert finetune_main(_args(tiny_dir, out, "--max-steps", "2", *checkpoints)) == 0
    assert (out / "ckpts" / "step-1" / "trainer_state.json").is_file() and (out / "model.safetensors").is_file()
    (out / "ckpts" / "step-0").mkdir()
    (out / "ckpts" / "step-0" / "notes.txt").write_text("mine")
    assert finetune_main(_args(tiny_dir, out, "--max-steps", "4", *checkpoints)) == 0  # saves steps 1-3, keeps 2
    assert sorted(p.name for p in (out / "ckpts").iterdir()) == ["step-0", "step-2", "step-3"]
    assert (out / "ckpts" / "step-0" / "notes.txt").read_text() == "mine"
    assert json.loads((out / "training_args.json").read_text())["steps_done"] == 4


def test_no_trainable_positional_parameters(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--model", str(tiny_dir), "--method", "alibi", "--train-only", "positional", "--text-file", str(BOOK),
            "--max-length", "64", "--max-steps", "1", "--output-dir", str(out), "--no-progress"]
    assert_failed_cleanly(finetune_main(argv), capsys, "has no trainable parameters", out)


def test_method_options_in_the_method_and_repeated():
    """--method takes NAME:KEY=VALUE,... as eval-ppl does (the main job passes its --swap that way), and
    --method-option adds to it."""
    request = finetune.check_args(finetune.settings(method="alibi:trainable=true",
                                                    method_option=['slopes="geometric"']))
    assert (request.name, request.options) == ("alibi", {"trainable": True, "slopes": "geometric"})
    assert finetune.check_args(finetune.settings(method="none")) is None
    with pytest.raises(hf_posenc.PosEncError, match="Unknown option"):
        finetune.check_args(finetune.settings(method="yarn:factr=4"))
    with pytest.raises(TypeError, match="no setting max_step"):
        finetune.settings(max_step=3)


def test_every_offered_schedule_is_one_transformers_builds_from_warmup_and_steps():
    """--lr-scheduler offers transformers' schedules (the parser keeps their names, so that --help imports no
    transformers): each is a transformers SchedulerType that get_scheduler builds from warm-up and total steps."""
    from transformers import SchedulerType, get_scheduler

    for name in finetune.LR_SCHEDULERS:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = get_scheduler(SchedulerType(name), optimizer, num_warmup_steps=2, num_training_steps=10)
        assert scheduler.get_last_lr() == [1.0 if name == "constant" else 0.0], name  # warm-up starts at 0


def test_lora_leaves_out_projections_the_patch_hooks():
    from tiny_models import tiny_model

    gpt2 = hf_posenc.patch_model(tiny_model("gpt2"), "rope")  # RoPE on GPT-2 rotates in a hook on c_attn
    names = finetune.lora_targets(gpt2)
    assert names and all(n.endswith("attn.c_proj") for n in names)
    llama = hf_posenc.patch_model(tiny_model("llama"), "alibi")
    projections = {n.rsplit(".", 1)[1] for n in finetune.lora_targets(llama)}
    assert sorted(projections) == ["k_proj", "o_proj", "q_proj", "v_proj"]


def test_training_memory_estimate_refuses(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("hf_posenc.tools.estimates.available_memory_bytes", lambda: 2**20)
    out = tmp_path / "out"
    assert_failed_cleanly(finetune_main(_args(tiny_dir, out, "--max-steps", "1")), capsys,
                          "training on 1 x 64 tokens needs about", out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU-only machine says; with GPUs FSDP runs")
def test_fsdp_config_on_a_cpu_only_machine_says_what_to_use(tiny_dir, tmp_path):
    out = tmp_path / "out"
    done = launch("finetune", _args(tiny_dir, out, "--max-steps", "2", "--mixed-precision", "no"),
                  config="fsdp.yaml")
    assert done.returncode != 0
    assert "this accelerate configuration needs GPUs" in done.stderr and "ddp.yaml" in done.stderr
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU-only machine says; with GPUs DeepSpeed runs")
@pytest.mark.parametrize("installed", [False, True], ids=["deepspeed missing", "no DS_ACCELERATOR=cpu"])
def test_deepspeed_launch_that_cannot_run_is_refused_not_run_as_ddp(tiny_dir, tmp_path, capsys, monkeypatch,
                                                                    installed):
    """What `accelerate launch --config_file deepspeed_zero2.yaml` sets in each process; with deepspeed missing, or
    on a CPU-only machine without DeepSpeed's CPU accelerator, accelerate would raise an ImportError or silently run
    DDP (cpu=True turns its DeepSpeed branch off). Refused in one line, before the output folder exists."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    if installed:
        monkeypatch.setattr("accelerate.utils.is_deepspeed_available", lambda: True)
    elif importlib.util.find_spec("deepspeed") is not None:
        monkeypatch.setattr("accelerate.utils.is_deepspeed_available", lambda: False)
    before = snapshot(tmp_path)
    why = ("no CUDA device: set DS_ACCELERATOR=cpu for DeepSpeed's CPU accelerator" if installed
           else "DeepSpeed, which is not installed: pip install deepspeed")
    assert_refused(finetune_main(_args(tiny_dir, tmp_path / "out", "--max-steps", "1")), capsys,
                   f"{why}, or launch with scripts/accelerate_configs/ddp.yaml", tmp_path, before)


def test_tensorboard_tracker_logs_the_loss_beside_the_output(tiny_dir, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    assert finetune_main(_args(tiny_dir, out, "--max-steps", "3", "--report-to", "tensorboard")) == 0
    events = list((tmp_path / "out-logs").rglob("events.out.tfevents.*"))
    assert events and (out / "model.safetensors").is_file()
    accumulator = EventAccumulator(str(events[0].parent)).Reload()
    assert [e.step for e in accumulator.Scalars("loss")] == [1, 2, 3]
    log = json.loads((out / "loss_log.json").read_text())
    assert [e.value for e in accumulator.Scalars("loss")] == pytest.approx([e["loss"] for e in log])
    capsys.readouterr()
    bad = tmp_path / "bad"
    assert_failed_cleanly(finetune_main(_args(tiny_dir, bad, "--max-steps", "3", "--report-to", "tensorbord")), capsys,
                          "--report-to tensorbord: unknown tracker; accelerate knows", bad)
    assert not (tmp_path / "bad-logs").exists()
    # wandb is not a dependency: a named tracker whose package is missing is refused
    if importlib.util.find_spec("wandb") is None:
        assert_failed_cleanly(finetune_main(_args(tiny_dir, bad, "--max-steps", "3", "--report-to", "wandb")), capsys,
                              "--report-to wandb: its package is not installed (pip install wandb)", bad)



def test_a_tracker_that_is_not_installed_is_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    """--report-to wandb without wandb: one line and exit code 2 before anything runs (it was a traceback from
    accelerate's logger, "You must initialize the accelerate state"; issue 19, item 3)."""
    monkeypatch.setattr("accelerate.tracking._available_trackers", [])  # as on a machine without wandb
    out = tmp_path / "out"
    assert_failed_cleanly(finetune_main(_args(tiny_dir, out, "--max-steps", "1", "--report-to", "wandb")), capsys,
                          "--report-to wandb: its package is not installed (pip install wandb), or leave it out", out)


def test_a_method_over_2d_positions_and_tape_fine_tune(tiny_dir, tmp_path):
    """rope-2d gets no 1-D document-restart position ids (which it refuses): it trains on the 1 x L grid; tape trains
    its update maps from the RoPE state."""
    for method, parameter in (("rope-2d", "column_rates"), ("tape", "attention_mix")):
        out = tmp_path / method
        argv = ["--model", str(tiny_dir), "--method", method, "--text-file", str(BOOK), "--text-fraction", "0:0.8",
                "--max-length", "32", "--max-steps", "2", "--positional-lr", "1e-2", "--output-dir", str(out),
                "--no-progress"]
        assert finetune_main(argv) == 0, method
        module = hf_posenc.get_positional_module(hf_posenc.from_pretrained(out))
        fresh = hf_posenc.get_positional_module(hf_posenc.patch_model(hf_posenc.from_pretrained(tiny_dir), method))
        assert not torch.equal(getattr(module, parameter), getattr(fresh, parameter)), method


def test_compiled_attention_path_trains_the_same_weights(tiny_dir, tmp_path):
    """--attention-path compiled: CoPE's blocks under torch.compile (checked first) train the weights the eager
    blocks train, within float32 rounding over two AdamW steps, and the run's path does not outlive it."""
    from hf_posenc import attention as engine

    weights = {}
    for path in ("blocked", "compiled"):
        out = tmp_path / path
        engine.last_paths.clear()
        argv = ["--model", str(tiny_dir), "--method", "cope", "--method-option", "max_pos=8", "--text-file", str(BOOK),
                "--text-fraction", "0:0.8", "--max-length", "48", "--max-steps", "2", "--lr", "1e-3",
                "--attention-path", path, "--output-dir", str(out), "--no-progress"]
        assert finetune_main(argv) == 0, path
        assert (engine.last_paths["compiled content"] > 0) == (path == "compiled"), dict(engine.last_paths)
        weights[path] = load_file(out / "model.safetensors")
    assert engine.get_attention_path() == "auto"  # the run's path is the run's alone
    # AdamW's first steps move each weight by about lr whatever its gradient's size: a gradient that differs in its
    # last bits moves a weight by a few 1e-6 at most here (lr 5e-4 at the first step).
    for name, weight in weights["blocked"].items():
        assert (weights["compiled"][name] - weight).abs().max() < 1e-5, name
    losses = {path: [entry["loss"] for entry in json.loads((tmp_path / path / "loss_log.json").read_text())]
              for path in weights}
    assert losses["compiled"] == pytest.approx(losses["blocked"], rel=1e-6)
    assert any(".posenc." in name for name in weights["blocked"])


def test_a_hybrid_of_two_methods_fine_tunes_and_reloads(tiny_dir, tmp_path, capsys):
    """--method joins parts with '+' (each with layers=): the checkpoint records both parts, its trained positional
    weights come back, and --method-option beside such a hybrid is refused with the fix."""
    out = tmp_path / "hybrid"
    method = "kerple:layers=[1]+yarn:factor=2,layers=rest"
    argv = ["--model", str(tiny_dir), "--method", method, "--text-file", str(BOOK), "--text-fraction", "0:0.8",
            "--max-length", "32", "--max-steps", "2", "--positional-lr", "1e-2", "--output-dir", str(out),
            "--no-progress"]
    assert finetune_main(argv) == 0
    model = hf_posenc.from_pretrained(out)
    config = hf_posenc.get_posenc_config(model)
    assert [(part["method"], part["layers"]) for part in config.parts] == [("kerple", [1]), ("yarn", [0])]
    fresh = hf_posenc.patch_model(hf_posenc.from_pretrained(tiny_dir), "kerple", layers=[1])
    trained = dict(hf_posenc.get_positional_module(model).parts[0].named_parameters())
    assert any(not torch.equal(value, trained[name])
               for name, value in hf_posenc.get_positional_module(fresh).parts[0].named_parameters())
    recorded = json.loads((out / "training_args.json").read_text())
    assert recorded["method"] == method and recorded["posenc_config"]["parts"][1]["layers"] == [0]
    refused = tmp_path / "refused"
    assert_failed_cleanly(finetune_main([*argv[:-3], "--method-option", "factor=4", "--output-dir", str(refused),
                                         "--no-progress"]), capsys, "write each option in its part", refused)


def test_gradient_checkpointing_is_enabled_without_a_deprecation_warning():
    """--gradient-checkpointing turns on the model's own (non-reentrant) activation checkpointing through the name
    this transformers offers, so a fine-tune prints no FutureWarning about the deprecated name."""
    import warnings

    from accelerate import Accelerator
    from tiny_models import tiny_model

    model = hf_posenc.patch_model(tiny_model("llama"), "alibi")
    args = finetune.settings(max_length=16, batch_size=1, max_steps=1, gradient_checkpointing=True,
                             no_memory_check=True)
    blocks = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand_as(blocks)
    data = finetune.TrainingData([], blocks.numel(), blocks, blocks[:0], positions, positions[:0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = finetune.prepare_training(args, Accelerator(cpu=True), model, data)
    assert not [w for w in caught if "checkpointing_enable" in str(w.message)], [str(w.message) for w in caught]
    unwrapped = prepared.accelerator.unwrap_model(prepared.model)
    assert getattr(unwrapped, "is_activation_checkpointing", None) or unwrapped.is_gradient_checkpointing


def test_the_wrapped_model_goes_before_the_process_group(tmp_path):
    """`release_prepared` drops every reference to DDP's wrapper (so its reducer) while the process group still
    exists. Dropped after the group, the reducer destroyed the group holding the GIL while gloo's worker thread
    waited for the GIL: a deadlock at exit, about one mpirun run in 10-25 on two busy cores."""
    import weakref

    from accelerate import Accelerator

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        accelerator = Accelerator(cpu=True)
        wrapped = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        wrapped(torch.ones(1, 2)).sum().backward()
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        accelerator._models.append(wrapped)  # as accelerator.prepare keeps it
        training = finetune.Training(accelerator, wrapped, list(wrapped.parameters()), optimizer, None, None, None,
                                     0)
        gone = weakref.ref(wrapped)
        del wrapped, optimizer
        finetune.release_prepared(training)
        assert gone() is None, "something still holds the DDP-wrapped model"
        assert torch.distributed.is_initialized()
    finally:
        torch.distributed.destroy_process_group()


def _last_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.rstrip().splitlines()[-1]


def test_a_full_disk_at_the_final_save_keeps_the_model_in_tmpdir(tiny_dir, tmp_path, capsys, monkeypatch):
    """The weights cannot be written into --output-dir at the end (safetensors: "No space left on device"; it was a
    SafetensorError traceback and the trained model lost, issue 51, item 6): the run goes into a new folder under
    $TMPDIR, named in the one error line, exit 2, and reloads from there. When that fails too, the line says what
    is left: the newest checkpoint."""
    import re
    import tempfile

    import transformers.modeling_utils
    from safetensors import SafetensorError

    rescue_root = tmp_path / "tmpdir"
    rescue_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(rescue_root))  # as TMPDIR=... would
    real_save = transformers.modeling_utils.safe_save_file
    full_disk = "Error while serializing: I/O error: No space left on device (os error 28)"

    def save_where_there_is_room(tensors, filename, *args, **kwargs):
        if not str(filename).startswith(str(rescue_root)):
            raise SafetensorError(full_disk)
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_where_there_is_room)
    out = tmp_path / "out"
    assert finetune_main(_args(tiny_dir, out, "--max-steps", "1")) == 2
    line = _last_line(capsys)
    assert line.startswith(f"error: could not write --output-dir {out} (SafetensorError: {full_disk}); the trained "
                           f"model is in {rescue_root}/hf_posenc-finetune-rescued-"), line
    rescued = Path(re.search(r"is in (\S+) instead", line).group(1))
    assert hf_posenc.get_posenc_config(hf_posenc.from_pretrained(rescued)).method == "alibi"
    assert json.loads((rescued / "training_args.json").read_text())["steps_done"] == 1
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]

    def no_room_anywhere(tensors, filename, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", no_room_anywhere)
    assert finetune_main(_args(tiny_dir, out, "--max-steps", "2", "--save-every", "1", "--train-only",
                               "positional")) == 2
    line = _last_line(capsys)
    assert line.startswith(f"error: could not write --output-dir {out} (No space left on device: "), line
    assert f"), nor a copy in {rescue_root} (No space left on device: {rescue_root}/hf_posenc-finetune-rescued-" in line
    assert f"; the newest checkpoint is {tmp_path / 'out-checkpoints' / 'step-1'} (--resume-from latest)" in line
    assert sorted(p.name for p in rescue_root.iterdir()) == [rescued.name]  # the failed copy was removed


def test_a_checkpoint_that_cannot_be_saved_is_left_out_and_training_goes_on(tiny_dir, tmp_path, capsys,
                                                                             monkeypatch):
    """torch's "[enforce fail at inline_container.cc:672]" while checkpointing (a full disk) was a traceback that
    ended the run: that checkpoint is left out with one warning line, its partial folder removed, and the run
    trains on and saves (issue 51, item 6)."""
    from accelerate import Accelerator

    real_save_state = Accelerator.save_state
    saves = []

    def save_state_failing_once(self, output_dir=None, **kwargs):
        saves.append(output_dir)
        if len(saves) == 2:
            Path(output_dir, "optimizer.bin").write_bytes(b"half")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 32\n"
                               "frame #0: c10::Error::Error(...)")
        return real_save_state(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", save_state_failing_once)
    out = tmp_path / "out"
    assert finetune_main(_args(tiny_dir, out, "--max-steps", "4", "--save-every", "1", "--train-only",
                               "positional")) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    warnings = [line for line in err.splitlines() if line.startswith("warning: checkpoint")]
    assert warnings == [f"warning: checkpoint step-2 could not be saved in {tmp_path / 'out-checkpoints'} "
                        "(RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 64 vs 32); "
                        "training goes on (the newest checkpoint is step-1)"]
    assert sorted(os.listdir(tmp_path / "out-checkpoints")) == ["step-1", "step-3"]
    assert json.loads((out / "training_args.json").read_text())["steps_done"] == 4


def test_resume_latest_skips_an_incomplete_checkpoint(tiny_dir, tmp_path, capsys):
    """A kill while trainer_state.json was written left it cut short, and --resume-from latest crashed with a
    JSONDecodeError traceback (issue 51, item 7). Checkpoints are now renamed into place complete, listing their
    files' sizes; latest skips one that is not complete (cut short by an older version, damaged since) for the one
    before it, saying so, and a named one is refused in one line."""
    common = ["--max-steps", "3", "--train-only", "positional"]
    assert finetune_main(_args(tiny_dir, tmp_path / "cut", *common, "--save-every", "1")) == 0
    checkpoints = tmp_path / "cut-checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["step-1", "step-2"]  # and no partial folder
    state = json.loads((checkpoints / "step-2" / "trainer_state.json").read_text())
    assert state["files"]["model.safetensors"] == (checkpoints / "step-2" / "model.safetensors").stat().st_size
    text = (checkpoints / "step-2" / "trainer_state.json").read_text()
    (checkpoints / "step-2" / "trainer_state.json").write_text(text[: len(text) // 2])
    capsys.readouterr()
    assert finetune_main(_args(tiny_dir, tmp_path / "resumed", *common, "--resume-from", "latest",
                               "--checkpoint-dir", str(checkpoints))) == 0  # saves no checkpoint over step-2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert (f"note: --resume-from latest skips {checkpoints / 'step-2'}, which is not complete (its "
            "trainer_state.json is cut short or unreadable (JSONDecodeError: ") in captured.err
    assert f"resumed from {checkpoints / 'step-1'} at step 1" in captured.out
    for step, damage, reason in (("step-2", None, "its trainer_state.json is cut short or unreadable"),
                                 ("step-1", "model.safetensors", "its model.safetensors has 10 of its")):
        if damage:
            with open(checkpoints / step / damage, "r+b") as weights:
                weights.truncate(10)
        out = tmp_path / "refused"
        assert_failed_cleanly(finetune_main(_args(tiny_dir, out, *common, "--resume-from", str(checkpoints / step))),
                              capsys, f"--resume-from {checkpoints / step} is not a complete checkpoint ({reason}", out)
