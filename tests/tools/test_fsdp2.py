"""FSDP2 (torch's ``fully_shard``) on a patched model, on the CPU: two gloo processes shard a tiny LLaMA patched with
KERPLE (learned biases), with FoX (content-dependent gates) and with KERPLE in one layer (a hybrid) along
``fsdp_wrap_units``, train a few AdamW steps on halves of a fixed batch, and must match one unsharded process on the
whole batch; their full state dict, saved with ``save_pretrained``, reloads with ``hf_posenc.from_pretrained`` to the
sharded model's logits.

accelerate's FSDP plugin refuses a CPU-only machine, so this goes through torch's API directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tool_helpers import REPO, free_port

import hf_posenc
from hf_posenc.tools.finetune import fsdp_wrap_units

# a learned bias, a content method, and a hybrid: KERPLE in layer 1 beside the model's own RoPE in layer 0
METHODS = {"kerple": {}, "fox": {}, "kerple-in-layer-1": {"layers": [1]}}
STEPS, BATCH, LENGTH, LR = 3, 4, 16, 1e-2
# The same float32 arithmetic summed in another order (a reduce-scatter of two half-batch gradients, then AdamW on
# shards): measured within 1.1e-7 of one process over these steps, and Adam's step normalisation may amplify such
# differences; 1e-4 is far below what a fault moves (each rank training on its half alone: 3e-2 to 7e-2).
RELATIVE = 1e-4


def patched(method: str):
    from tiny_models import tiny_model

    model = tiny_model("llama")
    torch.manual_seed(0)  # methods with randomly initialised parameters start the same in every process
    return hf_posenc.patch_model(model, method.split("-")[0], **METHODS[method]).train()


def fixed_batch() -> torch.Tensor:
    from tiny_models import random_ids

    return random_ids(BATCH, LENGTH, seed=3)


def train(model, ids: torch.Tensor) -> list[float]:
    """AdamW steps on `ids` (a process's part of the batch); each step's loss on that part."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def positional_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "posenc" in k}


def sharded_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    ids = fixed_batch()
    results = {}
    for method in METHODS:
        model = patched(method)
        units = fsdp_wrap_units(model)
        for unit in units:
            fully_shard(unit, mesh=mesh)
        positional = hf_posenc.get_positional_module(model)
        sharded = all(isinstance(p, DTensor) for p in positional.parameters())
        in_a_layer = any(m is positional for layer in units[:-1] for m in layer.modules())
        losses = train(model, ids.chunk(world)[rank])
        for loss in losses:
            dist.all_reduce(loss)  # each process's mean over an equal half; their mean is the whole batch's
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            saved = Path(out) / method
            model.save_pretrained(saved, state_dict=full)
            torch.save(logits, saved / "sharded_logits.pt")
            results[method] = {"losses": [loss.item() / world for loss in losses], "units": len(units),
                               "positional_sharded": sharded, "positional_in_a_layer": in_a_layer}
        dist.barrier()
    if rank == 0:
        (Path(out) / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("fsdp2")
    mp.spawn(sharded_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("method", list(METHODS))
def test_fsdp2_trains_like_one_process_and_its_full_state_dict_reloads(sharded_run, method):
    out, results = sharded_run
    result = results[method]
    # the units: the 2 decoder layers, then the root, which holds the positional module shared by the layers
    assert result["units"] == 3 and result["positional_sharded"] and not result["positional_in_a_layer"]

    model = patched(method)
    before = positional_state(model)
    reference = [loss.item() for loss in train(model, fixed_batch())]
    assert reference[-1] < reference[0] - 0.05  # it trains at all, so equal losses say something
    assert result["losses"] == pytest.approx(reference, rel=RELATIVE)

    reloaded = hf_posenc.from_pretrained(out / method)
    assert hf_posenc.get_posenc_config(reloaded).to_dict() == hf_posenc.get_posenc_config(model).to_dict()
    trained = positional_state(reloaded)
    assert trained.keys() == before.keys() and trained
    assert all(not torch.allclose(trained[k], before[k]) for k in before)  # the positional parameters moved
    for key, value in positional_state(model).items():  # and as far as in one process
        torch.testing.assert_close(trained[key], value, rtol=RELATIVE, atol=1e-6)
    with torch.no_grad():
        logits = reloaded.eval()(input_ids=fixed_batch()).logits
    torch.testing.assert_close(logits, torch.load(out / method / "sharded_logits.pt"), rtol=0, atol=1e-6)


def test_fsdp_yaml_asks_accelerate_for_fsdp2(tmp_path):
    """What accelerate's FSDP plugin reads from the launcher that fsdp.yaml configures (built in the launched
    processes, as the fine-tune's Accelerator builds it; FSDP version 1 refused this CPU: sync_module_states)."""
    script = tmp_path / "plugin.py"
    script.write_text("import os\nfrom accelerate.utils import FullyShardedDataParallelPlugin\n"
                      "p = FullyShardedDataParallelPlugin()\nif os.environ['RANK'] == '0':\n"
                      "    print('plugin', p.fsdp_version, p.reshard_after_forward, p.auto_wrap_policy.__name__,"
                      " p.state_dict_type.name)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(REPO / "scripts/accelerate_configs/fsdp.yaml"), "--num_processes", "2",
                           "--main_process_port", str(free_port()), str(script)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plugin 2 True transformer_auto_wrap_policy FULL_STATE_DICT" in done.stdout


def test_fsdp_wrap_units_refuses_a_model_without_layer_classes():
    with pytest.raises(hf_posenc.PosEncError, match="_no_split_modules; call fully_shard on each"):
        fsdp_wrap_units(torch.nn.Linear(2, 2))


def test_finetune_launched_with_fsdp_yaml_runs_fsdp2_on_gpus(device, tmp_path):
    """`accelerate launch --config_file fsdp.yaml -m hf_posenc finetune` on every GPU of the machine (one is enough:
    accelerate's FSDP launcher wraps even one process) trains a patched tiny LLaMA under FSDP2 as one plain process
    with the same global batch trains it, records the engine, and saves a full model that reloads with its patch.
    On a CPU-only machine accelerate's FSDP refuses, which test_finetune's
    test_fsdp_config_on_a_cpu_only_machine_says_what_to_use checks; this runs under `--device cuda`
    (scripts/gpu_checks.sh)."""
    if device.type != "cuda":
        pytest.skip("FSDP2 through accelerate needs GPUs: run with --device cuda (scripts/gpu_checks.sh)")
    from tool_helpers import BOOK, launch, run_cli, save_tiny_model

    tiny = save_tiny_model(tmp_path / "tiny-llama")
    processes = torch.cuda.device_count()
    args = ["--model", str(tiny), "--method", "kerple", "--text-file", str(BOOK), "--text-fraction", "0:0.8",
            "--max-length", "64", "--lr", "3e-3", "--max-steps", "4", "--train-only", "all",
            "--mixed-precision", "no", "--no-progress"]
    done = launch("finetune", [*args, "--batch-size", "1", "--output-dir", str(tmp_path / "fsdp")],
                  num_processes=processes, config="fsdp.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert run_cli("finetune", [*args, "--batch-size", str(processes), "--output-dir", str(tmp_path / "one")]) == 0

    summary = json.loads((tmp_path / "fsdp" / "training_args.json").read_text())
    assert summary["distributed_type"].endswith("FSDP") and summary["engine"] == "fsdp2"
    log, one_log = (json.loads((tmp_path / d / "loss_log.json").read_text()) for d in ("fsdp", "one"))
    assert [e["loss"] for e in log] == pytest.approx([e["loss"] for e in one_log], rel=RELATIVE)
    reloaded, one = (hf_posenc.from_pretrained(tmp_path / d) for d in ("fsdp", "one"))
    assert hf_posenc.get_posenc_config(reloaded).to_dict() == summary["posenc_config"]
    ids = fixed_batch()
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(input_ids=ids).logits, one.eval()(input_ids=ids).logits,
                                   rtol=0, atol=1e-3)


@pytest.mark.parametrize("version, recorded", [(1, "fsdp1"), (2, "fsdp2")])
def test_training_args_record_the_fsdp_version_that_ran(version, recorded):
    """A config without `fsdp_version: 2` runs accelerate's FSDP version 1: training_args.json says so."""
    from types import SimpleNamespace

    from hf_posenc.tools.finetune.prepare import engine_of

    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(name="FSDP"),
                                  state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=version)))
    assert engine_of(accelerator) == recorded
