#!/usr/bin/env bash
# Build a slim vLLM 0.25.1 bundle for the offline GPU host (H100/H200, Python 3.12,
# torch 2.11.0+cu130 preinstalled, no network).
#
# Usage (from the root of a project checkout):
#   bash scripts/gpu/build_bundle.sh [OUT_DIR]        # OUT_DIR defaults to ./.vbundle
#
# Output:
#   OUT_DIR/vllm-site.tar.xz   one ready-made site dir: slim vllm + the deps the host lacks
#   OUT_DIR/gpu_env.sh         source it on the host: unpacks the site dir, sets env vars
#   OUT_DIR/smoke.py           "does the bundle work" check (tiny random Llama)
#
# Environment:
#   VLLM_WHEEL_CACHE  folder holding (or receiving) the vLLM 0.25.1 CUDA wheel,
#                     default ${XDG_CACHE_HOME:-$HOME/.cache}/vllm-wheels
#   WORK              scratch folder for the build (default: a fresh mktemp -d, removed at exit)
#   PY                python with pip (default python3; any version, deps are
#                     cross-downloaded for cp312)
#   BUNDLE_MOE=1      keep vLLM's MoE kernels (sm_90 only), needed by MoE models such as the
#                     Qwen3-Next hybrids (docs/hybrid-models.md); +19 MiB (52 MiB in all)
# Needs: python3 + pip, unzip (or python's zipfile as fallback), tar, xz, network access
# for pip.  Takes ~150 s on 2 cores (xz -9e dominates).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT_DIR=${1:-./.vbundle}
CACHE=${VLLM_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-wheels}
PY=${PY:-python3}
VLLM_VERSION=0.25.1

for t in tar xz; do
  command -v "$t" >/dev/null || { echo "error: '$t' not found" >&2; exit 1; }
done
"$PY" -m pip --version >/dev/null || { echo "error: '$PY -m pip' does not work" >&2; exit 1; }

if [ -z "${WORK:-}" ]; then
  WORK=$(mktemp -d -t vbundle.XXXXXX)
  trap 'rm -rf "$WORK"' EXIT
fi
T0=$(date +%s)

find_wheel() {
  ls -1 "$CACHE"/vllm-"$VLLM_VERSION"-*manylinux*_x86_64.whl 2>/dev/null | head -1
}
mkdir -p "$CACHE"
WHEEL=$(find_wheel || true)
if [ -z "$WHEEL" ]; then
  echo "[0/5] vLLM $VLLM_VERSION CUDA wheel not in $CACHE -> downloading (~250 MB)"
  # --platform/--only-binary: always the x86_64 Linux wheel, whatever this machine is.
  "$PY" -m pip download --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
    "vllm==$VLLM_VERSION" -d "$CACHE"
  WHEEL=$(find_wheel || true)
  [ -n "$WHEEL" ] || { echo "error: no vllm-$VLLM_VERSION-*_x86_64.whl in $CACHE after download" >&2; exit 1; }
fi

rm -rf "$WORK/site"; mkdir -p "$WORK/site" "$OUT_DIR"
echo "[1/5] unpack $(basename "$WHEEL")"
if command -v unzip >/dev/null; then
  unzip -q "$WHEEL" -d "$WORK/site"
else
  "$PY" -m zipfile -e "$WHEEL" "$WORK/site"
fi
V="$WORK/site/vllm"

echo "[2/5] drop what an offline LLM run on Hopper does not import"
rm -f  "$V"/vllm_flash_attn/_vllm_fa2_C.abi3.so "$V"/vllm_flash_attn/_vllm_fa3_C.abi3.so \
       "$V"/_qutlass_C.abi3.so \
       "$V"/_flashmla_C.abi3.so "$V"/_flashmla_extension_C.abi3.so \
       "$V"/_rust_tool_parser.abi3.so "$V"/vllm-rs
rm -rf "$V"/third_party/deep_gemm "$V"/third_party/fmha_sm100
find "$WORK/site" -name __pycache__ -type d -prune -exec rm -rf {} +
# vllm.vllm_flash_attn raises ImportError when neither FA2 nor FA3 .so exists, and
# vllm.v1.attention.backends.fa_utils imports it unconditionally on CUDA -> let it
# import; the run must then select attention backend "TRITON_ATTN".
"$PY" - "$V/vllm_flash_attn/__init__.py" <<'EOF'
import sys
p = sys.argv[1]; s = open(p).read()
old = "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError("
assert old in s, "flash-attn __init__ changed; patch needs updating"
s = s.replace(old, "if False and not (FA2_AVAILABLE or FA3_AVAILABLE):  # slim bundle: FA .so removed\n    raise ImportError(")
open(p, "w").write(s)
EOF

echo "[3/5] keep only sm_90/sm_90a GPU code in _C_stable_libtorch and _moe_C_stable_libtorch (zero the rest, same layout)"
"$PY" "$HERE/prune_fatbin.py" --keep 90 "$V/_C_stable_libtorch.abi3.so"
# the MoE ops (every MoE layer needs them: hybrids such as Qwen3-Next, docs/hybrid-models.md) only
# with BUNDLE_MOE=1: they add ~19 MiB to the bundle, which must fit the device tool's 64 MiB carry
if [ "${BUNDLE_MOE:-0}" = 1 ]; then
  "$PY" "$HERE/prune_fatbin.py" --keep 90 "$V/_moe_C_stable_libtorch.abi3.so"
else
  rm -f "$V/_moe_C_stable_libtorch.abi3.so"
fi

echo "[4/5] add the Python deps missing on the GPU host (cp312 wheels, cross-installed)"
PLAT=""
for n in 39 35 34 31 28 27 26 24 17 5; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PIPLOG="$WORK/pip-deps.log"
# shellcheck disable=SC2086
if ! "$PY" -m pip install -q --no-deps --no-compile --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  $PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --target "$WORK/site" -r "$HERE/device_deps.txt" >"$PIPLOG" 2>&1; then
  cat "$PIPLOG" >&2; echo "error: pip could not fetch the deps in device_deps.txt" >&2; exit 1
fi
grep -v -e "is ignored" -e "Running pip as the 'root' user" "$PIPLOG" || true
find "$WORK/site" -name __pycache__ -type d -prune -exec rm -rf {} +
rm -rf "$WORK/site/bin"

echo "[5/5] tar + xz -9e"
tar -C "$WORK/site" -cf - . | xz -9e -T0 > "$OUT_DIR/vllm-site.tar.xz"
cp "$HERE/gpu_env.sh" "$HERE/smoke.py" "$OUT_DIR/"
chmod +x "$OUT_DIR/gpu_env.sh" "$OUT_DIR/smoke.py"

SITE_MB=$(du -sm "$WORK/site" | cut -f1)
BYTES=$(wc -c < "$OUT_DIR/vllm-site.tar.xz" | tr -d ' ')
MIB=$(awk -v b="$BYTES" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "unpacked site dir: ${SITE_MB} MB; build took $(( $(date +%s) - T0 )) s"
ls -la "$OUT_DIR"
echo "bundle: $OUT_DIR/vllm-site.tar.xz = $BYTES bytes ($MIB MiB)"
