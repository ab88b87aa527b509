#!/usr/bin/env bash
# Packages stock vLLM's OpenAI server (`vllm serve`) imports beyond what the offline GPU bundle
# (.vbundle, for offline generation) provides, for benchmarks/compare/http_bench.py --server stock.
# Downloads the wheels of the versions pinned in requirements/cpu.txt into DIR (default
# .gpu_server/, ~10 MB: wheels, not unpacked, to stay within a device call's 64 MiB). http_bench.py
# (--fallback-wheels DIR) unpacks them on the host and appends them AFTER the interpreter's own
# site-packages: a package the GPU host already has is used as it is; only missing ones come from
# DIR. Run here (pip needs the network), then carry DIR:  bash scripts/gpu/server_extra.sh [.gpu_server]
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR="${1:-.gpu_server}"
NAMES=(watchfiles model-hosting-container-standards jmespath prometheus-fastapi-instrumentator prometheus-client
       aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl uvloop click h11 cloudpickle
       py-cpuinfo pyyaml anyio idna httptools)
PINS=()
for n in "${NAMES[@]}"; do
  pin=$(grep -i "^$n==" requirements/cpu.txt) || { echo "server_extra: $n is not pinned in requirements/cpu.txt" >&2; exit 2; }
  PINS+=("$pin")
done
rm -rf "$DIR" && mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d "$DIR" "${PINS[@]}" 2>&1 \
  | grep -v 'is ignored: it is neither' || true
echo "server_extra: $(ls "$DIR"/*.whl | wc -l) wheels in $DIR ($(du -sh "$DIR" | cut -f1))"
