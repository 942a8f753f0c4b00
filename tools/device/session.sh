#!/usr/bin/env bash
# A GPU session longer than one device call. The lent machine goes back 30 s after a call
# ends, taking whatever runs with it, so: `start` runs a command file in the background
# (setsid: it outlives the call) in the session folder, and `poll` (called back to back)
# waits up to N s for it, prints its progress and packs the folder into $OUT/session.tgz.
#   bash tools/device/session.sh start COMMANDS.sh   # in the call that installs the bundle
#   bash tools/device/session.sh poll 480            # N below the call's limit, then again
# COMMANDS.sh runs with bash, in the checkout, with SESSION set: write results under it
# (e.g. bench.py --results "$SESSION/h200.json" --log-dir "$SESSION/logs").
set -uo pipefail
SESSION=${SESSION:-/tmp/device-session}
case "${1:-}" in
start)
    [ -f "${2:-}" ] || { echo "usage: $0 start COMMANDS.sh"; exit 2; }
    mkdir -p "$SESSION"
    rm -f "$SESSION/DONE"
    # the paths travel as arguments, not inside the -c text: any name works
    (SESSION=$SESSION setsid nohup bash -c 'bash "$1"; echo $? >"$2/DONE"' _ "$2" "$SESSION" \
        >"$SESSION/out.log" 2>&1 </dev/null &)
    echo "started $2 at $(date -u +%T); output in $SESSION/out.log"
    ;;
poll)
    end=$((SECONDS + ${2:-60}))
    while [ $SECONDS -lt $end ] && [ ! -e "$SESSION/DONE" ]; do sleep 5; done
    tail -n 25 "$SESSION/out.log" | cut -c1-300
    if [ -e "$SESSION/DONE" ]; then echo "done, exit $(cat "$SESSION/DONE")"; else echo "running"; fi
    tar czf "${OUT:-/tmp}/session.tgz" -C "$(dirname "$SESSION")" "$(basename "$SESSION")"
    ;;
*)
    echo "usage: $0 start COMMANDS.sh | poll SECONDS"
    exit 2
    ;;
esac
