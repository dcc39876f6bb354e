"""``import zeroshard`` (and its engine and checkpoint layers) imports no trainer framework:
they are optional extras, reached only through ``zeroshard.integrations.<framework>``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning", "deepspeed")

PROBE = f"""
import json, sys
loaded = {{}}
for module in ("zeroshard", "zeroshard.engine", "zeroshard.checkpoint", "zeroshard.integrations"):
    __import__(module)
    loaded[module] = sorted(name for name in {FRAMEWORKS!r} if name in sys.modules)
print(json.dumps(loaded))
"""


def test_zeroshard_imports_no_trainer_framework():
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(SRC)}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded == {module: [] for module in loaded} and len(loaded) == 4, loaded
