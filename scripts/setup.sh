#!/usr/bin/env bash
# Set up .venv for zeroshard: reuse a torch that is already installed, else install the
# pinned CPU build (an unpinned torch can pull a multi-GB CUDA build), then zeroshard itself
# with its test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}

pip_install() {
    # pip's output without this machine's noise about missing local index folders.
    local log
    log=$(mktemp)
    local status=0
    .venv/bin/python -m pip install -q "$@" >"$log" 2>&1 || status=$?
    grep -v '^WARNING: Location' "$log" >&2 || true
    rm -f "$log"
    return "$status"
}

if [ ! -x .venv/bin/python ]; then
    # System site packages let a machine's own torch (a CUDA build, say) be used as it is.
    "$python" -m venv --system-site-packages .venv
fi
if .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "setup: using torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')"
else
    echo "setup: installing $TORCH_PIN"
    pip_install "$TORCH_PIN"
fi
# DeepSpeed (an optional group) builds the DeepSpeed checkpoints the importer tests read;
# transformers (the hf group) is the MoE model family tests/test_hf_moe.py trains and loads
# the fp32 exports of transformers models with from_pretrained; the transformers, accelerate
# and lightning groups are the trainers zeroshard.integrations plugs into (pinned; the torch
# installed above satisfies theirs, so none pulls a torch of its own).
DS_BUILD_OPS=0 pip_install -e ".[test,deepspeed,hf,transformers,accelerate,lightning]"
# DeepSpeed 0.19.8's AutoEP runs with transformers 5.9.0 only (5.24 raises a TypeError in its
# output recorders). The AutoEP fixture runs (tests/autoep_fixtures.py) put this folder first on
# their PYTHONPATH; nothing else sees it. The rest of what it needs is the environment's.
SIDE=.side/transformers-5.9
if [ ! -d "$SIDE/transformers-5.9.0.dist-info" ]; then
    rm -rf "$SIDE"
    pip_install --no-deps --target "$SIDE" transformers==5.9.0 huggingface-hub==1.33.0 tokenizers==0.22.2 \
        httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 certifi
fi
.venv/bin/python -c "import torch, safetensors, zeroshard; print('setup: ok, torch', torch.__version__)"
