"""hf_posenc.tools.machine: what a benchmark ran on (CPU model, vector capability, BLAS), and every benchmark script
records it in its JSON and table header (issue 56: one backward at 1.2x native on an AMD EPYC, 3-4x on an Intel Xeon)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from hf_posenc.tools.machine import blas_library, cpu_model, machine_description, machine_header

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_cpu_model_and_blas_are_read_from_their_sources():
    cpuinfo = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480C\nflags\t: fpu\n"
    assert cpu_model(cpuinfo) == "Intel(R) Xeon(R) Platinum 8480C"
    assert cpu_model("processor : 0\n")  # no model name: the platform's string, never empty
    config = ("  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605 for Intel(R) 64\n"
              "  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release\n")
    assert blas_library(config) == "MKL 2024.2"
    assert blas_library("  - Build settings: BLAS_INFO=open, BUILD_TYPE=Release\n") == "open"
    assert blas_library("nothing") == "unknown"


def test_machine_description_names_this_machine():
    description = machine_description()
    assert description["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert description["threads"] == torch.get_num_threads() and description["torch"] == torch.__version__
    assert description["blas"] == blas_library(torch.__config__.show())
    header = machine_header(description)
    assert description["cpu"] in header and description["cpu_capability"] in header and description["blas"] in header
    json.dumps(description)


def test_every_benchmark_script_records_the_machine():
    scripts = sorted(BENCHMARKS.glob("*.py"))
    assert len(scripts) > 5
    missing = [script.name for script in scripts
               if "machine_description()" not in script.read_text() and "machine_header(" not in script.read_text()]
    assert not missing, f"benchmarks without hf_posenc.tools.machine: {missing}"


def test_the_op_level_table_benchmark_writes_the_machine_and_the_measured_plan(tmp_path, monkeypatch):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_table_attention
    finally:
        sys.path.remove(str(BENCHMARKS))
    monkeypatch.setattr(bench_table_attention.table_attention, "KEY_TILE", 16)
    monkeypatch.setattr(sys, "argv", ["bench_table_attention.py", "--lengths", "64", "--runs", "1", "--plans", "all",
                                      "--fixed", "--output-dir", str(tmp_path)])
    bench_table_attention.main()
    rows = json.loads((tmp_path / "bench_table_attention.json").read_text())
    assert all(row["machine"] == machine_description() for row in rows)
    assert {row["case"] for row in rows} >= {"native (causal SDPA)", "table, measured plan",
                                              "sdpa blocks, bias as the mask"}
    (kind, picked), = rows[0]["measured_plan"].items()
    assert kind.startswith("table backward, cpu") and "key_tile=" in picked
