#!/usr/bin/env bash
# The headline figures of docs/results.md for this machine's kind, measured in one go, one job at a time (two
# CPU-heavy jobs on two cores would make both numbers worthless), each from an empty user cache as a fresh
# machine would have it; each step writes its record under bench/results/ (bench/record.py), then
# `.venv/bin/python bench/render_results.py` renders docs/results.md and the README's table from them:
#   1. the test suite (pytest, `--durations=15`; the E5 recall index built afresh: SISRL_TEST_E5_CACHE=0), as a
#      `test_suite` record (wall time, passed / failed / skipped);
#   2. the demo (bench/demo.py runs `python -m sisrl.trainer.demo`: model conversions, index, warm start, RL and
#      evals);
#   3. index build speed with and without length sorting, and in Search-R1's batches of 512 (bench/encode_sort.py
#      on 512 passages, 2 runs each: ~6 minutes on the AVX2-only EPYC, where 1,024 x 3 would take ~19);
#   4. the retriever against the Search-R1 baseline, workloads (a)-(d) (bench/retriever.py, 30 s each).
# Run it on an otherwise idle machine after `make install`; ~35-45 minutes on a 2-core AVX2-only EPYC.
#   bench/machine_report.sh [OUT]      # default OUT: runs/machine-report-<UTC date and time>
#   STEPS="encode_sort retriever" bench/machine_report.sh   # only those steps (default: all four, in this order)
# OUT gets one log per step and report.md: the CPU, its flags, each step's wall time and its key lines.
# Through bench/as_avx2.sh the records say so (kind x86-avx2, `emulated_on` the real machine).
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
    step_seconds=$((SECONDS - started))
    step_rc=$rc
    echo "## $name: exit $rc, $step_seconds s" >> "$report"
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

record_test_suite() {  # record_test_suite SECONDS EXIT_STATUS LOG: the pytest step as a test_suite record
    $py - "$@" <<'EOF'
import re
import sys

sys.path.insert(0, "bench")
from record import write_record

seconds, status, log = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
lines = [ln for ln in open(log, encoding="utf-8", errors="replace").read().splitlines() if re.search(r" in [0-9.]+s", ln)]
if not lines:
    sys.exit(f"bench/machine_report.sh: no pytest summary line in {log}; no test_suite record written")
counts = {kind.rstrip("s"): int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1])}
passed, failed, skipped, errors = (counts.get(k, 0) for k in ("passed", "failed", "skipped", "error"))
pytest_s = float(re.search(r" in ([0-9.]+)s", lines[-1]).group(1))
took = f"{int(pytest_s) // 60}m{int(pytest_s) % 60:02d}s"
write_record(
    bench="test_suite", title="The test suite",
    measures="Wall time of the whole test suite (pytest, every test on real servers, models and indexes) on this "
             "machine, from an empty user cache with the E5 recall index built afresh, as a fresh machine runs it "
             "(target: <= 10 minutes on 2 CPU cores); run by bench/machine_report.sh with nothing else running.",
    summary=f"pytest ran in {took}: {passed} passed, {skipped} skipped, {failed} failed, {errors} errors.",
    command="SISRL_CACHE=<empty> SISRL_TEST_E5_CACHE=0 .venv/bin/python -m pytest --durations=15 -p no:cacheprovider -q",
    figures={"pytest s": pytest_s, "step wall s": seconds, "passed": passed, "failed": failed, "skipped": skipped,
             "errors": errors, "exit status": status},
    baseline=None, notes="bench/machine_report.sh step 1; the slowest items are in its pytest.log",
    headline={"row": "Test suite (pytest), target <= 10 min", "rank": 7,
              "value": f"**{took}**, {passed} passed" + (f", {failed} failed" if failed else "") + " (empty cache)"})
EOF
}

if wanted pytest; then
    step pytest env SISRL_CACHE="$out/cache-test" SISRL_TEST_E5_CACHE=0 \
        $py -m pytest --durations=15 -p no:cacheprovider -q
    keep pytest '^[0-9.]+s (setup|call|teardown)|passed|failed|error'
    record_test_suite "$step_seconds" "$step_rc" "$out/pytest.log"
fi
if wanted demo; then
    step demo env SISRL_CACHE="$out/cache-demo" $py bench/demo.py --workdir "$out/demo"
    keep demo '^(stage|before|after_sft|after_rl|train reward|checkpoint|CPU|record)'
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
