#!/usr/bin/env bash
# On the GPU box, after `run.sh te carry NN` for every piece (run it as `run.sh te build`,
# which also checks that megatron-core sees TE): put the Transformer Engine core wheel back
# together and check it against the manifest te_fetch.sh wrote, compile
# transformer_engine_torch from its sdist against the box's torch, install the three TE
# packages into /tmp/te_site, and run one bf16 and two FP8 GEMMs (delayed and current
# scaling). Writes /tmp/te_env.sh (run.sh sources it when present) and $OUT/te_build.log.
#   carry: .whl/te_extra (and the megatron-core wheel in .whl/)
# Safe to rerun, e.g. after a timeout: a checked wheel is kept, the compile resumes where it
# stopped (ninja, in-tree build in /tmp/te_src), an installed and importable TE is left alone.
set -euo pipefail
OUT=${OUT:-/tmp/lrattn_out}
EXTRA=.whl/te_extra CHUNKS=/tmp/te_chunks SITE=/tmp/te_site SRC=/tmp/te_src
mkdir -p "$OUT" /tmp/te_wheel
exec > >(tee -a "$OUT/te_build.log") 2>&1
sums=$EXTRA/SHA256SUMS
[ -f "$sums" ] || { echo "te_build: $sums missing: carry .whl/te_extra"; exit 2; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "nvcc: $(command -v nvcc || echo none) $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || true)"

# 1. the core wheel from its pieces, and the small files, against the manifest
(cd "$EXTRA" && grep -v '^#' SHA256SUMS | grep -v -e ' chunks/' -e ' transformer_engine_cu' \
    | sha256sum -c --quiet) || { echo "te_build: a file in $EXTRA does not match SHA256SUMS"; exit 1; }
core=$(awk '$2 ~ /^transformer_engine_cu[0-9]+-/ {print $2}' "$sums")
want=$(awk -v f="$core" '$2 == f {print $1}' "$sums")
wheel=/tmp/te_wheel/$core
if [ ! -f "$wheel" ] || [ "$(sha256sum "$wheel" | cut -d' ' -f1)" != "$want" ]; then
    pieces=$(awk '$2 ~ /^chunks\// {sub("chunks/", "", $2); print $2}' "$sums")
    missing=""
    for p in $pieces; do [ -f "$CHUNKS/$p" ] || missing="$missing $p"; done
    [ -z "$missing" ] || { echo "te_build: missing pieces:$missing (run.sh te carry NN for each)"; exit 2; }
    (cd "$CHUNKS" && cat $pieces) >"$wheel.part"
    have=$(sha256sum "$wheel.part" | cut -d' ' -f1)
    [ "$have" = "$want" ] || { echo "te_build: $core sha256 $have, manifest $want"; rm -f "$wheel.part"; exit 1; }
    mv "$wheel.part" "$wheel"
fi
echo "core wheel ok: $core sha256 $want"

# 2. what the box lacks: build helpers for TE's setup.py, pydantic for TE at run time
build_path="" deps=""
if ! python3 -c "import setuptools, wheel.bdist_wheel, packaging" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/te_buildenv \
        "$EXTRA"/deps/setuptools-*.whl "$EXTRA"/deps/wheel-*.whl "$EXTRA"/deps/packaging-*.whl
    build_path=/tmp/te_buildenv
fi
if ! python3 -c "import pydantic" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/te_deps \
        "$EXTRA"/deps/pydantic-*.whl "$EXTRA"/deps/pydantic_core-*.whl \
        "$EXTRA"/deps/annotated_types-*.whl "$EXTRA"/deps/typing_inspection-*.whl \
        "$EXTRA"/deps/typing_extensions-*.whl
    deps=/tmp/te_deps
fi
cat >/tmp/te_env.sh <<ENV
export PYTHONPATH="\${PYTHONPATH:+\$PYTHONPATH:}$SITE${deps:+:$deps}"
ENV
echo "build helpers: ${build_path:-from the box}; pydantic: ${deps:-from the box}"

# 3. compile the PyTorch extension and install core + Python package + extension together
probe='import transformer_engine.pytorch, importlib.metadata as m; print("TE", m.version("transformer_engine_torch"))'
if ! (. /tmp/te_env.sh && python3 -c "$probe") 2>/dev/null; then
    if [ ! -f "$SRC/setup.py" ]; then
        mkdir -p "$SRC"
        tar xzf "$EXTRA"/transformer_engine_torch-*.tar.gz -C "$SRC" --strip-components 1
    fi
    # CUDA, cuDNN, cuBLAS, NVRTC and NCCL headers: the toolkit (CUDA_HOME, beside nvcc, or
    # /usr/local/cuda*), plus every include folder of the nvidia-* wheels torch brought (on
    # CPATH for the C++ compiler).
    paths=$(python3 - <<'PY'
import glob, os, shutil, site
nvcc = shutil.which("nvcc")
homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
         nvcc and os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
         "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
print(next((h for h in homes if h and os.path.isfile(os.path.join(h, "include", "cuda_runtime.h"))), ""))
roots = site.getsitepackages() + [site.getusersitepackages()]
dirs = [d for r in roots for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "include")))]
print(":".join(dict.fromkeys(dirs)))
PY
)
    cuda_home=$(sed -n 1p <<<"$paths") headers=$(sed -n 2p <<<"$paths")
    echo "CUDA_HOME=${cuda_home:-none}; CPATH += $headers"
    for h in cuda_runtime.h cublas_v2.h nvrtc.h cudnn.h nccl.h; do
        found=$(IFS=:; for d in ${cuda_home:+$cuda_home/include} $headers; do
            [ -f "$d/$h" ] && { echo "$d"; break; }; done)
        echo "  $h: ${found:-NOT FOUND (the compile will stop here)}"
    done
    python3 -c "import os, sysconfig; p = sysconfig.get_paths()['include']; print('  Python.h:', p if os.path.isfile(os.path.join(p, 'Python.h')) else 'NOT FOUND (python3-dev missing)')"
    start=$(date +%s)
    env ${cuda_home:+CUDA_HOME="$cuda_home"} CPATH="$headers${CPATH:+:$CPATH}" \
        PYTHONPATH="${build_path:+$build_path:}${PYTHONPATH:-}" \
        NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_NO_LOCAL_VERSION=1 \
        NVTE_WITH_NCCL_EP=0 NVTE_CUDA_ARCHS=90 MAX_JOBS=${MAX_JOBS:-16} \
        python3 -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir \
            --upgrade --target "$SITE" "$wheel" "$EXTRA"/transformer_engine-*-py3-none-any.whl "$SRC"
    echo "compiled and installed in $(( $(date +%s) - start )) s"
fi

# 4. smoke test: import, a bf16 GEMM with backward, FP8 GEMMs with both scaling recipes
. /tmp/te_env.sh
python3 - <<'PY'
import importlib.metadata as m
import torch
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format

core = []
for name in ("transformer-engine-cu13", "transformer-engine-cu12"):
    try:
        core.append(f"{name} {m.version(name)}")
    except m.PackageNotFoundError:
        pass
print("transformer-engine", m.version("transformer-engine"), "| transformer_engine_torch",
      m.version("transformer_engine_torch"), "|", ", ".join(core))
torch.manual_seed(0)
lin = te.Linear(512, 512, params_dtype=torch.bfloat16).cuda()
x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
ref = lin(x)
ref.float().sum().backward()
for recipe in (DelayedScaling(fp8_format=Format.HYBRID), Float8CurrentScaling(fp8_format=Format.HYBRID)):
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
        y = lin(x)
    y.float().sum().backward()
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"{type(recipe).__name__}: FP8 GEMM relative error vs bf16 {err:.4f}")
    assert err < 0.1, err
print("TE smoke test passed")
PY
