"""The benchmark scripts (benchmarks/): they run on tiny settings and write what they say."""

from __future__ import annotations

import json

import pytest
import torch

from tool_helpers import load_script


def test_decode_benchmark_runs_and_reports_ratios(tmp_path):
    run = load_script("benchmarks/bench_rope_cache.py").run

    report = run(lengths=(16, 48), window=32, layers=1, new_tokens=2, output_dir=tmp_path)
    assert set(report["ratio_to_native"]) == {"native rope", "yarn", "dynamic, exact_cache=False",
                                              "dynamic, exact_cache=True"}
    assert report["ratio_to_native"]["native rope"] == {16: 1.0, 48: 1.0}
    assert (tmp_path / "results.json").exists() and (tmp_path / "decode_time.png").stat().st_size > 0


def test_attention_benchmark_rows_name_the_path_that_served(tmp_path):
    """A row asked for "flash" on a machine where flash cannot serve (no CUDA) times the blocked path, and says so;
    native RoPE never enters hf_posenc's attention path."""
    bench = load_script("benchmarks/bench_attention.py")
    rows = bench.run_benchmark(lengths=[16], methods=["alibi"], paths=("blocked", "flash"), layers=1, heads=2,
                               head_dim=8, repeats=1, backward_repeats=1, mode="last-logit", progress=False)
    served = {(r.method, r.requested_path): r.path for r in rows}
    assert served == {("rope (native)", "sdpa"): "sdpa", ("alibi", "blocked"): "blocked",
                      ("alibi", "flash"): "blocked"}
    assert all(r.served_calls.get("flash", 0) == 0 for r in rows)
    assert "| alibi | blocked (flash asked) | 16 |" in bench.format_table(rows)
    written = bench.save(rows, tmp_path)
    assert written["json"].stat().st_size > 0 and written["png"].stat().st_size > 0


def test_attention_benchmark_training_mode_times_a_loss_over_every_position(monkeypatch):
    """Train mode runs a loss over every position (the logits of every position are computed), methods take options,
    and memory is measured in a pass after all the timings."""
    bench = load_script("benchmarks/bench_attention.py")
    logits_kept, order = [], []
    real_time, real_memory = bench.measure_time, bench.measure_memory
    monkeypatch.setattr(bench, "measure_time", lambda *a, **k: order.append("time") or real_time(*a, **k))
    monkeypatch.setattr(bench, "measure_memory", lambda *a, **k: order.append("memory") or real_memory(*a, **k))
    rows = bench.run_benchmark(lengths=[16], methods=["t5", "alibi:trainable=true"], layers=1, heads=2,
                               head_dim=8, repeats=1, backward_repeats=1, mode="train", progress=False)
    assert [r.method for r in rows] == ["rope (native)", "t5", "alibi:trainable=true"]
    assert order == ["time"] * 3 + ["memory"] * 3
    assert all(r.mode == "train" and r.forward_backward_peak_mib == r.forward_backward_peak_mib for r in rows)
    # rows carry the table backward's measured plan (attention.tuned_choices); 16 keys fit one candidate tile, where
    # every plan is the same and none is measured (test_table_attention.py checks the measured picks)
    assert all(isinstance(r.tuned, dict) for r in rows) and all(r.tuned == {} for r in rows)
    model = bench.build_model(1, 2, 8, 16)
    forward, _ = bench.step_functions(model, torch.randint(0, 256, (1, 16)), "train")
    model.register_forward_hook(lambda module, args, output: logits_kept.append(output.logits.shape[1]))
    forward()
    assert logits_kept == [16]
    with pytest.raises(ValueError, match="mode"):
        bench.run_benchmark(lengths=[16], methods=["t5"], mode="inference", progress=False)


def test_rescale_every_benchmark_counts_one_replay_per_bucket(tmp_path):
    run = load_script("benchmarks/bench_rescale_every.py").run

    report = run(every=(1, 8), window=32, prompt=32, new_tokens=16, layers=1, output_dir=tmp_path)
    replays = {name: row["replays"] for name, row in report["rows"].items()}
    assert replays == {"native rope": 0, "dynamic, rescale_every=1": 16, "dynamic, rescale_every=8": 2}
    assert report["rows"]["native rope"]["ratio_to_native"] == 1.0
    assert (tmp_path / "results.json").exists()


def test_finetune_benchmark_times_the_finetune_step_beside_native(tmp_path, monkeypatch):
    """Every case runs hf-posenc finetune's own training step (the optimizer moves the weights), native first, and
    each row's throughput ratio is to native's at the same length and checkpointing."""
    bench = load_script("benchmarks/bench_finetune.py")
    from hf_posenc.tools import finetune

    steps = []
    real_step = finetune.training_step
    monkeypatch.setattr(finetune, "training_step", lambda *a, **k: steps.append(a[2].shape) or real_step(*a, **k))
    rows = bench.run_benchmark(lengths=[32], methods=["t5"], layers=1, steps=1, checkpointing=(False, True),
                               progress=False)
    assert [(r.method, r.checkpointing) for r in rows] == [("native", False), ("t5", False), ("native", True),
                                                         ("t5", True)]
    assert steps and all(shape == (1, 32) for shape in steps)
    assert [r.throughput_ratio for r in rows if r.method == "native"] == [1.0, 1.0]
    assert all(r.peak_mib > 0 and r.tokens_per_s > 0 for r in rows)
    # the paths over the timed step (1 layer): native's attention is not ours; the checkpointed step runs the forward
    # again in the backward
    assert [(r.method, r.checkpointing, r.paths, r.refused) for r in rows] == [
        ("native", False, {}, []), ("t5", False, {"blocked": 1}, []), ("native", True, {}, []),
        ("t5", True, {"blocked": 2}, [])]
    assert "| t5 | 32 | yes |" in bench.format_table(rows) and bench.format_table(rows).endswith("| blocked 2 |")
    assert bench.paths_cell(bench.Row("t5", 32, False, 1.0, 32.0, refused=["..."])) == "- (a kernel refused)"
    assert bench.save(rows, tmp_path)["png"].stat().st_size > 0
    assert "rope" not in bench.default_methods() and "alibi:trainable=true" in bench.default_methods()


def test_finetune_benchmark_times_the_compiled_step_beside_the_uncompiled_one(tmp_path):
    """--compile: each case also runs with the prepared model under torch.compile, its step checked by the fine-tune
    against the uncompiled model in the warm-up; ratios to the compiled native row and to the same method
    uncompiled. With fullgraph, a method that cannot be traced as one graph is refused there and timed uncompiled."""
    bench = load_script("benchmarks/bench_finetune.py")
    rows = bench.run_benchmark(lengths=[32], methods=["kerple", "fox"], layers=1, steps=1, checkpointing=(False,),
                               progress=False, memory=False, compile_with="aot_eager:fullgraph")
    assert [(r.method, r.compiled) for r in rows] == [
        (method, compiled) for method in ("native", "kerple", "fox") for compiled in ("", "aot_eager:fullgraph")]
    assert all(r.error == "" and r.tokens_per_s > 0 for r in rows)
    checks = {r.method: r.compiled_step for r in rows if r.compiled}
    assert checks["native"]["served"] and checks["kerple"]["served"]
    assert not checks["fox"]["served"] and "'fox'" in checks["fox"]["error"]
    assert all(r.compiled_step is None for r in rows if not r.compiled)
    native_compiled = rows[1]
    assert native_compiled.throughput_ratio == 1.0
    assert native_compiled.compile_speedup == native_compiled.tokens_per_s / rows[0].tokens_per_s
    table = bench.format_table(rows)
    assert "| fox | 32 | no | aot_eager:fullgraph (refused: uncompiled) |" in table
    assert "| kerple | 32 | no | aot_eager:fullgraph | " in table
    assert bench.save(rows, tmp_path)["png"].stat().st_size > 0


def test_finetune_benchmark_paired_ratios_step_native_before_each_timed_step(monkeypatch):
    """--paired: every timed step of a method follows one of native's (same setting, the model kept), and the row's
    ratio is the median of native's time over the method's per pair; native's steps do not count in the method's
    attention paths."""
    bench = load_script("benchmarks/bench_finetune.py")
    from hf_posenc.tools import finetune

    order = []
    real_step = finetune.training_step
    monkeypatch.setattr(finetune, "training_step",
                        lambda args, prepared, *a, **k: order.append(id(prepared)) or real_step(args, prepared, *a, **k))
    rows = bench.run_benchmark(lengths=[32], methods=["t5", "kerple"], layers=1, steps=3, checkpointing=(False,),
                               progress=False, memory=False, paired=True)
    assert [r.method for r in rows] == ["native", "t5", "kerple"]
    native_id = order[0]
    # native: warm-up + 3; each method: its warm-up, then (native, method) three times
    assert order[4] != native_id and order[5:11:2] == [native_id] * 3 and native_id not in order[6:11:2]
    assert order[11] != native_id and order[12:18:2] == [native_id] * 3
    for row in rows[1:]:
        assert len(row.pair_ratios) == 3 and all(r > 0 for r in row.pair_ratios)
        assert row.throughput_ratio == sorted(row.pair_ratios)[1]
        assert row.paths == {"blocked": 3}
    assert rows[0].pair_ratios == [] and rows[0].throughput_ratio == 1.0


def test_finetune_benchmark_runs_the_methods_under_the_attention_path_asked(monkeypatch):
    """--attention-path: the methods' rows run under it (stick-breaking's blocks on the compiled path, here with the
    eager chain standing in for the compiled one, so that the test does not compile) and say so; afterwards the
    process's path is what it was."""
    bench = load_script("benchmarks/bench_finetune.py")
    from hf_posenc import attention as engine

    from hf_posenc.engine.attention import compiled_content

    monkeypatch.setattr(compiled_content, "_compiled_block_output", engine.content_block_output)
    engine.reset_kernel_status()
    rows = bench.run_benchmark(lengths=[32], methods=["stick-breaking"], layers=1, steps=1, checkpointing=(False,),
                               progress=False, memory=False, path="compiled")
    engine.reset_kernel_status()
    assert [(r.method, r.attention_path, r.error) for r in rows] == [("native", "compiled", ""),
                                                                     ("stick-breaking", "compiled", "")]
    assert rows[1].paths["compiled content"] == rows[1].paths["content"] == 1
    assert engine.get_attention_path() == "auto"


def test_finetune_benchmark_records_a_failing_case_and_goes_on(tmp_path, monkeypatch):
    """A method that raises gets a row naming its error; the cases after it are still measured, and every row so far
    reaches on_row (a run cut short by a time limit keeps what it measured)."""
    bench = load_script("benchmarks/bench_finetune.py")
    from hf_posenc.tools.runtime import MethodRequest

    real_apply = MethodRequest.apply

    def apply(self, model):
        if self.name == "kerple":
            raise RuntimeError("CUDA out of memory (planted)")
        return real_apply(self, model)

    monkeypatch.setattr(MethodRequest, "apply", apply)
    seen = []
    rows = bench.run_benchmark(lengths=[32], methods=["kerple", "t5"], layers=1, steps=1, checkpointing=(False,),
                               progress=False, on_row=lambda so_far: seen.append(len(so_far)))
    assert [r.method for r in rows] == ["native", "kerple", "t5"]
    failed = rows[1]
    assert failed.error == "RuntimeError: CUDA out of memory (planted)" and failed.tokens_per_s != failed.tokens_per_s
    assert rows[2].error == "" and rows[2].tokens_per_s > 0 and rows[2].peak_mib > 0
    assert seen[:3] == [1, 2, 3]
    assert "| kerple | 32 | no | failed: RuntimeError" in bench.format_table(rows)
    assert json.loads(bench.save(rows, tmp_path, plot=False)["json"].read_text())[1]["error"].startswith("Runtime")


def test_attention_benchmark_hands_every_row_to_on_row():
    bench = load_script("benchmarks/bench_attention.py")
    seen = []
    rows = bench.run_benchmark(lengths=[16], methods=["t5"], layers=1, heads=2, head_dim=8, repeats=1,
                               backward_repeats=1, progress=False, on_row=lambda so_far: seen.append(len(so_far)))
    assert seen == [1, 2, 2, 2] and all(r.device == "cpu" for r in rows)


def test_rotation_benchmark_writes_its_rows_to_the_output_dir(tmp_path):
    bench = load_script("benchmarks/bench_rotations.py")
    bench.main(["--lengths", "16", "--repeats", "1", "--backward-repeats", "1", "--output-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_rotations.json").read_text())
    assert rows[0]["method"] == "native RoPE"
    assert {row["method"] for row in rows[1:]} == {method for method, _ in bench.CASES}
    assert all(row["forward_ratio"] > 0 for row in rows[1:])


def test_every_benchmark_names_its_output_folder_as_the_tools_do():
    """--output-dir everywhere (a new user tripped on bench_attention's --out)."""
    from tool_helpers import REPO

    for script in sorted((REPO / "benchmarks").glob("*.py")):
        source = script.read_text()
        assert '"--output-dir"' in source, script.name
        assert '"--output"' not in source and '"--out"' not in source, script.name


def test_long_context_benchmark_writes_every_method_beside_native(tmp_path):
    """benchmarks/long_context_smollm2.py on a tiny LLaMA (window 64): perplexity past the window with one row per
    method, passkey trials per method, and prefill/decode timings whose native rows have ratio 1."""
    from tool_helpers import BOOK, save_tiny_model

    bench = load_script("benchmarks/long_context_smollm2.py")
    model = str(save_tiny_model(tmp_path / "tiny"))
    methods = ["none", "yarn:factor=2", "self-extend", "rerope", "sinks"]
    run = bench.run_ppl(model, methods, [64, 128], tmp_path / "ppl", text_file=str(BOOK), progress=False)
    table = run.table()
    assert set(table) == {"tiny", *(f"tiny + {m}" for m in methods[1:])}
    assert all(set(row) == {64, 128} and all(v > 1 for v in row.values()) for row in table.values())
    # sinks (4 + 60) is the unpatched model within the trained window, and differs from it past the window
    assert table["tiny + sinks"][64] == pytest.approx(table["tiny"][64], rel=1e-5)
    assert table["tiny + sinks"][128] != pytest.approx(table["tiny"][128], rel=1e-6)
    assert (tmp_path / "ppl" / "perplexity.png").stat().st_size > 0
    more = bench.run_ppl(model, ["rerope"], [64], tmp_path / "ppl2", text_file=str(BOOK), progress=False)
    merged = bench.merge_ppl([tmp_path / "ppl", tmp_path / "ppl2"], tmp_path / "merged").table()
    assert merged["tiny + rerope"] == {64: more.table()["tiny + rerope"][64], 128: table["tiny + rerope"][128]}

    accuracy = bench.run_passkey(model, ["none", "rerope"], [300], [0.5], 1, tmp_path / "pk", max_new_tokens=2,
                                 progress=False)
    assert set(accuracy) == {("tiny", 300, 0.5), ("tiny + rerope", 300, 0.5)}
    assert json.loads((tmp_path / "pk" / "passkey.json").read_text())["settings"]["lengths"] == [300]

    data = bench.run_timing(model, ["rerope", "sinks"], [16, 96], 2, tmp_path / "t", text_file=str(BOOK),
                            progress=False)
    rows = {(r["method"], r["length"]): r for r in data["rows"]}
    assert set(rows) == {(m, n) for m in ("none", "rerope", "sinks") for n in (16, 96)}
    assert rows[("none", 96)]["prefill_ratio"] == 1.0 and rows[("none", 16)]["decode_ratio"] == 1.0
    assert all(r["prefill_s"] > 0 and r["decode_ms_per_token"] > 0 for r in rows.values())
    assert (tmp_path / "t" / "timing.png").stat().st_size > 0 and (tmp_path / "t" / "timing.csv").exists()


def test_recipe_benchmark_appends_a_row_with_its_curve_and_plots_it(tmp_path):
    """benchmarks/bench_recipes.py on a tiny LLaMA: a distillation run of a hybrid with PoSE records its held-out
    perplexity, its loss per step and a perplexity-vs-tokens point per evaluation; a second run appends its row."""
    from tool_helpers import save_tiny_model

    bench = load_script("benchmarks/bench_recipes.py")
    model = str(save_tiny_model(tmp_path / "tiny"))
    common = ["--model", model, "--lengths", "64", "--windows", "1", "--threads", "1", "--output-dir", str(tmp_path)]
    bench.main(["--recipe", "distill", "--method", "kerple:layers=last:1+yarn:factor=2,layers=rest", "--steps", "2",
                "--max-length", "32", "--distill-alpha", "1", "--pose-target-length", "128", "--eval-blocks", "2",
                "--eval-every", "1", *common])
    bench.main(["--recipe", "original", "--max-length", "32", "--eval-blocks", "2", *common])
    rows = json.loads((tmp_path / "bench_recipes.json").read_text())
    assert [r["recipe"] for r in rows] == ["distill", "original"] and rows[0]["model"] == model
    distill = rows[0]
    assert distill["pose_target_length"] == 128 and distill["distill_alpha"] == 1 and len(distill["loss"]) == 2
    assert distill["eval_blocks"] == rows[1]["eval_blocks"] == 2
    assert [(c["step"], c["tokens"]) for c in distill["curve"]] == [(1, 32), (2, 64)]
    assert all(c["perplexity"] > 1 for c in distill["curve"]) and distill["perplexity"]["64"] > 1
    # the untrained model on the same held-out blocks: the curve's point at 0 tokens
    assert rows[1]["steps"] == 0 and rows[1]["perplexity"]["64"] > 1
    [start] = rows[1]["curve"]
    assert (start["step"], start["tokens"]) == (0, 0) and start["perplexity"] > 1
    assert (tmp_path / "bench_recipes.png").stat().st_size > 1000


def test_flex_options_benchmark_times_compiled_flex_against_causal_sdpa(tmp_path):
    """The CPU has no flex backward: the row times the forward of the real compiled flex (one compile) against causal
    SDPA, with no table gradient to compare; an unknown option set is an error naming the known ones."""
    bench = load_script("benchmarks/bench_flex_options.py")
    rows = bench.run("cpu", lengths=[64], dtypes=["float32"], options=["default"], heads=4, kv_heads=2, head_dim=16,
                     repeats=1, progress=False)
    assert len(rows) == 1 and not rows[0].error, rows[0].error
    assert rows[0].seconds > 0 and rows[0].x_native == rows[0].seconds / rows[0].native_s
    assert rows[0].table_gradient_error is None
    assert "| default | float32 | 64 |" in bench.format_table(rows)
    written = bench.save(rows, tmp_path)
    assert json.loads(written["json"].read_text())[0]["options"] == "default" and written["png"].stat().st_size > 0
    with pytest.raises(SystemExit):
        bench.main(["--options", "fastest", "--device", "cpu"])


def test_fused_cpu_benchmark_times_the_kernels_beside_the_blocks_and_native(tmp_path):
    """One round at 32 tokens: every row was served by the fused kernel (its calls counted) and carries the per-layer
    times of native, fused and blocked, their ratios and the kernel's time against causal SDPA."""
    bench = load_script("benchmarks/bench_fused_cpu.py")
    methods = ["stick-breaking", "cope:max_pos=8", "self-extend:window=8,group=2"]
    rows = bench.run(methods, lengths=[32], rounds=1, progress=False)
    assert [row.method for row in rows] == methods
    for row in rows:
        assert row.fused_calls == 1  # one layer, one timed round
        assert row.fused_x_native == row.native_s / row.fused_s and row.blocked_x_native == row.native_s / row.blocked_s
        assert row.kernel_s > 0 and row.kernel_x_sdpa == row.kernel_s / row.sdpa_s
    assert "| cope:max_pos=8 | 32 |" in bench.format_table(rows)
    written = bench.save(rows, tmp_path)
    assert json.loads(written["json"].read_text())[1]["method"] == "cope:max_pos=8" and written["png"].stat().st_size


def test_engine_benchmark_times_every_engine_beside_ddp(tmp_path):
    """benchmarks/bench_engines.py on 2 CPU processes: a row per engine, DDP's ratio 1, the sharded engines'
    estimated state below DDP's, the table and the plot written."""
    bench = load_script("benchmarks/bench_engines.py")
    result = bench.main(["--hidden", "64", "--layers", "2", "--vocab", "256", "--length", "32", "--batch", "1",
                         "--warmup", "1", "--steps", "1", "--rounds", "2", "--output-dir", str(tmp_path)])
    rows = {row["engine"]: row for row in result["rows"]}
    assert list(rows) == list(bench.ENGINES)
    assert rows["ddp"]["x_ddp"] == 1.0 and all(len(row["rounds"]) == 2 for row in rows.values())
    assert all(row["seconds_per_step"] > 0 and row["x_ddp"] > 0 for row in rows.values())
    ddp_state = rows["ddp"]["estimated_state_mib_per_process"]
    assert all(rows[e]["estimated_state_mib_per_process"] < ddp_state for e in ("zero2", "zero3", "fsdp2"))
    assert json.loads((tmp_path / "bench_engines.json").read_text())["rows"] == result["rows"]
    assert (tmp_path / "bench_engines.png").stat().st_size > 0
