"""The lines the demos report: the conversions timed, sizes on disk, training-state memory.

Both arcs print them, the dense one (``zeroshard demo``) and the MoE one (``--moe``).
"""

from __future__ import annotations

import time
from pathlib import Path

from .dense import DemoConfig, PhaseResult


def convert_timed(checkpoint: Path, out: Path) -> tuple[list[tuple[str, float, str]], Path]:
    """``checkpoint`` to universal (``out/universal``), then that to fp32 (``out/fp32``): the
    rows timing each, and the fp32 export's folder."""
    from ..checkpoint.export.fp32 import to_fp32
    from ..checkpoint.universal import to_universal

    start = time.perf_counter()
    universal = to_universal(checkpoint, out / "universal", overwrite=True)
    rows = [("to-universal", time.perf_counter() - start, size_of(universal))]
    start = time.perf_counter()
    exported = to_fp32(universal, out / "fp32", overwrite=True)
    rows.append(("to-fp32 (from the universal checkpoint)", time.perf_counter() - start, size_of(exported)))
    return rows, exported


def size_of(path: Path) -> str:
    """``"1.23 MB in 4 files"``: the bytes and number of the files under ``path``."""
    files = [f for f in path.rglob("*") if f.is_file()]
    return f"{sum(f.stat().st_size for f in files) / 1e6:.2f} MB in {len(files)} files"


def memory_lines(config: DemoConfig, result: PhaseResult) -> str:
    """The report's lines of training-state memory per rank (parameter buffers, fp32 master,
    optimizer state and gradient partitions), their total against the unsharded bytes."""
    memory = result.memory
    per_rank = sum(memory[k] for k in ("param_buffer_bytes", "master_bytes", "optimizer_state_bytes", "gradient_bytes"))
    return "\n".join(
        [
            f"  memory per rank at D={result.world_size} (training state):",
            f"    parameters ({config.dtype} flat buffers) {memory['param_buffer_bytes']:>10,} B",
            f"    fp32 master partition          {memory['master_bytes']:>10,} B",
            f"    optimizer state partition      {memory['optimizer_state_bytes']:>10,} B",
            f"    gradient partition             {memory['gradient_bytes']:>10,} B",
            f"    total                          {per_rank:>10,} B  vs {memory['unsharded_bytes']:,} B unsharded "
            f"({per_rank / memory['unsharded_bytes']:.2f}x)",
        ]
    )
