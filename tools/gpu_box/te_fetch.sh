#!/usr/bin/env bash
# Run HERE (a machine that reaches PyPI), not on the GPU box: downloads Transformer Engine for
# the box (Python 3.12, torch 2.11+cu130, no network there) and cuts the core wheel into
# pieces small enough to carry one per device call.
#   bash tools/gpu_box/te_fetch.sh            (TE_VERSION=2.20.2, TE_CUDA=cu13 by default)
# Writes (all under .whl/, which git ignores):
#   .whl/te/           the downloads: core wheel, TE Python wheel, transformer_engine_torch
#                      sdist, pydantic and build helpers (setuptools, wheel) for cp312
#   .whl/te_chunks/NN  the core wheel in pieces of at most 45 MiB (carried one per call)
#   .whl/te_extra/     everything but the core wheel, plus SHA256SUMS (carried with the build)
# Then, on the box: `run.sh te carry NN` for every chunk, `run.sh te build` (tools/gpu_box/README.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${TE_VERSION:-2.20.2}
CUDA=${TE_CUDA:-cu13}
# a call carries the working tree too, 64 MiB in all: pieces of 45 MiB leave room for it
CHUNK_MIB=${TE_CHUNK_MIB:-45}
DL=.whl/te CHUNKS=.whl/te_chunks EXTRA=.whl/te_extra
BOX=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
rm -rf "$CHUNKS" "$EXTRA"
mkdir -p "$DL" "$CHUNKS" "$EXTRA"

pip_download() { python3 -m pip download --disable-pip-version-check --no-deps "$@"; }

# The core library (libtransformer_engine.so and friends), built by NVIDIA for one CUDA major.
pip_download --only-binary=:all: "${BOX[@]}" -d "$DL" "transformer-engine-$CUDA==$VERSION"
# The Python package (pure Python; PyPI has no sdist of it, the wheel is the source).
pip_download --only-binary=:all: -d "$DL" "transformer-engine==$VERSION"
# The PyTorch extension is published as source only: it is compiled on the box against the
# box's torch. pip prepares the sdist's metadata while downloading, and TE's setup.py then
# reads torch.version.cuda to name its core-wheel dependency; a CPU torch has none, so that
# step is shown the box's CUDA major (nothing is compiled here). No build isolation: an
# isolated build would try to install torch.
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
cat >"$shim/sitecustomize.py" <<PY
try:
    import torch.version
    if torch.version.cuda is None:
        torch.version.cuda = "${CUDA#cu}.0"
except ImportError:
    pass
PY
PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" pip_download --no-binary=:all: \
    --no-build-isolation -d "$DL" "transformer-engine-torch==$VERSION"
# Runtime dependency of transformer_engine.common.recipe (the box may lack it) and the build
# helpers setup.py imports; te_build.sh uses each only when the box's Python lacks it.
python3 -m pip download --disable-pip-version-check --only-binary=:all: "${BOX[@]}" \
    -d "$DL/deps" pydantic setuptools wheel

core=$(ls "$DL"/transformer_engine_"${CUDA}"-"$VERSION"-*.whl)
split -b "${CHUNK_MIB}M" -d -a 2 "$core" "$CHUNKS/"
cp "$DL"/transformer_engine-"$VERSION"-py3-none-any.whl "$DL"/transformer_engine_torch-"$VERSION".tar.gz "$EXTRA/"
mkdir -p "$EXTRA/deps"
cp "$DL"/deps/*.whl "$EXTRA/deps/"
{
    echo "# transformer-engine $VERSION ($CUDA) for the GPU box, made $(date -u +%FT%TZ)"
    (cd "$(dirname "$core")" && sha256sum "$(basename "$core")")
    (cd "$CHUNKS" && sha256sum [0-9][0-9] | sed 's|  |  chunks/|')
    (cd "$EXTRA" && sha256sum ./*.whl ./*.tar.gz deps/*.whl | sed 's|  \./|  |')
} >"$EXTRA/SHA256SUMS"
cp "$EXTRA/SHA256SUMS" "$CHUNKS/SHA256SUMS"

n=$(ls "$CHUNKS" | grep -c '^[0-9][0-9]$')
echo "core wheel: $(basename "$core") $(du -m "$core" | cut -f1) MiB ($(stat -c %s "$core") bytes)"
echo "chunks: $n x <= ${CHUNK_MIB} MiB in $CHUNKS: $(ls "$CHUNKS" | grep '^[0-9][0-9]$' | tr '\n' ' ')"
echo "extra (carry with te_build.sh): $(du -sm "$EXTRA" | cut -f1) MiB in $EXTRA"
du -h "$CHUNKS"/[0-9][0-9] "$EXTRA"/*.whl "$EXTRA"/*.tar.gz "$EXTRA"/deps/*.whl
