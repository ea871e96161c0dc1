"""Patched checkpoints: save_pretrained / from_pretrained round trip for every method on every family, native
checkpoints in plain transformers, standalone checkpoints without hf_posenc, refusal of tampered configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_posenc
from hf_posenc import PosEncError
from hf_posenc.checkpoints.export import export_checkpoint, main as export_main
from tiny_models import FAMILIES, random_ids, tiny_model

CASES = [(family, method) for family in FAMILIES for method in hf_posenc.available_methods()]


def patch_as_users_would(model, method):
    """Default options (trainable where the method can be, a factor where one is required); a RoPE scaling on a
    model without RoPE goes on top of a `rope` patch. None when the method does not apply to the family."""
    spec = hf_posenc.get_method(method)
    options = {"trainable": True} if "trainable" in spec.config_class.option_names() else {}
    names = spec.config_class.option_names()
    if "short_factor" in names:  # LongRoPE: one factor per rotary frequency (head_dim 16 -> 8)
        options.update(short_factor=[1.0] * 8, long_factor=[1.5 + i / 8 for i in range(8)])
    attempts = [options, {**options, "factor": 2.0}]
    if "original_max_position_embeddings" in names:  # BLOOM's config states no trained window
        attempts.append({**options, "factor": 2.0, "original_max_position_embeddings": 64})
    for prepare in (None, "rope"):
        for attempt in attempts:
            try:
                if prepare:
                    hf_posenc.patch_model(model, prepare)
                return hf_posenc.patch_model(model, method, **attempt)
            except PosEncError:
                continue
    hf_posenc.unpatch_model(model)
    return None


def perturb_positional_state(model):
    """Move every positional parameter and float buffer off its initial value, so only a checkpoint that really
    carries them can reproduce the logits."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for tensor in hf_posenc.get_positional_module(model).state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator).to(tensor.dtype))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family, method -> (directory, input ids, reference logits, config); every checkpoint saved standalone."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    ids = random_ids(2, 9)
    for family, method in CASES:
        model = patch_as_users_would(tiny_model(family), method)
        if model is None:
            continue
        perturb_positional_state(model)
        with torch.no_grad():
            logits = model(ids).logits
        directory = root / f"{family}-{method}"
        model.save_pretrained(directory, standalone=True)
        torch.save({"ids": ids, "logits": logits}, directory / "reference.pt")
        out[family, method] = (directory, ids, logits, hf_posenc.get_posenc_config(model))
    # A checkpoint saved without standalone=True, then exported by the command.
    model = hf_posenc.patch_model(tiny_model("gpt2"), "alibi", trainable=True)
    perturb_positional_state(model)
    model.save_pretrained(root / "plain")
    assert export_main([str(root / "plain"), str(root / "exported")]) == 0
    with torch.no_grad():
        torch.save({"ids": ids, "logits": model(ids).logits}, root / "exported" / "reference.pt")
    out["exported", "alibi"] = (root / "exported", ids, model(ids).logits.detach(), hf_posenc.get_posenc_config(model))
    return out


def case(saved, family, method):
    if (family, method) not in saved:
        pytest.skip(f"{method} does not apply to {family} (patch_model raises PosEncError)")
    return saved[family, method]


def test_every_method_is_saved_on_the_llama_family(saved):
    assert {m for f, m in saved if f == "llama"} == set(hf_posenc.available_methods())
    assert ("exported", "alibi") in saved
    assert {"alibi", "nope", "rope", "sinusoidal", "learned"} <= {m for f, m in saved if f == "gpt2"}


@pytest.mark.parametrize("family,method", CASES)
def test_round_trip_gives_identical_logits(saved, family, method):
    directory, ids, logits, config = case(saved, family, method)
    metadata = json.loads((directory / "posenc_config.json").read_text())
    assert metadata["method"] == method and metadata["hf_posenc_version"] == hf_posenc.__version__
    assert metadata["model"]["num_heads"] == 4 and metadata["model"]["model_type"] == family
    model = hf_posenc.from_pretrained(directory)
    assert hf_posenc.get_posenc_config(model) == config
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


# What plain transformers computes itself on a LLaMA model (every other method needs hf_posenc or exported code).
NATIVE_ON_LLAMA = ["dynamic", "linear", "llama3", "longrope", "ntk", "rope", "yarn"]


@pytest.mark.parametrize("method", NATIVE_ON_LLAMA)
def test_native_checkpoints_load_in_plain_transformers(saved, method):
    directory, ids, logits, _ = case(saved, "llama", method)
    model = AutoModelForCausalLM.from_pretrained(directory)  # no hf_posenc, no remote code
    assert type(model).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        assert (model(ids).logits - logits).abs().max().item() <= 1e-5


def test_which_checkpoints_are_native(saved):
    native = {(f, m) for (f, m), (d, *_) in saved.items() if f != "exported"
              if json.loads((d / "posenc_config.json").read_text())["native"]}
    assert {m for f, m in native if f == "llama"} == set(NATIVE_ON_LLAMA)
    assert not {(f, m) for f, m in native if f != "llama"}


CHILD = textwrap.dedent('''
    import importlib.abc, json, sys

    class HideHfPosenc(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_posenc" or name.startswith("hf_posenc."):
                raise ImportError("hf_posenc is hidden in this test")

    sys.meta_path.insert(0, HideHfPosenc())
    import torch
    from transformers import AutoModelForCausalLM

    results = {}
    for directory in sys.argv[1:]:
        reference = torch.load(directory + "/reference.pt")
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
        with torch.no_grad():
            diff = (model(reference["ids"]).logits - reference["logits"]).abs().max().item()
        results[directory] = [type(model).__module__, diff]
    try:
        import hf_posenc  # noqa: F401
        results["hf_posenc importable"] = True
    except ImportError:
        results["hf_posenc importable"] = False
    print(json.dumps(results))
''')


def run_without_hf_posenc(directories, tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    result = subprocess.run([sys.executable, "-c", CHILD, *map(str, directories)], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_standalone_checkpoints_load_without_hf_posenc(saved, tmp_path):
    """Every saved (family, method) checkpoint, in one subprocess where `import hf_posenc` fails."""
    directories = [directory for directory, *_ in saved.values()]
    results = run_without_hf_posenc(directories, tmp_path)
    assert results.pop("hf_posenc importable") is False
    for directory in directories:
        module, diff = results[str(directory)]
        assert module.startswith("transformers_modules."), (directory, module)  # the checkpoint's own code ran
        assert diff <= 1e-6, (directory.name, diff)


def test_standalone_code_is_the_library_code_with_a_versioned_header(saved):
    directory, *_ = case(saved, "bloom", "alibi")
    config = json.loads((directory / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_posenc.PosEncBloomForCausalLM"
    copied = (directory / "posenc_methods_alibi.py").read_text()
    assert f"Generated by hf_posenc {hf_posenc.__version__} from hf_posenc/methods/alibi.py" in copied
    original = Path(hf_posenc.__file__).parent.joinpath("methods", "alibi.py").read_text()

    def body(text):  # everything but imports of hf_posenc modules and comment lines
        return [line for line in text.splitlines() if not line.lstrip().startswith(("from .", "#"))]

    assert body(copied) == body(original)
    assert not (directory / "posenc_methods_sinusoidal.py").exists()  # only what this checkpoint needs
    shipped = {p.stem for p in directory.glob("posenc_*.py")}
    library_only = {"posenc_train", "posenc_evaluate", "posenc_passkey", "posenc_pipeline", "posenc_runtime",
                    "posenc_demo", "posenc_data", "posenc_text", "posenc_patching", "posenc_checkpoints_loading",
                    "posenc_checkpoints_hub", "posenc_checkpoints_export", "posenc_checkpoints_model_card"}
    assert not shipped & library_only, shipped & library_only
    # the engine's closure for one method: about 2,500 lines since the kernel guard joined the attention path
    assert sum(len(p.read_text().splitlines()) for p in directory.glob("*.py")) < 3000


def test_export_command(saved, tmp_path):
    """The exported checkpoint itself is loaded without hf_posenc in test_standalone_checkpoints_load_without_hf_posenc."""
    exported = saved["exported", "alibi"][0]
    assert (exported / "modeling_posenc.py").exists()
    assert not (exported.parent / "plain" / "modeling_posenc.py").exists()  # the source is left as it was
    assert export_main([str(tmp_path / "nowhere")]) == 2
    assert export_main([str(exported.parent / "plain"), str(exported)]) == 2  # never writes into a full directory


def test_no_checkpoint_code_runs_without_trust_remote_code(saved, tmp_path):
    directory, ids, logits, _ = case(saved, "llama", "alibi")
    marker = tmp_path / "code-ran"
    modeling = directory / "modeling_posenc.py"
    original = modeling.read_text()
    modeling.write_text(original + f"\nopen({str(marker)!r}, 'w').close()\n")
    try:
        plain = AutoModelForCausalLM.from_pretrained(directory)
        ours = hf_posenc.from_pretrained(directory, trust_remote_code=True)
    finally:
        modeling.write_text(original)
    assert not marker.exists()
    assert type(plain).__name__ == "LlamaForCausalLM" and hf_posenc.get_posenc_config(plain) is None
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, logits)


# --- what is saved -----------------------------------------------------------------------------------------
def test_weights_a_patch_removed_are_saved_so_unpatching_the_reloaded_model_works(tmp_path):
    original = tiny_model("gpt2")
    ids = random_ids(1, 8)
    with torch.no_grad():
        before = original(ids).logits
    hf_posenc.patch_model(original, "alibi")  # replaces wpe
    original.save_pretrained(tmp_path)
    reloaded = hf_posenc.unpatch_model(hf_posenc.from_pretrained(tmp_path))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, before)


def test_sharded_checkpoint_round_trip(tmp_path):
    model = hf_posenc.patch_model(tiny_model("llama"), "learned")
    perturb_positional_state(model)
    ids = random_ids(1, 8)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    with torch.no_grad():
        assert torch.equal(hf_posenc.from_pretrained(tmp_path)(ids).logits, model(ids).logits)


def test_unpatch_removes_the_save_hook(tmp_path):
    model = hf_posenc.patch_model(tiny_model("llama"), "alibi")
    assert "save_pretrained" in model.__dict__
    hf_posenc.unpatch_model(model)
    assert "save_pretrained" not in model.__dict__
    model.save_pretrained(tmp_path)
    assert not (tmp_path / "posenc_config.json").exists()
    assert hf_posenc.get_posenc_config(hf_posenc.from_pretrained(tmp_path)) is None  # a plain checkpoint


def test_base_model_is_recorded_and_carried_through_a_reload(tmp_path):
    model = hf_posenc.patch_model(tiny_model("llama"), "nope")
    model.save_pretrained(tmp_path / "a", base_model="acme/tiny-llama", base_model_revision="abc123")
    hf_posenc.from_pretrained(tmp_path / "a").save_pretrained(tmp_path / "b")
    metadata = json.loads((tmp_path / "b" / "posenc_config.json").read_text())
    assert (metadata["base_model"], metadata["base_model_revision"]) == ("acme/tiny-llama", "abc123")


# --- tampered or mismatching posenc_config.json ---------------------------------------------------------------
@pytest.fixture
def alibi_checkpoint(tmp_path):
    model = hf_posenc.patch_model(tiny_model("llama"), "alibi", trainable=True)
    model.save_pretrained(tmp_path)
    return tmp_path


def edit_metadata(directory, change):
    path = directory / "posenc_config.json"
    metadata = json.loads(path.read_text())
    change(metadata)
    path.write_text(json.dumps(metadata))


@pytest.mark.parametrize("change,message", [
    (lambda m: m.update(method="wobble"), "Unknown positional method 'wobble'"),
    (lambda m: m["options"].update(slope_scale=2), "Unknown option(s) 'slope_scale'"),
    (lambda m: m["options"].update(slopes="steep"), "slopes='steep'"),
    (lambda m: m["model"].update(num_heads=8), "num_heads: 8 in posenc_config.json, 4 in the model"),
    (lambda m: m["model"].update(model_type="gpt2"), "model_type"),
    (lambda m: m["model"].update(num_layers=2.0), "num_layers: 2.0 in posenc_config.json, 2 in the model"),
    (lambda m: m.update(format_version=99), "format_version 99"),
    (lambda m: m.update(format_version=True), "format_version True; this hf_posenc"),
    (lambda m: m.update(format_version=-100), "format_version -100; this hf_posenc"),
    (lambda m: m.update(format_version=0), "format_version 0; this hf_posenc"),
    (lambda m: m.update(format_version=1.0), "format_version 1.0; this hf_posenc"),
    (lambda m: m["options"].update(trainable=1), "AlibiConfig.trainable=1 is not a bool"),
    (lambda m: m["options"].update(slopes=[True, False, True, False]), "AlibiConfig.slopes=[True, False, True, False]"),
    (lambda m: m["positional_state"]["model.posenc.slopes"].update(shape=[8]),
     "Positional weight model.posenc.slopes: 'alibi' with these options needs shape (4,); posenc_config.json "
     "records (8,) and the weights file holds (4,)"),
    (lambda m: m.update(applied_after=[{"method": "rope", "options": {}}]),
     "applied_after lists ['rope'], but 'alibi' with these options builds on nothing"),
    (lambda m: m["positional_state"].clear(), "lists positional weights []"),
    (lambda m: m.pop("options"), "'options' is missing"),
])
def test_tampered_posenc_config_is_refused(alibi_checkpoint, change, message):
    edit_metadata(alibi_checkpoint, change)
    with pytest.raises(PosEncError, match=__import__("re").escape(message)):
        hf_posenc.from_pretrained(alibi_checkpoint)


def test_malformed_posenc_config_is_refused(alibi_checkpoint):
    (alibi_checkpoint / "posenc_config.json").write_text("{not json")
    with pytest.raises(PosEncError, match="Cannot read"):
        hf_posenc.from_pretrained(alibi_checkpoint)


def test_missing_learned_weights_are_refused(alibi_checkpoint):
    weights = alibi_checkpoint / "model.safetensors"
    state = load_file(weights)
    del state["model.posenc.slopes"]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(PosEncError, match=r"lacks the positional weights \['model.posenc.slopes'\]"):
        hf_posenc.from_pretrained(alibi_checkpoint)


def test_standalone_loader_refuses_tampering_too(alibi_checkpoint):
    from hf_posenc.checkpoints.export import write_standalone_code
    from hf_posenc.checkpoints.metadata import read_metadata

    write_standalone_code(None, alibi_checkpoint, read_metadata(alibi_checkpoint / "posenc_config.json"))
    edit_metadata(alibi_checkpoint, lambda m: m["model"].update(num_heads=8))
    with pytest.raises(ValueError, match="num_heads: 8 in posenc_config.json"):
        AutoModelForCausalLM.from_pretrained(alibi_checkpoint, trust_remote_code=True)


def test_a_deep_copy_saves_itself_not_the_original(tmp_path):
    import copy

    model = hf_posenc.patch_model(tiny_model("gpt2"), "rope")
    hf_posenc.patch_model(model, "learned", init="normal", init_std=0.5)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.base_model.posenc.weight.add_(1.0)
    twin.save_pretrained(tmp_path)
    loaded = hf_posenc.from_pretrained(tmp_path).eval()
    ids = random_ids(1, 10)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, twin.eval()(ids).logits)
        assert not torch.equal(loaded(ids).logits, model.eval()(ids).logits)


# --- refusing before building: a few edited bytes must not make the loader allocate gigabytes -------------------
MEMORY_PROBE = textwrap.dedent('''
    import json, resource, sys
    import hf_posenc

    hf_posenc.from_pretrained(sys.argv[1])  # a normal load first: the peak so far covers the model itself
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        hf_posenc.from_pretrained(sys.argv[2])
        error = None
    except hf_posenc.PosEncError as refused:
        error = str(refused)
    print(json.dumps([error, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024]))
''')


def load_measuring_peak_memory(reference: Path, directory: Path) -> tuple[str | None, float]:
    """(the refusal or None, growth of the peak resident memory in MB) of loading `directory` in a fresh process
    that loaded `reference` first (ru_maxrss is a process-wide high-water mark, so one process per load)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(hf_posenc.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(reference), str(directory)], capture_output=True,
                            text=True, env=env, cwd=directory, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return tuple(json.loads(result.stdout.strip().splitlines()[-1]))


def tampered_copy(source: Path, target: Path, change) -> Path:
    import shutil

    shutil.copytree(source, target)
    edit_metadata(target, change)
    return target


def test_edited_shapes_are_refused_before_anything_is_allocated(tmp_path):
    """Each edit implies hundreds of megabytes of positional state (FIRE's MLP, T5's table, a replayed learned
    table) that the checkpoint does not hold; the peak memory of the refusal must stay near nothing (measured in a
    fresh process)."""
    fire = hf_posenc.patch_model(tiny_model("llama"), "fire")
    fire.save_pretrained(tmp_path / "fire")
    hf_posenc.patch_model(fire, "t5")
    fire.save_pretrained(tmp_path / "t5")

    def wide_mlp_everywhere(m):  # options and recorded shapes agree; only the weights file disagrees
        m["options"]["mlp_width"] = 3_000_000
        for key, entry in m["positional_state"].items():
            entry["shape"] = [3_000_000 if size == 32 else size for size in entry["shape"]]

    cases = {  # directory -> the refusal expected
        tampered_copy(tmp_path / "fire", tmp_path / "wide-mlp", lambda m: m["options"].update(mlp_width=3_000_000)):
            "'fire' with these options needs shape (2, 3000000); posenc_config.json records (2, 32)",
        tampered_copy(tmp_path / "fire", tmp_path / "wide-mlp-everywhere", wide_mlp_everywhere):
            "records (2, 3000000) and the weights file holds (2, 32)",
        tampered_copy(tmp_path / "t5", tmp_path / "many-buckets", lambda m: m["options"].update(
            num_buckets=2 ** 24, max_distance=2 ** 24)):
            "needs shape (1, 16777216, 4)",
        tampered_copy(tmp_path / "t5", tmp_path / "long-history", lambda m: m.update(
            applied_after=[{"method": "learned", "options": {"max_positions": 1_000_000, "init": "normal"}}])):
            "applied_after lists ['learned'], but 't5' with these options builds on nothing",
    }
    for directory, expected in cases.items():
        error, growth_mb = load_measuring_peak_memory(tmp_path / "fire", directory)
        assert error is not None and expected in error, (directory.name, error)
        assert growth_mb < 40, (directory.name, growth_mb)


def test_history_keeps_only_what_the_patch_builds_on(tmp_path):
    gpt2 = tiny_model("gpt2")
    window = {"original_max_position_embeddings": 32}
    for method, options in [("learned", {}), ("alibi", {}), ("rope", {"theta": 500.0}),
                            ("yarn", {"factor": 2.0, **window}), ("linear", {"factor": 2.0, **window})]:
        hf_posenc.patch_model(gpt2, method, **options)
    gpt2.save_pretrained(tmp_path / "gpt2")
    metadata = json.loads((tmp_path / "gpt2" / "posenc_config.json").read_text())
    # the linear scaling scales the RoPE of the patch it replaced: only that RoPE's theta is replayed
    assert metadata["applied_after"] == [{"method": "rope", "options": {"theta": 500.0}}]
    ids = random_ids(1, 40)
    with torch.no_grad():
        assert torch.equal(hf_posenc.from_pretrained(tmp_path / "gpt2")(ids).logits, gpt2(ids).logits)

    llama = tiny_model("llama")
    for method in ("alibi", "learned", "rope", "t5"):
        hf_posenc.patch_model(llama, method)
    llama.save_pretrained(tmp_path / "llama")
    assert json.loads((tmp_path / "llama" / "posenc_config.json").read_text())["applied_after"] == []


@pytest.mark.parametrize("architecture", ["__doc__", "pipeline", "AutoModelForCausalLM", "LlamaModel",
                                          "GPT2LMHeadModel", "PreTrainedModel", 7, None])
def test_export_accepts_only_the_causal_lm_class_of_the_model_type(alibi_checkpoint, tmp_path, architecture):
    edit_metadata(alibi_checkpoint, lambda m: m["model"].update(architecture=architecture))
    with pytest.raises(PosEncError, match=r"Standalone export extends the causal-LM class of the checkpoint's model "
                                          r"type; .* for model_type 'llama' that class is LlamaForCausalLM"):
        export_checkpoint(alibi_checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written
    assert export_main([str(alibi_checkpoint)]) == 2
    assert not (alibi_checkpoint / "modeling_posenc.py").exists()
