#!/usr/bin/env bash
# Progress of the stages started by the `background` stage (evals/gpu_stages.py), and their
# results so far copied to $OUT. Run directly (not through gpu_session.sh):
#   sleep 500; bash evals/gpu_bg.sh
cd "$(dirname "$0")/.."
tail -${BG_LINES:-25} /tmp/bgout/bg.log 2>/dev/null | grep -vE "Warning|warn\(|^\s*$"
pgrep -f "[g]pu_session.sh" >/dev/null && echo "(still running)" || echo "(finished)"
[ -n "${OUT:-}" ] && cp -r /tmp/bgout/. "$OUT/" 2>/dev/null
ls /tmp/bgout
