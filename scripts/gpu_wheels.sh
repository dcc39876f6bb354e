#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels a bare GPU machine lacks for
# benchmarks/gpu_check.py: zlib-ng (zeroshard's CRC), and DeepSpeed 0.19.8 with the pure-Python
# needs its Requires-Dist names that such a machine does not have (hjson, pydantic and
# pydantic's own). The machine's Python is 3.12 on x86-64; nothing there reaches a registry.
# DeepSpeed is published as a source archive only, so its wheel is built here without ops
# (DS_BUILD_OPS=0: a pure-Python wheel) by a Python that has torch. Safe to run again.
# Then, on the GPU machine, with .whl carried: bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then python=$PYTHON
elif [ -x .venv/bin/python ]; then python=.venv/bin/python
else python=python3; fi
out=.whl
mkdir -p "$out"

# One version of each (pydantic and pydantic-core must match); typing-extensions too, as
# pydantic-core wants a recent one.
WHEELS=(zlib-ng==1.1.0 hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
        typing-inspection==0.4.2 typing-extensions==4.15.0)
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$out" "${WHEELS[@]}"

if ! compgen -G "$out/deepspeed-0.19.8-*.whl" >/dev/null; then
    "$python" -c "import torch" || { echo "gpu_wheels: DeepSpeed's build needs torch in $python (set PYTHON)" >&2; exit 2; }
    DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$out" deepspeed==0.19.8
fi
ls -l "$out"
du -sh "$out"
