#!/usr/bin/env bash
# On a GPU machine, from the repository root: install the wheels carried in .whl/ (made by
# scripts/gpu_wheels.sh) into a scratch folder, then run benchmarks/gpu_check.py on the GPU
# from the working tree. The report goes to $OUT/gpu_check.json when OUT is set, else
# ./gpu_check.json; extra arguments go to gpu_check.py. Exit status: gpu_check.py's.
set -uo pipefail
cd "$(dirname "$0")/.."
site=${GPU_CHECK_SITE:-/tmp/zeroshard-site}
extra=""
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || { echo "gpu_check.sh: installing .whl/ failed" >&2; exit 2; }
    extra=":$site"
fi
export PYTHONPATH="src$extra" PYTHONUNBUFFERED=1
exec python3 benchmarks/gpu_check.py --json "${OUT:-.}/gpu_check.json" "$@"
