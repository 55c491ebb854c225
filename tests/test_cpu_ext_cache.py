"""The C++ ops' build cache (kernels/cpu_ext.py) is keyed by what -march=native compiles for: one CPU's build is
never imported on another (an AVX512-BF16 build dies of SIGILL on a CPU without it)."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import pytest

from pagedcore.kernels import cpu_ext


def test_name_changes_with_the_cpu(monkeypatch):
    name = cpu_ext._name()
    assert name == cpu_ext._name()  # stable on one machine
    monkeypatch.setattr(cpu_ext, "_cpu_identity", lambda: b"vendor_id\t: Other\nflags\t\t: fpu sse2 avx2")
    assert cpu_ext._name() != name


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="Linux's /proc/cpuinfo")
def test_identity_is_this_cpus_flags():
    identity = cpu_ext._cpu_identity().decode()
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    assert flags in identity.splitlines()
    assert "model name" not in identity  # the marketing name says nothing -march=native uses


@pytest.mark.skipif(os.environ.get("PAGEDCORE_CPU_EXT") == "0" or shutil.which("c++") is None
                    or platform.machine() != "x86_64", reason="the ops are built on x86-64 where a compiler is")
def test_the_ops_build_on_this_cpu():
    # A failed build is only a warning to users (the torch paths compute the same, slowly), and the kernels' tests
    # skip without the module: here it fails, so CI on a CPU the sources do not build for goes red (an AVX-512
    # store outside its guard once left an AVX2-only CPU on the torch paths).
    assert cpu_ext.load() is not None


@pytest.mark.skipif(os.environ.get("PAGEDCORE_CPU_EXT") == "0" or shutil.which("c++") is None
                    or not Path("/proc/cpuinfo").exists(), reason="the ops are built where a compiler is (Linux)")
def test_the_greedy_head_builds_on_every_avx2_cpu():
    # Its fp32 kernel exists for AVX-512 BW + VNNI and for AVX2 + FMA (cpu_greedy_head_avx2.cpp); without it every
    # greedy step computes the whole fp32 LM head (its tests would only skip).
    line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    flags = set(line.split(":", 1)[1].split())
    if not ({"avx2", "fma"} <= flags or {"avx512bw", "avx512_vnni"} <= flags):
        pytest.skip("neither AVX2 + FMA nor AVX-512 BW + VNNI here")
    assert cpu_ext.load().greedy_head_supported()


def test_the_prefill_kernel_builds_on_every_avx2_cpu():
    # cpu_prefill_attention.cpp has AVX-512 and AVX2 + FMA tiles; without them prompts run torch's SDPA over a gathered
    # copy of K/V (~8% of a prompt step on an AVX2 Zen 3) and its tests only skip.
    line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    flags = set(line.split(":", 1)[1].split())
    if not ({"avx2", "fma"} <= flags or "avx512f" in flags):
        pytest.skip("neither AVX2 + FMA nor AVX-512 here")
    assert cpu_ext.load().paged_prefill_supported(64)
