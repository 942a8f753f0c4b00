#!/usr/bin/env bash
# A GPU session longer than one device call. The lent machine goes back 30 s after a call
# ends, taking whatever runs with it, so: `start` runs a command file in the background
# (setsid: it outlives the call) in the session folder, and `poll` (called back to back)
# waits up to N s for it, prints its progress and packs the folder into $OUT/session.tgz.
#   bash tools/device/session.sh start COMMANDS.sh   # in the call that installs the bundle
#   bash tools/device/session.sh poll 480            # N below the call's limit, then again
#   bash tools/device/session.sh stop                # ends the started job and its children
# (stop kills the job's own process group by its recorded id: never `pkill -f` a pattern
# there, which also matches the device call's own processes and ends the lease)
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
    (SESSION=$SESSION setsid nohup bash -c 'echo $$ >"$2/pid"; bash "$1"; echo $? >"$2/DONE"' \
        _ "$2" "$SESSION" >"$SESSION/out.log" 2>&1 </dev/null &)
    echo "started $2 at $(date -u +%T); output in $SESSION/out.log"
    ;;
poll)
    end=$((SECONDS + ${2:-60}))
    while [ $SECONDS -lt $end ] && [ ! -e "$SESSION/DONE" ]; do sleep 5; done
    tail -n 25 "$SESSION/out.log" | cut -c1-300
    if [ -e "$SESSION/DONE" ]; then echo "done, exit $(cat "$SESSION/DONE")"; else echo "running"; fi
    tar czf "${OUT:-/tmp}/session.tgz" -C "$(dirname "$SESSION")" "$(basename "$SESSION")"
    ;;
stop)
    [ -s "$SESSION/pid" ] || { echo "no job started in $SESSION"; exit 2; }
    pgid=$(cat "$SESSION/pid")  # setsid made the job's bash the leader of its own group
    kill -TERM -- "-$pgid" 2>/dev/null || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 -- "-$pgid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pgid" 2>/dev/null || true
    echo "stopped the job (process group $pgid)"
    ;;
*)
    echo "usage: $0 start COMMANDS.sh | poll SECONDS | stop"
    exit 2
    ;;
esac
