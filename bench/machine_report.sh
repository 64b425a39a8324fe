#!/usr/bin/env bash
# Every figure the README gives per machine kind, measured on this machine in one go, one job at a time (two
# CPU-heavy jobs on two cores would make both numbers worthless), each from an empty user cache as a fresh
# machine would have it:
#   1. the test suite (pytest, `--durations=15`; the E5 recall index built afresh: SISRL_TEST_E5_CACHE=0);
#   2. the demo (`python -m sisrl.trainer.demo`: model conversions, index, warm start, RL and evals);
#   3. index build speed with and without length sorting, and in Search-R1's batches of 512 (bench/encode_sort.py
#      on 512 passages, 2 runs each: ~6 minutes on the AVX2-only EPYC, where 1,024 x 3 would take ~19);
#   4. the retriever against the Search-R1 baseline, workloads (a)-(d) (bench/retriever.py, 30 s each).
# Run it on an otherwise idle machine after `make install`; ~35-45 minutes on a 2-core AVX2-only EPYC.
#   bench/machine_report.sh [OUT]      # default OUT: runs/machine-report-<UTC date and time>
#   STEPS="encode_sort retriever" bench/machine_report.sh   # only those steps (default: all four, in this order)
# OUT gets one log per step and report.md: the CPU, its flags, each step's wall time and its key lines.
set -uo pipefail
cd "$(dirname "$0")/.."
steps=" ${STEPS:-pytest demo encode_sort retriever} "
for s in $steps; do
    case "$s" in
        pytest|demo|encode_sort|retriever) ;;
        *) echo "bench/machine_report.sh: unknown step '$s' in STEPS (pytest, demo, encode_sort, retriever)" >&2
           exit 2 ;;
    esac
done
wanted() { [[ "$steps" == *" $1 "* ]]; }
out="${1:-runs/machine-report-$(date -u +%Y%m%dT%H%M%S)}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
py=.venv/bin/python
if [ ! -x "$py" ]; then
    echo "bench/machine_report.sh: no .venv here; run \`make install\` first" >&2
    exit 2
fi
report="$out/report.md"
flags="$(grep -m1 -o -w -E 'avx2|avx512[a-z_0-9]*|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
{
    echo "# Machine report, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null)"
    echo
    echo "CPU: $($py -c 'from sisrl.common.hardware import cpu_model; print(cpu_model())'), $(nproc) cores"
    echo "SIMD flags: ${flags:-none}"
    if [ -n "${SISRL_AS_AVX2_REAL_CPU:-}" ]; then
        echo "**Through bench/as_avx2.sh**: the lines above are what the commands saw; the machine is" \
             "${SISRL_AS_AVX2_REAL_CPU} (flags: ${SISRL_AS_AVX2_REAL_FLAGS:-none})"
    fi
    echo "load before start: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
} > "$report"


step() {  # step NAME COMMAND...: run it, keep its log, note its wall time and exit status
    local name="$1"
    shift
    echo "== $name: $*" >&2
    local started=$SECONDS
    "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "## $name: exit $rc, $((SECONDS - started)) s" >> "$report"
    echo '```' >> "$report"
    echo "$*" >> "$report"
    echo '```' >> "$report"
    return 0
}

keep() {  # keep NAME PATTERN: the log's lines matching PATTERN, into the report
    echo '```' >> "$report"
    grep -E "$2" "$out/$1.log" | tail -n 40 >> "$report"
    echo '```' >> "$report"
    echo >> "$report"
}

if wanted pytest; then
    step pytest env SISRL_CACHE="$out/cache-test" SISRL_TEST_E5_CACHE=0 \
        $py -m pytest --durations=15 -p no:cacheprovider -q
    keep pytest '^[0-9.]+s (setup|call|teardown)|passed|failed|error'
fi
if wanted demo; then
    step demo env SISRL_CACHE="$out/cache-demo" $py -m sisrl.trainer.demo --workdir "$out/demo"
    keep demo '^(stage|before|after_sft|after_rl|train reward|checkpoint|CPU)'
fi
if wanted encode_sort; then
    step encode_sort $py bench/encode_sort.py --passages 512 --repeats 2
    keep encode_sort '^\||^CPU|passages|cosine'
fi
if wanted retriever; then
    # the bench's 3,000-passage index, built with the defaults (dtype and backend `auto`)
    step bench_index bash -c "$py bench/subset_corpus.py --out '$out/bench3k.jsonl' && \
        $py -m sisrl.retriever.cli build --corpus '$out/bench3k.jsonl' --out '$out/bench3k'"
    step retriever $py bench/retriever.py --index "$out/bench3k" --seconds 30 --json-out "$out/retriever.json"
    keep retriever '^workload|^\(|^ +(sisrl|baseline) |^CPU|^peak RSS|GFLOP|recall'
fi

rm -rf "$out/cache-test" "$out/cache-demo"
echo "report: $report" >&2
