#!/usr/bin/env bash
# On the GPU box: keep piece NN of the Transformer Engine core wheel (made here by te_fetch.sh)
# in /tmp/te_chunks, which outlives the call while the machine stays warm. One piece per call
# (a call carries at most 64 MiB); run it for every NN listed in .whl/te_chunks/SHA256SUMS,
# then te_build.sh.
#   bash tools/gpu_box/te_carry.sh 00      carry: .whl/te_chunks/00 .whl/te_chunks/SHA256SUMS
set -euo pipefail
n=${1:?usage: te_carry.sh NN (a piece name in .whl/te_chunks)}
src=.whl/te_chunks/$n sums=.whl/te_chunks/SHA256SUMS dst=/tmp/te_chunks
[ -f "$src" ] && [ -f "$sums" ] || { echo "te_carry: carry $src and $sums" >&2; exit 2; }
want=$(awk -v f="chunks/$n" '$2 == f {print $1}' "$sums")
have=$(sha256sum "$src" | cut -d' ' -f1)
[ -n "$want" ] && [ "$want" = "$have" ] || { echo "te_carry: $src: sha256 $have, manifest ${want:-none}" >&2; exit 1; }
mkdir -p "$dst"
cp "$src" "$dst/$n.part" && mv "$dst/$n.part" "$dst/$n"
cp "$sums" "$dst/SHA256SUMS"
total=$(grep -c ' chunks/' "$sums")
held=$(cd "$dst" && ls | grep -cE '^[0-9]{2}$' || true)
echo "te_carry: piece $n stored; $held of $total pieces in $dst: $(cd "$dst" && ls | grep -E '^[0-9]{2}$' | tr '\n' ' ')"
