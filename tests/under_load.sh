#!/bin/sh
# The flake check: the whole suite N times in a row (default 10) while two CPU hogs keep both
# cores busy beside it. Every run must pass. Logs: $TMPDIR/switchboard-under-load/run-N.log.
#   sh tests/under_load.sh [N] [pytest arguments...]
set -u
n=${1:-10}
[ $# -gt 0 ] && shift
logs="${TMPDIR:-/tmp}/switchboard-under-load"
mkdir -p "$logs"
python3 -c 'while True: pass' & hog1=$!
python3 -c 'while True: pass' & hog2=$!
trap 'kill $hog1 $hog2 2>/dev/null' EXIT INT TERM
passed=0
i=1
while [ "$i" -le "$n" ]; do
    start=$(date +%s)
    if pytest -q "$@" > "$logs/run-$i.log" 2>&1; then
        passed=$((passed + 1))
        result=passed
    else
        result=FAILED
    fi
    echo "run $i: $result in $(($(date +%s) - start)) s: $(tail -n 1 "$logs/run-$i.log")"
    grep -E '^(FAILED|ERROR) ' "$logs/run-$i.log" | sed 's/^/    /'
    i=$((i + 1))
done
echo "$passed of $n runs passed (2 CPU hogs beside each)"
[ "$passed" -eq "$n" ]
