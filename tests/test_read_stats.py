"""ReadStats: what a load reads, by file, by kind (opening files or their tensors), by rank."""

from __future__ import annotations

from universal_helpers import save_synthetic

from zeroshard.checkpoint import ReadStats, load_sharded, run_ranks
from zeroshard.checkpoint.loader import load_state
from zeroshard.checkpoint.native.source import NativeSource
from zeroshard.layout import ParamSpec, build_layout

SPECS = [[ParamSpec.of("w1", (13, 7), "bf16"), ParamSpec.of("w2", (7, 11), "bf16")], [ParamSpec.of("b", (11,), "bf16")]]


def test_counting_sees_every_reader(tmp_path):
    """``ReadStats.counting`` counts the reads of a source opened without stats (the
    manifest it opens too), the same bytes an explicit ``stats=`` counts."""
    layout = build_layout(SPECS, 2)
    path = save_synthetic(tmp_path, layout)
    alone, metered = ReadStats(), ReadStats()
    with NativeSource(path, stats=alone) as source:
        load_state(source, layout, 0)
    with metered.counting(), NativeSource(path) as source:
        load_state(source, layout, 0)
    manifest = metered.bytes_by_file["manifest.json"]
    assert {**alone.bytes_by_file, "manifest.json": manifest} == metered.bytes_by_file and alone.total > 0
    assert metered.opening == alone.opening + manifest and metered.data == alone.data > 0
    with NativeSource(path) as source:  # outside the block: not counted
        load_state(source, layout, 1)
    assert metered.bytes_by_file["manifest.json"] == manifest


def test_a_collective_load_learns_every_ranks_count(tmp_path):
    """Each rank learns what every rank read from the load's one agreement (``ranks``)."""
    path = save_synthetic(tmp_path, build_layout(SPECS, 2))
    stats = [ReadStats() for _ in range(3)]
    new = build_layout(SPECS, 3)
    run_ranks(3, lambda coord: load_sharded(path, new, coord.rank, coordinator=coord, stats=stats[coord.rank]))
    totals = tuple(s.total for s in stats)
    assert all(s.ranks == totals and s.job_total == sum(totals) for s in stats), (totals, [s.ranks for s in stats])
    assert all(s.job_data == sum(t.data for t in stats) for s in stats)
    assert ReadStats().job_total == 0 and stats[0].total < stats[0].job_total
