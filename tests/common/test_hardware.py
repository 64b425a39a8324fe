"""`auto` dtype: bf16 only where it is native (CUDA, AMX / AVX512-BF16 CPUs), fp32 on AVX2-only CPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
from sisrl.common.hardware import choose_dtype, cpu_flags, cpu_model

# The flags lines (abridged) of this project's two machine kinds: an AVX2-only AMD EPYC and an Intel Xeon with AMX.
AMD_EPYC_AVX2 = ("fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2 sha_ni vaes vpclmulqdq rdpid "
                 "fsrm")
INTEL_XEON_AMX = ("fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 avx512f avx512dq avx512bw avx512vl "
                  "avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8")
INTEL_AVX512_NO_BF16 = "fpu sse sse2 avx avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni"


def flags(line: str) -> frozenset[str]:
    return frozenset(line.split())


def test_avx2_only_cpu_gets_float32() -> None:
    assert choose_dtype("auto", "cpu", flags(AMD_EPYC_AVX2)) == "float32"
    assert choose_dtype("auto", "cpu", flags(INTEL_AVX512_NO_BF16)) == "float32"


def test_native_bf16_cpu_gets_bfloat16() -> None:
    assert choose_dtype("auto", "cpu", flags(INTEL_XEON_AMX)) == "bfloat16"
    assert choose_dtype("auto", "cpu", flags("avx2 avx512f avx512_bf16")) == "bfloat16"
    assert choose_dtype("auto", "cpu", flags("avx2 amx_bf16")) == "bfloat16"


def test_cuda_gets_bfloat16_and_other_devices_float32() -> None:
    assert choose_dtype("auto", "cuda", frozenset()) == "bfloat16"
    assert choose_dtype("auto", "cuda:1", frozenset()) == "bfloat16"
    assert choose_dtype("auto", "mps", flags(INTEL_XEON_AMX)) == "float32"


def test_an_explicit_dtype_is_kept_and_an_unknown_one_named() -> None:
    assert choose_dtype("bfloat16", "cpu", flags(AMD_EPYC_AVX2)) == "bfloat16"
    assert choose_dtype("float32", "cuda", frozenset()) == "float32"
    with pytest.raises(ValueError, match="'float64'"):
        choose_dtype("float64", "cpu", frozenset())


def test_cpu_flags_reads_the_flags_line(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {AMD_EPYC_AVX2}\n\n"
                       f"processor\t: 1\nflags\t\t: {AMD_EPYC_AVX2}\n")
    assert cpu_flags(cpuinfo) == flags(AMD_EPYC_AVX2)
    assert cpu_flags(tmp_path / "absent") == frozenset()


def test_cpu_model_names_family_isa_and_native_bf16(tmp_path: Path) -> None:
    # Two machines of this project both report `AMD EPYC`: the line tells them apart.
    def info(family: int, model: int, flag_line: str) -> Path:
        path = tmp_path / f"cpuinfo-{family}-{model}"
        block = f"processor\t: 0\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name\t: AMD EPYC\nflags\t\t: {flag_line}\n"
        path.write_text(block + "\n" + block.replace("processor\t: 0", "processor\t: 1"), encoding="utf-8")
        return path

    assert cpu_model(info(25, 1, AMD_EPYC_AVX2)) == "AMD EPYC (family 25 model 1; AVX2, no native bf16)"
    zen4 = "avx2 avx512f avx512_bf16 avx512_vnni"
    assert cpu_model(info(25, 17, zen4)) == "AMD EPYC (family 25 model 17; AVX-512, native bf16: avx512_bf16)"
    (tmp_path / "bare").write_text("model name\t: Some CPU\n", encoding="utf-8")
    assert cpu_model(tmp_path / "bare") == "Some CPU"
    assert cpu_model(tmp_path / "missing") == "unknown CPU"
