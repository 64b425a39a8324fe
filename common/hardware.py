"""Dtype by hardware: bf16 only where it is native, fp32 elsewhere (docs/design.md, "Defaults").

A CPU without native bf16 emulates it, and there bf16 is several times slower than fp32, while a CPU with
AMX-BF16 runs bf16 faster than fp32 (figures: docs/results.md). So `auto` looks at the device and the CPU's
flags, never at a guess.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
# /proc/cpuinfo flags that mean bf16 matrix work runs in hardware (Intel AMX tiles; AVX-512 BF16 dot products).
NATIVE_BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's `flags` line of /proc/cpuinfo; empty where there is none (macOS, Windows)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def choose_dtype(requested: str, device: str, flags: frozenset[str] | None = None) -> str:
    """`requested` if explicit; for `auto`: `bfloat16` on CUDA and on CPUs with native bf16, else `float32`.

    `device` is a resolved torch device string (`cpu`, `cuda`, `cuda:1`, `mps`). `flags` defaults to this
    machine's CPU flags. ValueError names an unknown dtype.
    """
    if requested not in DTYPE_NAMES:
        raise ValueError(f"dtype: unknown dtype {requested!r}, expected one of {DTYPE_NAMES}")
    if requested != "auto":
        return requested
    if device.startswith("cuda"):
        return "bfloat16"
    if device == "cpu":
        native = NATIVE_BF16_CPU_FLAGS & (cpu_flags() if flags is None else flags)
        return "bfloat16" if native else "float32"
    return "float32"


def resolve_dtype(requested: str, device: str, *, what: str) -> str:
    """`choose_dtype` on this machine, logged with the reason; `what` names the model for the log line."""
    chosen = choose_dtype(requested, device)
    if requested == "auto":
        native = sorted(NATIVE_BF16_CPU_FLAGS & cpu_flags()) if device == "cpu" else []
        reason = (f"CPU flags {native}" if native else "no amx_bf16/avx512_bf16 CPU flag") if device == "cpu" \
            else f"device {device}"
        logger.info("%s dtype auto -> %s (%s)", what, chosen, reason)
    return chosen


def cpu_fields(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first CPU's block of /proc/cpuinfo as {field: value} (`vendor_id`, `cpu family`, `flags`, ...); {} when
    it cannot be read."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() and fields:
            break  # the first CPU's block only
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's `model name`, family/model and vector ISA, for the line printed beside every benchmark figure.

    e.g. `AMD EPYC (family 25 model 17; AVX-512, native bf16: avx512_bf16)`. Machines sold under one model name
    differ (an AVX2-only EPYC and an AVX-512 one both report `AMD EPYC`), and their figures are not comparable.
    """
    fields = cpu_fields(cpuinfo)
    if not fields:
        return "unknown CPU"
    flags = frozenset(fields.get("flags", fields.get("Features", "")).split())
    parts = []
    if "cpu family" in fields and "model" in fields:
        parts.append(f"family {fields['cpu family']} model {fields['model']}")
    if flags:
        isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
        native = sorted(NATIVE_BF16_CPU_FLAGS & flags)
        parts.append(f"{isa}, " + (f"native bf16: {', '.join(native)}" if native else "no native bf16"))
    name = fields.get("model name", "unknown CPU")
    return f"{name} ({'; '.join(parts)})" if parts else name
