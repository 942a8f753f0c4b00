#!/usr/bin/env bash
# The release matrix: install each vLLM release into its own virtualenv and run the smoke set
# (tests marked `smoke`: vLLM's plugin loader finds the plugin; the tiny hybrid's config, KV
# cache groups and Scheduler build with our connector; a step through the release's own runner
# mixin hands the rows to the connector; a one-token step that starts a prompt is not a FULL
# decode CUDA graph; the release's patch series applies).
# A release in REFUSED (vllm_gdn_hs/version.py) passes when the plugin refuses it with its
# reason instead. CPU only; about 2-4 minutes a release with uv's cache warm.
#
#   bash tests/matrix.sh                  # every release in vllm_gdn_hs/version.py: RELEASES
#   bash tests/matrix.sh 0.27.1 0.33.0    # some of them
#
# Writes tests/results/matrix.md (the table); each release's log goes to $MATRIX_LOGS/<release>.log
# (default /tmp/vllm-gdn-hs-matrix/logs).
# MATRIX_VENVS: where the virtualenvs go (default /tmp/vllm-gdn-hs-matrix); each is removed
# after its run unless KEEP_VENVS=1.
set -uo pipefail
cd "$(dirname "$0")/.."
command -v uv >/dev/null || python3 -m pip install -q uv
ALL=$(python3 -c 'import ast; t = ast.parse(open("vllm_gdn_hs/version.py").read()); print(" ".join(next(ast.literal_eval(n.value) for n in t.body if isinstance(n, ast.Assign) and n.targets[0].id == "RELEASES")))')
REFUSED=$(python3 -c 'import ast; t = ast.parse(open("vllm_gdn_hs/version.py").read()); print(" ".join(next(ast.literal_eval(n.value) for n in t.body if isinstance(n, ast.AnnAssign) and n.target.id == "REFUSED")))')
RELEASES=${*:-$ALL}
BASE=${MATRIX_VENVS:-/tmp/vllm-gdn-hs-matrix}
LOGS=${MATRIX_LOGS:-$BASE/logs}
mkdir -p "$BASE" "$LOGS"
# cuda-bindings can be newer than every cuda-python that accepts it; a resolver may then pick
# cuda-python 12.6.2.post1, whose files break cuda.bindings 13 (vLLM's CUDA 13 builds).
CONSTRAINTS="$BASE/constraints.txt"
echo "cuda-python>=13" >"$CONSTRAINTS"
# A release whose own pins the package index cannot meet gets the nearest published version
# instead (uv --override, that release only): vLLM 0.34.0 pins flashinfer-python==0.7.3, which
# the index lacks (it has 0.7.2.post1 and 0.7.4). The dev extra's transformers is a range, so
# each release resolves one its own pins admit (0.34.0 needs huggingface-hub 2).
declare -A OVERRIDES=(
    ["0.34.0"]="flashinfer-python==0.7.4"
)
ROWS="$BASE/rows.tsv"
: >"$ROWS"
for VLLM in $RELEASES; do
    VENV="$BASE/venv-$VLLM"
    LOG="$LOGS/$VLLM.log"
    START=$SECONDS
    rm -rf "$VENV"
    uv venv -q -p python3 "$VENV"
    export VIRTUAL_ENV="$VENV"
    OVERRIDE="$BASE/overrides-$VLLM.txt"
    printf '%s\n' ${OVERRIDES[$VLLM]:-} >"$OVERRIDE"
    refused=0
    [[ " $REFUSED " == *" $VLLM "* ]] && refused=1
    {
        echo "== vLLM $VLLM ($(date -u +%FT%TZ))"
        if [ $refused = 1 ]; then  # the requirement excludes it: install the plugin alone
            uv pip install -q --compile-bytecode -c "$CONSTRAINTS" --override "$OVERRIDE" "vllm==$VLLM" pytest && uv pip install -q --no-deps -e .
        else
            uv pip install -q --compile-bytecode -c "$CONSTRAINTS" --override "$OVERRIDE" -e '.[dev]' "vllm==$VLLM"
        fi
    } >"$LOG" 2>&1
    installed=$?
    torch=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo "-")
    if [ $installed != 0 ]; then
        result="install failed"
    elif [ $refused = 1 ]; then
        # register() must refuse it with the reason, and naming the connector must fail.
        "$VENV/bin/python" -c 'from vllm_gdn_hs.version import check_vllm; check_vllm()' >>"$LOG" 2>&1
        reason=$(grep -o "refuses vllm.*" "$LOG" | tail -1)
        [ -n "$reason" ] && result="refused: ${reason#refuses }" || result="not refused"
    else
        "$VENV/bin/python" -m pytest tests -m smoke -q -p no:cacheprovider >>"$LOG" 2>&1
        rc=$?
        summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$LOG" | tail -1 | tr -d '=')
        [ $rc = 0 ] && result="passed:${summary}" || result="FAILED:${summary}"
    fi
    printf '%s\t%s\t%s\t%s\n' "$VLLM" "$torch" "$result" "$((SECONDS - START))" | tee -a "$ROWS"
    unset VIRTUAL_ENV
    [ "${KEEP_VENVS:-0}" = 1 ] || rm -rf "$VENV"
done
{
    echo "# vLLM release matrix"
    echo
    echo "\`bash tests/matrix.sh\` on $(date -u +%F), $(uname -m), Python 3.11, no GPU; commit" \
        "$(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with local changes)')."
    echo "The smoke set is \`pytest -m smoke\`."
    echo
    echo "| vLLM | torch | result | seconds |"
    echo "| --- | --- | --- | --- |"
    sort -t. -k1,1n -k2,2n -k3,3n "$ROWS" | awk -F'\t' '{printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4}'
} >tests/results/matrix.md
cat tests/results/matrix.md
! grep -qE $'\t(FAILED|install failed|not refused)' "$ROWS"
