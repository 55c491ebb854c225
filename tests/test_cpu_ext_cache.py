"""The C++ ops' build cache (kernels/cpu_ext.py) is keyed by what -march=native compiles for: one CPU's build is
never imported on another (an AVX512-BF16 build dies of SIGILL on a CPU without it)."""

from __future__ import annotations

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
