#!/usr/bin/env bash
# Our kernels' just-in-time build carried from one lent machine to the next (each call may get a fresh machine, and a
# build takes about two minutes of its device time). Sourced by run.sh and gpu_tests.sh (PACKLOADER_CACHE set):
#   ops_build_unpack       unpacks $OPS_BUILD (default .gpu/ops_build.tar.xz) into PACKLOADER_CACHE, if it exists
#   ops_build_pack OUTDIR  packs the module built here as OUTDIR/ops_build.tar.xz
# The archive holds ops-<hash>/<module>.so: the folder's name is the hash of the sources, flags, torch, CUDA and GPU
# it was built from (ops/_build.py), so it is used only where they all match (ops._build.load_built imports it), and
# sources changed since simply build afresh. Carry the archive (git-ignored under .gpu/) to the next call.
ops_build_unpack() {
  local f=${OPS_BUILD:-.gpu/ops_build.tar.xz}
  [ -f "$f" ] || return 0
  mkdir -p "$PACKLOADER_CACHE" && tar xJf "$f" -C "$PACKLOADER_CACHE" \
    && echo "our kernels: an earlier build unpacked from $f (used where its hash matches these sources)"
}
ops_build_pack() {
  local so
  so=$(python3 -c "import torch; from ops import _build; print(_build.jit_module_path())" 2>/dev/null)
  [ -f "$so" ] || return 0
  tar cJf "$1/ops_build.tar.xz" -C "$(dirname "$(dirname "$so")")" "$(basename "$(dirname "$so")")/$(basename "$so")"
}
