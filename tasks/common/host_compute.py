"""What this host's CPU computes fast: whether it has bf16 matrix units, read from the CPU's own flags.

bf16 matmul runs ~10x fp32 on CPUs with AMX (oneDNN's AMX kernels) and faster than fp32 with AVX512-BF16, but
slower than fp32 on AVX2-only CPUs (bf16 is converted in software there). Hosts of one kind differ, so the
trainer's `precision: auto` asks here instead of assuming, and every throughput figure carries these facts.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

CPUINFO = Path("/proc/cpuinfo")
#: CPU flags that give native bf16 matrix arithmetic (Linux /proc/cpuinfo names).
BF16_MATMUL_FLAGS: tuple[str, ...] = ("amx_bf16", "avx512_bf16")
#: Flags worth reporting beside a figure: the vector and matrix units the kernels choose between.
REPORTED_FLAGS: tuple[str, ...] = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_fp16")


@dataclass(frozen=True)
class HostCompute:
    """The CPU facts a throughput figure depends on."""

    cpu_model: str
    flags: tuple[str, ...]          # the REPORTED_FLAGS this CPU has
    torch_cpu_capability: str       # the vector ISA torch's own kernels dispatch to
    threads: int

    @property
    def native_bf16_matmul(self) -> bool:
        return any(flag in self.flags for flag in BF16_MATMUL_FLAGS)

    def as_record(self) -> dict[str, Any]:
        """For reports, the checkpoint contract and MLflow tags."""
        return {**asdict(self), "flags": list(self.flags), "native_bf16_matmul": self.native_bf16_matmul}

    def describe(self) -> str:
        """One line to print beside a measured figure."""
        units = "bf16 matmul units" if self.native_bf16_matmul else "no bf16 matmul units"
        return (f"{self.cpu_model}; flags {' '.join(self.flags) or 'none of ' + ' '.join(REPORTED_FLAGS)}; "
                f"torch {torch.__version__} ({self.torch_cpu_capability}), {self.threads} threads; {units}")


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo's text (every core of a host is alike)."""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model or platform.machine(), flags


@lru_cache(maxsize=1)
def host_compute() -> HostCompute:
    """This host's facts (read once per process). A host without /proc/cpuinfo reports no flags: fp32 is chosen."""
    text = CPUINFO.read_text(encoding="utf-8", errors="replace") if CPUINFO.is_file() else ""
    model, flags = parse_cpuinfo(text)
    return HostCompute(cpu_model=model, flags=tuple(flag for flag in REPORTED_FLAGS if flag in flags),
                       torch_cpu_capability=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads())
