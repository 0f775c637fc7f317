#!/usr/bin/env bash
# specstate against SGLang 0.5.23 and vLLM 0.33.0, host cost per decode round, alternated.
#
#   benchmarks/run_host_comparison.sh [OUT_DIR]          (default: ./host-comparison)
#
# Five alternations (ROUNDS): each runs specstate's bench, then each peer, every (page, bs)
# once (300 timed rounds, after an untimed counting replay of the same draws); then each
# workload is merged per side (median of the five run medians, every run's median kept) and
# compared with `specstate bench compare`, for the bookkeeping figure and for bookkeeping +
# output hand-off; `benchmarks/host_tables.py OUT_DIR` prints the tables the docs carry.
# Every side runs under one launch model: each tensor operation of a round is counted and
# charged --launch-us (specstate: `--launch-model ops`, on its device path, `--device cpu:0`).
# Environment: SGLANG_VENV and VLLM_VENV name the peers' environments (built by
# benchmarks/peers/setup_sglang.sh and setup_vllm.sh; a peer whose venv is missing is skipped),
# SPECSTATE (default `specstate`), ROUNDS (5), WORKLOADS ("churn steady"), and EXTRA, options
# passed to every bench (e.g. "--iters 50 --batch-sizes 1,64"); each run's stderr goes to a .log
# beside its report. The load average is logged at the start, after every alternation and at
# the end (OUT_DIR/load.txt too).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${1:-./host-comparison}"
SGLANG_VENV="${SGLANG_VENV:-.peer-venvs/sglang}"
VLLM_VENV="${VLLM_VENV:-.peer-venvs/vllm}"
SPECSTATE="${SPECSTATE:-specstate}"
ROUNDS="${ROUNDS:-5}"
WORKLOADS="${WORKLOADS:-churn steady}"
read -r -a EXTRA <<<"${EXTRA:-}"
mkdir -p "$OUT"

peers=()
[ -x "$SGLANG_VENV/bin/python" ] && peers+=(sglang) || echo "no $SGLANG_VENV: SGLang skipped" >&2
[ -x "$VLLM_VENV/bin/python" ] && peers+=(vllm) || echo "no $VLLM_VENV: vLLM skipped" >&2
venv_of() { if [ "$1" = sglang ]; then echo "$SGLANG_VENV"; else echo "$VLLM_VENV"; fi; }
load() { echo "[$(date +%T)] load average $(cut -d' ' -f1-3 /proc/loadavg): $*" | tee -a "$OUT/load.txt"; }

echo "machine: $(nproc) CPUs, $(uname -m); command: $0 $*; EXTRA=${EXTRA[*]:-}" | tee "$OUT/load.txt"
load "start"
for workload in $WORKLOADS; do
    for ((i = 1; i <= ROUNDS; i++)); do
        echo "[$(date +%T)] $workload, alternation $i/$ROUNDS: specstate" >&2
        "$SPECSTATE" bench host "--$workload" --repeats 1 --launch-model ops --handoff \
            --device cpu:0 "${EXTRA[@]}" --json >"$OUT/specstate-$workload-$i.json" \
            2>"$OUT/specstate-$workload-$i.log"
        for peer in "${peers[@]}"; do
            echo "[$(date +%T)] $workload, alternation $i/$ROUNDS: $peer" >&2
            "$(venv_of "$peer")/bin/python" "$HERE/peers/${peer}_host.py" "--$workload" \
                --repeats 1 "${EXTRA[@]}" >"$OUT/$peer-$workload-$i.json" \
                2>"$OUT/$peer-$workload-$i.log"
        done
        load "$workload, alternation $i/$ROUNDS done"
    done
    for side in specstate "${peers[@]}"; do
        python3 "$HERE/merge_reports.py" "$OUT/$side-$workload.json" \
            $(for ((i = 1; i <= ROUNDS; i++)); do echo "$OUT/$side-$workload-$i.json"; done)
    done
    for peer in "${peers[@]}"; do
        for figure in total handoff; do
            echo
            echo "== $workload, $figure: specstate vs $peer ($ROUNDS alternations; medians of the run medians)"
            "$SPECSTATE" bench compare --figure "$figure" \
                "$OUT/specstate-$workload.json" "$OUT/$peer-$workload.json"
        done
    done
done
python3 "$HERE/host_tables.py" "$OUT" $WORKLOADS
echo
load "end"
