"""DeepSpeed ZeRO-2 and ZeRO-3 on a patched model, on the CPU (DS_ACCELERATOR=cpu, two gloo processes): tiny LLaMAs
patched with KERPLE (learned biases), with FoX (content-dependent gates) and with KERPLE in one layer (a hybrid) go
through ``accelerator.prepare`` as the fine-tune's do, train a few AdamW steps on halves of a fixed batch, and must
match one process on the whole batch; under ZeRO-3 each process holds only its part of every positional parameter;
the gathered state dict, saved with ``save_pretrained``, reloads with ``hf_posenc.from_pretrained`` to the trained
model's logits. Then the fine-tune itself, launched with the shipped ZeRO-2 and ZeRO-3 configs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from test_fsdp2 import METHODS, fixed_batch, patched, positional_state
from tool_helpers import BOOK, free_port, launch, run_cli, save_tiny_model

import hf_posenc

STEPS, LR, CLIP = 3, 1e-2, 1.0
# The same float32 arithmetic summed in another order (each process's half-batch gradient, averaged by DeepSpeed's
# reduce; AdamW on flat partitions): measured within 2e-7 relative of one process over these steps. Adam's step
# normalisation may amplify such differences; 1e-4 is far below what a fault moves (one process on its half
# alone: 2e-2 to 8e-2 off).
RELATIVE = 1e-4


def train_one_process(model, ids: torch.Tensor) -> list[float]:
    """The reference: AdamW on the whole batch in one process, with the clipping DeepSpeed applies."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def zero_worker(rank: int, world: int, port: int, stage: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
    from deepspeed.runtime.zero import GatheredParameters

    # Built before the Accelerator: once it exists, transformers builds models under ZeRO-3 partitioned at once
    # (deepspeed.zero.Init), initialised otherwise than in one process. The fine-tune loads weights, which is exact.
    models = {method: patched(method) for method in METHODS}
    # what the fine-tune's make_accelerator builds under a DeepSpeed launch on a CPU-only machine
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1, gradient_clipping=CLIP,
                             zero3_save_16bit_model=True, zero3_init_flag=False)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = fixed_batch().shape[0] // world
    accelerator = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    ids = fixed_batch()
    results = {"distributed_type": accelerator.distributed_type.value}
    for method, model in models.items():
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        engine, optimizer = accelerator.prepare(model, optimizer)
        part = ids.chunk(world)[rank]
        losses = []
        for _ in range(STEPS):
            loss = engine(input_ids=part, labels=part).loss
            accelerator.backward(loss)  # DeepSpeed's backward and step: reduce, clip, AdamW on the partitions
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()[None]).mean().item())
        positional = hf_posenc.get_positional_module(model)
        parts = {}
        for name, p in positional.named_parameters():
            local = getattr(p, "ds_tensor", p).detach().clone()
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local)
            with GatheredParameters([p]):
                whole = p.detach().clone()
            parts[name] = {"local": local.numel(), "whole": whole.numel(), "empty_outside": p.numel() == 0,
                           "parts_differ": not torch.equal(gathered[0], gathered[1]),
                           "parts_make_whole": torch.equal(torch.cat(gathered)[:whole.numel()], whole.flatten())}
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=ids).logits
        state_dict = accelerator.get_state_dict(engine)  # a collective: ZeRO-3 gathers every parameter
        if rank == 0:
            saved = Path(out) / method
            accelerator.unwrap_model(engine).save_pretrained(saved, state_dict=state_dict)
            torch.save(logits, saved / "trained_logits.pt")
            results[method] = {"losses": losses, "positional": parts}
        accelerator.free_memory(engine, optimizer)
        dist.barrier()
    if rank == 0:
        (Path(out) / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def zero_run(request, tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp(f"zero{request.param}")
    mp.spawn(zero_worker, args=(2, free_port(), request.param, str(out)), nprocs=2, join=True)
    return request.param, out, json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("method", list(METHODS))
def test_zero_trains_like_one_process_and_its_save_reloads(zero_run, method):
    stage, out, results = zero_run
    assert results["distributed_type"] == "DEEPSPEED"
    result = results[method]
    for name, part in result["positional"].items():
        if stage == 3:  # each process holds half of every positional parameter, and nothing outside its part
            assert part["local"] == -(-part["whole"] // 2) and part["empty_outside"], name
            assert part["parts_make_whole"] and part["parts_differ"], name
        else:  # ZeRO-2 shards gradients and optimizer state; every process holds the whole parameters
            assert part["local"] == part["whole"] and not part["empty_outside"], name

    model = patched(method)
    before = positional_state(model)
    reference = train_one_process(model, fixed_batch())
    assert reference[-1] < reference[0] - 0.05  # it trains at all, so equal losses say something
    assert result["losses"] == pytest.approx(reference, rel=RELATIVE)

    reloaded = hf_posenc.from_pretrained(out / method)
    assert hf_posenc.get_posenc_config(reloaded).to_dict() == hf_posenc.get_posenc_config(model).to_dict()
    trained = positional_state(reloaded)
    assert trained.keys() == before.keys() and len(trained) == len(result["positional"])
    assert all(not torch.allclose(trained[k], before[k]) for k in before)  # the positional parameters moved
    for key, value in positional_state(model).items():  # and as far as in one process
        torch.testing.assert_close(trained[key], value, rtol=RELATIVE, atol=1e-6)
    with torch.no_grad():
        logits = reloaded.eval()(input_ids=fixed_batch()).logits
    torch.testing.assert_close(logits, torch.load(out / method / "trained_logits.pt"), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.mark.skipif(not BOOK.is_file(), reason="../shared/data is not there")
@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed's CPU accelerator; on GPUs accelerate's own")
@pytest.mark.parametrize("config, method", [("deepspeed_zero2.yaml", "kerple-in-layer-1"),
                                            ("deepspeed_zero3.yaml", "fox")])
def test_finetune_launched_with_a_deepspeed_config_runs_deepspeed(tiny_dir, tmp_path, monkeypatch, config, method):
    """`DS_ACCELERATOR=cpu accelerate launch --config_file CONFIG -m hf_posenc finetune ...` on 2 processes of 1
    block each trains as one process on 2 blocks: the same data order, the same losses, schedule and weights."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    name, options = method.split("-")[0], METHODS[method]
    args = ["--model", str(tiny_dir), "--method", name, *[a for k, v in options.items()
                                                         for a in ("--method-option", f"{k}={json.dumps(v)}")],
            "--text-file", str(BOOK), "--text-fraction", "0:0.8", "--max-length", "64", "--lr", "3e-3",
            "--max-steps", "4", "--train-only", "all", "--mixed-precision", "no", "--no-progress"]
    done = launch("finetune", [*args, "--batch-size", "1", "--threads", "1", "--output-dir", str(tmp_path / "ds")],
                  config=config)
    assert done.returncode == 0, done.stderr[-3000:]
    assert run_cli("finetune", [*args, "--batch-size", "2", "--output-dir", str(tmp_path / "one")]) == 0

    summary = json.loads((tmp_path / "ds" / "training_args.json").read_text())
    assert summary["distributed_type"].endswith("DEEPSPEED") and summary["num_processes"] == 2
    assert summary["deepspeed_zero_stage"] == int(config[-6]) and summary["engine"] == f"zero{config[-6]}"
    log, one_log = (json.loads((tmp_path / d / "loss_log.json").read_text()) for d in ("ds", "one"))
    assert [e["loss"] for e in log] == pytest.approx([e["loss"] for e in one_log], rel=RELATIVE)
    assert [e["lr"] for e in log] == pytest.approx([e["lr"] for e in one_log], rel=1e-12)  # one schedule step each
    assert [e["tokens"] for e in log] == [e["tokens"] for e in one_log]

    reloaded, one = (hf_posenc.from_pretrained(tmp_path / d) for d in ("ds", "one"))
    assert hf_posenc.get_posenc_config(reloaded).to_dict() == summary["posenc_config"]
    from hf_posenc.tools.finetune import weights_digest

    # every process's digest is of the whole weights it trained (ZeRO-3: gathered), those that were saved
    assert summary["weights_sha256_per_process"] == [weights_digest(reloaded)] * 2
    ids = fixed_batch()
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(input_ids=ids).logits, one.eval()(input_ids=ids).logits,
                                   rtol=0, atol=1e-3)


@pytest.mark.parametrize("file_config, refusal", [
    ({"gradient_accumulation_steps": 4}, "sets gradient_accumulation_steps 4, and --gradient-accumulation-steps is 1"),
    ({"gradient_clipping": 0.5}, "sets gradient_clipping 0.5, and --max-grad-norm is 1: make them equal"),
    ({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}},
     "stage3_gather_16bit_weights_on_model_save false: the fine-tune saves whole weights"),
    ({"gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}, None)], ids=["accumulation", "clipping",
                                                                                        "no gather", "auto"])
def test_a_deepspeed_config_file_that_contradicts_the_finetune_is_refused(tmp_path, monkeypatch, file_config,
                                                                          refusal):
    """A launch with `deepspeed_config_file`: DeepSpeed would follow the file's accumulation and clipping, the
    fine-tune its own options (and count its steps by them); ZeRO-3 without the gather could not save."""
    from hf_posenc.tools.finetune import settings
    from hf_posenc.tools.finetune.prepare import deepspeed_plugin
    from hf_posenc.tools.runtime import UsageError

    file_config = {"zero_optimization": {"stage": 2}, **file_config}
    (tmp_path / "ds.json").write_text(json.dumps(file_config))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "ds.json"))
    args = settings(model="unused", text_file="unused", output_dir=str(tmp_path / "out"))
    if refusal is None:
        plugin = deepspeed_plugin(args)
        assert plugin.deepspeed_config["gradient_accumulation_steps"] == args.gradient_accumulation_steps
        assert plugin.deepspeed_config["gradient_clipping"] == args.max_grad_norm
    else:
        with pytest.raises(UsageError, match=refusal):
            deepspeed_plugin(args)


def test_lora_under_zero3_is_refused_before_any_work(tmp_path, monkeypatch):
    """ZeRO-3 leaves each process an empty parameter outside the engine's forward: the LoRA merge at the end saved
    0-element weights, which from_pretrained refuses (seen before this refusal)."""
    from hf_posenc.tools.finetune import settings
    from hf_posenc.tools.finetune.prepare import deepspeed_plugin
    from hf_posenc.tools.runtime import UsageError

    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    args = settings(model="unused", text_file="unused", output_dir=str(tmp_path / "out"), train_only="lora")
    with pytest.raises(UsageError, match="--train-only lora under DeepSpeed ZeRO-3: .* use scripts/accelerate_configs/"
                                         "deepspeed_zero2.yaml, or --train-only all"):
        deepspeed_plugin(args)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert deepspeed_plugin(args).zero_stage == 2  # ZeRO-2 keeps whole weights: LoRA merges as under DDP


@pytest.mark.parametrize("teacher, train_only", [("original", "all"), ("some/checkpoint", "positional")],
                         ids=["frozen copy", "loaded"])
def test_a_teacher_of_its_own_under_zero3_is_refused(tmp_path, monkeypatch, teacher, train_only):
    """A distillation teacher held apart from the engine is partitioned by ZeRO-3 at its load or copy, and nothing
    gathers it for its forward (the frozen copy crashed in its embedding: "'weight' must be 2-D"). The unpatched
    view of the model itself runs through the engine, and trains (a launch of it ran)."""
    from hf_posenc.tools.finetune import settings
    from hf_posenc.tools.finetune.prepare import deepspeed_plugin
    from hf_posenc.tools.runtime import UsageError

    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    args = settings(model="unused", text_file="unused", output_dir=str(tmp_path / "out"), train_only=train_only,
                    distill_from=teacher)
    with pytest.raises(UsageError, match=f"--distill-from {teacher} with --train-only {train_only} under DeepSpeed "
                                         "ZeRO-3: the teacher is a model of its own"):
        deepspeed_plugin(args)
    view = settings(model="unused", text_file="unused", output_dir=str(tmp_path / "out"), train_only="positional",
                    distill_from="original")
    assert deepspeed_plugin(view).zero_stage == 3
