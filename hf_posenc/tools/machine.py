"""What a benchmark ran on, for its JSON and its table header: a CPU figure holds on the CPU that measured it (the
table backward took 1.2x native on an AMD EPYC and 3-4x on an Intel Xeon before issue 56 found why)."""

from __future__ import annotations

import platform
import re

import torch


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name (Linux's /proc/cpuinfo, else the platform's processor string)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as handle:
                cpuinfo = handle.read()
        except OSError:
            cpuinfo = ""
    match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return match.group(1).strip() if match else (platform.processor() or platform.machine() or "unknown")


def blas_library(config: str | None = None) -> str:
    """The BLAS torch was built with, with its version where the build names one (torch.__config__.show())."""
    config = torch.__config__.show() if config is None else config
    mkl = re.search(r"Math Kernel Library Version ([^\s-]+)", config)
    if mkl:
        return f"MKL {mkl.group(1)}"
    blas = re.search(r"BLAS_INFO=([^,\s]+)", config)
    return blas.group(1) if blas else "unknown"


def machine_description() -> dict[str, str | int]:
    """The CPU model, its vector capability as torch uses it, the BLAS, torch's threads and version."""
    return {"cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "blas": blas_library(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def machine_header(description: dict | None = None) -> str:
    """One line for a table's header: `CPU: ... (AVX512), MKL 2024.2, 2 threads, torch 2.13.0+cpu`."""
    d = machine_description() if description is None else description
    return (f"CPU: {d['cpu']} ({d['cpu_capability']}), {d['blas']}, {d['threads']} threads, "
            f"torch {d['torch']}")
