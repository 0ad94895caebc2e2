#!/usr/bin/env bash
# Runs one GPU-box script with its outputs in a scratch folder, then packs them for the trip
# back (a call returns at most 8 files, none deeper than two folders): $OUT/log (the script's
# log, as written) and $OUT/results.tgz (everything the script wrote).
#   GIT_SHA=<sha> bash tools/gpu_box/pack.sh tools/gpu_box/quality_study.sh
set -uo pipefail
script=${1:?usage: pack.sh SCRIPT [ARGS...]}; shift
real=${OUT:-/tmp/lrattn_out}
scratch=$(mktemp -d /tmp/lrattn_pack.XXXX)
OUT=$scratch bash "$script" "$@"
rc=$?
mkdir -p "$real"
[ -f "$scratch/log" ] && cp "$scratch/log" "$real/log"
tar czf "$real/results.tgz" -C "$scratch" .
echo "pack: $script exited $rc; $(du -sh "$real/results.tgz" | cut -f1) packed"
exit $rc
