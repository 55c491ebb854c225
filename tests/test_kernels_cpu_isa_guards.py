"""The C++ CPU kernels build for every x86-64 CPU: each AVX-512 or AVX intrinsic sits inside a preprocessor
block that the matching ISA macro guards.

Why a source check and not a build per target: -march=native compiles only the host's branch, and a build for
another target costs minutes (the torch headers). An unguarded _mm512_ store (cpu_gemm_vnni.cpp's fill_rows) once
broke the whole module on an AVX2-only CPU (AMD Zen 3), and every caller fell back to the slow torch paths.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "kernels" / "csrc"

# What a use needs: an enclosing condition that names this macro prefix.
NEEDS = [(re.compile(r"\b_mm512_\w+|\b__m512\w*"), "__AVX512"),
         (re.compile(r"\b_mm256_\w+|\b__m256\w*"), "__AVX")]
DIRECTIVE = re.compile(r"#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*)")
FLAG = re.compile(r"#\s*define\s+(\w+)(\s+1)?\s*$")  # a project macro that stands for its block's condition
NEGATED = "!"


def unguarded(text: str, aliases: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """(line number, line) of each intrinsic use that no ISA condition encloses; `aliases` (macro -> the condition
    it stands for) gathers the flags the text defines, on top of those given (a header's)."""
    stack: list[str] = []
    aliases = {} if aliases is None else aliases
    bad = []
    for no, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        directive = DIRECTIVE.match(stripped)
        if directive:
            kind, cond = directive.group(1), directive.group(2)
            for name, meaning in aliases.items():
                cond = re.sub(rf"\b{name}\b", meaning, cond)
            if kind in ("if", "ifdef"):
                stack.append(cond)
            elif kind == "ifndef":
                stack.append(NEGATED)
            elif kind == "elif":
                stack[-1] = cond
            elif kind == "else":
                stack[-1] = NEGATED  # the other side of a guard is no guard
            else:
                stack.pop()
            continue
        flag = FLAG.match(stripped.split("//", 1)[0].rstrip())  # a define with its comment too
        if flag:
            aliases[flag.group(1)] = " && ".join(c for c in stack if c != NEGATED)
        code = line.split("//", 1)[0]
        for pattern, macro in NEEDS:
            if pattern.search(code) and not any(macro in c for c in stack if c != NEGATED):
                bad.append((no, stripped))
    return bad


def sources() -> list[Path]:
    return sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])


def header_flags() -> dict[str, str]:
    aliases: dict[str, str] = {}
    for header in sorted(CSRC.glob("*.h")):
        unguarded(header.read_text(), aliases)
    return aliases


@pytest.mark.parametrize("path", sources(), ids=lambda p: p.name)
def test_every_wide_intrinsic_is_guarded(path):
    assert unguarded(path.read_text(), header_flags()) == []


def test_the_check_finds_what_broke_the_avx2_build():
    # fill_rows as it was: an AVX-512 store in a function every x86-64 build compiles.
    broken = "void fill() {\n  _mm512_stream_si512(d, _mm512_loadu_si512(s));\n}\n"
    assert [no for no, _ in unguarded(broken)] == [2]
    elif_avx2 = "#if defined(__AVX512F__)\n_mm512_setzero_ps();\n#elif defined(__AVX__)\n_mm256_setzero_ps();\n" \
                "#else\n_mm256_setzero_ps();\n#endif\n"
    assert [no for no, _ in unguarded(elif_avx2)] == [6]
    aliased = "#if defined(__AVX2__)\n#define HAS_AVX2 1\n#endif\n#ifdef HAS_AVX2\n__m256 v;\n#endif\n__m256 w;\n"
    assert [no for no, _ in unguarded(aliased)] == [7]
    commented = aliased.replace("HAS_AVX2 1\n", "HAS_AVX2 1  // why\n")
    assert [no for no, _ in unguarded(commented)] == [7]
