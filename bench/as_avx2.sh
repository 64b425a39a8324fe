#!/usr/bin/env bash
# Run a command the way an AVX2-only CPU would run sisrl, on a machine with AVX-512 or AMX:
#   bench/as_avx2.sh .venv/bin/python -m sisrl.trainer.demo
# - /proc/cpuinfo, as the command sees it, has no avx512*/amx* flags, so sisrl's `--dtype auto` picks fp32
#   (common/hardware.py reads those flags);
# - torch's own kernels, oneDNN and MKL are capped at AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
#   MKL_ENABLE_INSTRUCTIONS).
# It does not make the cores, caches or memory slower: use it for ratios between variants of one run, and write
# the real CPU model beside any figure. ONNX Runtime and FAISS pick their kernels from cpuid and are not capped.
# Needs root (a private mount namespace: `unshare -m`, then a bind mount over /proc/cpuinfo).
set -euo pipefail
if [ "$#" -eq 0 ]; then
    echo "usage: bench/as_avx2.sh COMMAND [ARGS...]" >&2
    exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "bench/as_avx2.sh: needs root for unshare -m and the bind mount over /proc/cpuinfo" >&2
    exit 2
fi
# What the command cannot read any more, for reports that must name the real machine (bench/machine_report.sh).
SISRL_AS_AVX2_REAL_CPU="$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), family \
$(grep -m1 '^cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' ') model $(grep -m1 '^model\s*:' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')"
SISRL_AS_AVX2_REAL_FLAGS="$(grep -m1 -o -w -E 'avx2|avx512[a-z_0-9]*|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
export SISRL_AS_AVX2_REAL_CPU SISRL_AS_AVX2_REAL_FLAGS
fake="$(mktemp /tmp/cpuinfo-avx2.XXXXXX)"
trap 'rm -f "$fake"' EXIT
sed -E 's/ (avx512[a-z_0-9]*|amx[a-z_0-9]*)//g' /proc/cpuinfo > "$fake"
unshare -m bash -c 'mount --bind "$0" /proc/cpuinfo && ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
    MKL_ENABLE_INSTRUCTIONS=AVX2 "$@"' "$fake" "$@"
