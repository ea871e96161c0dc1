"""The benchmark scripts (benchmarks/): they run on tiny settings and write what they say."""

from __future__ import annotations

from tool_helpers import load_script


def test_decode_benchmark_runs_and_reports_ratios(tmp_path):
    run = load_script("benchmarks/bench_rope_cache.py").run

    report = run(lengths=(16, 48), window=32, layers=1, new_tokens=2, output_dir=tmp_path)
    assert set(report["ratio_to_native"]) == {"native rope", "yarn", "dynamic, exact_cache=False",
                                              "dynamic, exact_cache=True"}
    assert report["ratio_to_native"]["native rope"] == {16: 1.0, 48: 1.0}
    assert (tmp_path / "results.json").exists() and (tmp_path / "decode_time.png").stat().st_size > 0
