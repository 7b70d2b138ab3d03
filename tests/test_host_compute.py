"""`training.precision: auto` reads the CPU's own flags: bf16 where it has bf16 matrix units, fp32 elsewhere."""

from __future__ import annotations

import pytest
import torch

from tasks.common import devices
from tasks.common.host_compute import HostCompute, host_compute, parse_cpuinfo

AMX_HOST = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
AVX2_HOST = """processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse2 avx avx2 fma
"""


def host(text: str) -> HostCompute:
    model, flags = parse_cpuinfo(text)
    return HostCompute(cpu_model=model, flags=tuple(sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_tile",
                                                                       "amx_bf16"})),
                       torch_cpu_capability="AVX512", threads=2)


def test_the_cpu_flags_say_whether_bf16_matmul_is_native() -> None:
    amx, avx2 = host(AMX_HOST), host(AVX2_HOST)
    assert amx.cpu_model == "Intel(R) Xeon(R) Platinum 8480+" and amx.native_bf16_matmul
    assert avx2.cpu_model == "AMD EPYC 7B12" and not avx2.native_bf16_matmul
    assert "no bf16 matmul units" in avx2.describe() and "amx_bf16" in amx.describe()
    assert amx.as_record()["native_bf16_matmul"] is True


@pytest.mark.parametrize("text, expected", [(AMX_HOST, torch.bfloat16), (AVX2_HOST, torch.float32)])
def test_auto_precision_follows_the_host(monkeypatch: pytest.MonkeyPatch, text: str, expected: torch.dtype) -> None:
    monkeypatch.setattr(devices, "host_compute", lambda: host(text))
    cpu = torch.device("cpu")
    assert devices.compute_dtype("auto", cpu) == expected
    assert devices.compute_dtype("fp32", cpu) == torch.float32 and devices.compute_dtype("bf16", cpu) == torch.bfloat16


def test_this_host_is_described_with_what_it_has() -> None:
    facts = host_compute()
    assert facts.threads >= 1 and facts.torch_cpu_capability
    assert set(facts.flags) <= {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_fp16"}
