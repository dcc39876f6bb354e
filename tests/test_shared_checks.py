"""Zip records checked by the ranks of a load together, each byte read once (issue 33).

The rule (io/shared_checks.py): every needed byte is read by one rank, the gap after
a needed run by the rank that reads the run's last byte, a record's head by the rank that
reads its first needed byte; the ranks' CRC-32 terms combine to the record's. Property tests
split records among ranks at random; then real DeepSpeed checkpoints loaded by thread ranks
at their own and other world sizes: the job reads each record it touches once, holds what
was saved, and a byte changed anywhere in a record (a needed one, or padding nobody needs)
is refused by every rank naming the file and the record. The same for universal and native
checkpoints, whose checksum blocks several ranks read parts of.
"""

from __future__ import annotations

import shutil
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroshard.checkpoint import run_ranks
from zeroshard.checkpoint.attest.attestation import AttestationError
from zeroshard.checkpoint.attest.attested import attested_load
from zeroshard.checkpoint.loader import load_state
from zeroshard.checkpoint.shared_module import share_checkpoint
from zeroshard.io.digest import raw_crc
from zeroshard.io.read_stats import ReadStats
from zeroshard.io.shared_checks import RecordTerms, SharedRecordChecks, record_problems

KEY = ("ranks.pt", "record archive/data/0")


@st.composite
def split_records(draw):
    """A record of ``size`` bytes, its needed runs, and each needed byte given to one of
    ``ranks`` ranks as pieces: (size, runs, pieces by rank)."""
    size = draw(st.integers(1, 200))
    cuts = sorted(set(draw(st.lists(st.integers(0, size), max_size=12))) | {0, size})
    runs = [(a, b) for a, b, keep in zip(cuts, cuts[1:], draw(st.lists(st.booleans(), min_size=len(cuts)))) if keep]
    ranks = draw(st.integers(1, 5))
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
    for begin, end in runs:
        inner = sorted(set(draw(st.lists(st.integers(begin + 1, max(begin + 1, end - 1)), max_size=3))) - {end})
        bounds = [begin, *(c for c in inner if begin < c < end), end]
        for a, b in zip(bounds, bounds[1:]):
            pieces[draw(st.integers(0, ranks - 1))].append((a, b))
    return size, runs, pieces


def read_by_ranks(data: bytes, runs, pieces, crc: int | None = None) -> list[RecordTerms]:
    """Each rank's terms: its pieces and the gaps the rule gives it, raw CRCs from ``data``,
    the record's CRC-32 ``crc`` (default: ``data``'s)."""
    crc, every_rank = zlib.crc32(data) if crc is None else crc, []
    for mine in pieces:
        checks = SharedRecordChecks(RecordTerms())
        for begin, end in mine:
            checks.terms.add(KEY, len(data), crc, begin, end, raw_crc(data[begin:end]))
            for gap_begin, gap_end in checks.gaps(KEY, len(data), begin, end, lambda: list(runs)):
                checks.terms.add(KEY, len(data), crc, gap_begin, gap_end, raw_crc(data[gap_begin:gap_end]))
        every_rank.append(checks.terms)
    return every_rank


@settings(max_examples=300, deadline=None)
@given(split_records(), st.randoms(use_true_random=False))
def test_the_pieces_and_gaps_tile_the_record_and_give_its_crc(split, random):
    size, runs, pieces = split
    data = random.randbytes(size)
    every_rank = read_by_ranks(data, runs, pieces)
    if not runs:  # nobody needs any of it: nobody reads it, nothing is judged
        assert not any(terms.values for terms in every_rank)
        return
    assert record_problems(every_rank) == []
    # Any one byte changed is caught, wherever it is: needed or a gap.
    position = random.randrange(size)
    damaged = bytearray(data)
    damaged[position] ^= 1 << random.randrange(8)
    problems = record_problems(read_by_ranks(bytes(damaged), runs, pieces, zlib.crc32(data)))
    assert len(problems) == 1 and f"{KEY[0]}: {KEY[1]} is corrupt: its CRC-32 is" in problems[0], problems


def test_a_piece_missing_or_read_twice_is_named():
    data = bytes(range(100))
    runs, pieces = [(10, 40), (60, 90)], [[(10, 40)], [(60, 90)]]
    assert record_problems(read_by_ranks(data, runs, pieces)) == []
    twice = read_by_ranks(data, runs, [[(10, 40)], [(60, 90)], [(60, 90)]])
    assert record_problems(twice) == [f"{KEY[0]}: the ranks read 140 bytes of the 100 of {KEY[1]}"]
    missing = read_by_ranks(data, runs, [[(10, 40)]])
    assert record_problems(missing) == [f"{KEY[0]}: the ranks read 60 bytes of the 100 of {KEY[1]}"]


def test_a_record_one_rank_checked_whole_excuses_the_others_pieces():
    """A rank that reads a record whole checks it alone (an expert weight every holder reads
    whole, a module tensor's block read for a scalar): the others' pieces of it are not
    combined, and a piece missing is then no problem; a record nobody checked whole still is."""
    data = bytes(range(100))
    partial = read_by_ranks(data, [(0, 100)], [[(10, 40)]])
    assert record_problems(partial) != []
    whole = RecordTerms()
    whole.whole.add(KEY)
    assert record_problems([*partial, whole]) == []


def test_ranks_that_read_different_zip_directories_are_refused():
    one, other = RecordTerms(), RecordTerms()
    one.add(KEY, 100, 0x1234, 0, 50, 0)
    other.add(KEY, 100, 0x4321, 50, 100, 0)
    assert record_problems([one, other]) == [f"{KEY[0]}: the ranks read different sizes or CRC-32s for {KEY[1]}"]


# ---- real DeepSpeed checkpoints, loaded by thread ranks --------------------------------------


pytestmark_deepspeed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
)


def load_sources_together(open_one, path, layout, full: bool = True) -> list:
    """Every rank of ``layout`` loads ``path`` (a source from ``open_one(path)``) sharing the
    reads: per rank, its state and the ReadStats of its load, or the exception it raised."""

    def one_rank(coord):
        stats = ReadStats()

        def read(evidence):
            with open_one(path) as source:
                share = share_checkpoint(source.info.model_entries, layout, coord.rank)
                return load_state(source, layout, coord.rank, evidence=evidence, share=share, load_optimizer_states=full)

        state, _ = attested_load(coord, str(path), read, layout, stats=stats)
        return state, stats

    return run_ranks(layout.world_size, one_rank, return_exceptions=True)


def load_together(save_dir, world: int, full: bool) -> list:
    """Every rank of a DeepSpeed policy layout at ``world`` loads ``save_dir`` sharing the
    reads (each rank's records checked with the others'): per rank, its state and the
    ReadStats of its load, or the exception it raised."""
    from zeroshard.deepspeed.checkpoint import open_deepspeed

    with open_deepspeed(save_dir) as source:
        layout = source.info.layout.with_world_size(world)
    return load_sources_together(open_deepspeed, save_dir, layout, full)


def records_touched(save_dir, world: int, full: bool) -> int:
    """Bytes of the records any rank of the load reads a part of, once each: the rank files'
    and the module tensors the trained weights are not rebuilt from."""
    from zeroshard.checkpoint import plan_reads
    from zeroshard.deepspeed.checkpoint import open_deepspeed

    with open_deepspeed(save_dir) as source:
        layout = source.info.layout.with_world_size(world)
        records = {}
        for rank in range(world):
            for plan in plan_reads(source.info.layout, layout, rank):
                for copy in plan.copies:
                    tensors = source._ranks[copy.source_rank]
                    for stored in [tensors.fp32[copy.source_group], *(tensors.states[copy.source_group].values() if full else ())]:
                        records[(str(stored.storage.path), stored.storage.record_name)] = stored.storage.record_size
        for entry in source.info.model_entries:  # buffers and frozen weights: one rank reads each
            stored = source._model.module[entry.name]
            records[(str(stored.storage.path), stored.storage.record_name)] = stored.storage.record_size
    return sum(records.values())


@pytestmark_deepspeed
@pytest.mark.parametrize("fixture, world", [("w2_s2", 2), ("w2_s1_align", 3), ("w4_s2_align", 2), ("w8_s2_align_tiny", 3)])
@pytest.mark.parametrize("full", [True, False], ids=["full", "weights"])
def test_the_job_reads_each_record_once_and_holds_what_was_saved(deepspeed_runs, fixture, world, full):
    from zeroshard.deepspeed.checkpoint import open_deepspeed

    save_dir = deepspeed_runs[fixture].save_dir
    results = load_together(save_dir, world, full)
    assert not any(isinstance(r, BaseException) for r in results), results
    with open_deepspeed(save_dir) as source:
        scalars = sum(value.storage.record_size for value in _rank0_scalars(source))
    data = sum(stats.data for _, stats in results)
    assert data == records_touched(save_dir, world, full) + world * scalars, (data, world, scalars)
    # The states are the ones a load alone, checking each record whole, gives.
    with open_deepspeed(save_dir) as source:
        layout = source.info.layout.with_world_size(world)
        for rank, (state, _) in enumerate(results):
            alone = load_state(source, layout, rank, load_optimizer_states=full)
            for mine, theirs in zip(state.fp32_partitions, alone.fp32_partitions):
                assert np.array_equal(mine.numpy(), theirs.numpy())
            for mine, theirs in zip(state.optimizer_states, alone.optimizer_states):
                assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k].numpy(), theirs[k].numpy()) for k in mine)


def _rank0_scalars(source):
    """Rank 0's scalar tensors (the step), which every rank of a load reads."""
    from zeroshard.deepspeed.checkpoint.files import read_rank_shard
    from zeroshard.deepspeed.checkpoint.paths import rank_file_paths
    from zeroshard.torchfile.torch_records import StoredTensor

    first = read_rank_shard(rank_file_paths(source.path)[0], 0)
    return [value for group in first.scalars for value in group.values() if isinstance(value, StoredTensor)]


def flipped_copy(save_dir, tmp_path, rank: int, pick) -> tuple:
    """A copy of a DeepSpeed checkpoint with one byte of rank ``rank``'s file flipped: at
    the byte ``pick(source, rank)`` gives (an absolute file offset). The copy's save folder
    and the flipped file's name."""
    from zeroshard.deepspeed.checkpoint import open_deepspeed

    copy = tmp_path / "copy"
    shutil.copytree(save_dir, copy)
    with open_deepspeed(copy) as source:
        offset, record = pick(source, rank)
        path = source._ranks[rank].fp32[0].storage.path
        for group in source._ranks[rank].states:
            for stored in group.values():
                if stored.storage.record_name == record:
                    path = stored.storage.path
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x10]))
    return copy, path.name, record


def tail_padding(source, rank):
    """A byte of the group-0 exp_avg tail padding of rank ``rank``: no load needs it."""
    group = source.layout.groups[0]
    stored = source._ranks[rank].states[0]["exp_avg"]
    last = max(f.partition_start + f.length for f in group.fragments(rank))
    assert last < group.partition_numel, "this rank's exp_avg has no tail padding"
    return stored.storage.data_offset + (last + (group.partition_numel - last) // 2) * 4, stored.storage.record_name


def middle_of_fp32(source, rank):
    """The middle byte of rank ``rank``'s group-0 fp32 partition: a needed one."""
    stored = source._ranks[rank].fp32[0]
    return stored.storage.data_offset + stored.storage.nbytes // 2, stored.storage.record_name


@pytestmark_deepspeed
@pytest.mark.parametrize("pick", [tail_padding, middle_of_fp32], ids=["padding", "needed"])
def test_a_byte_changed_anywhere_in_a_record_is_refused_by_every_rank(deepspeed_runs, tmp_path, pick):
    """w8_s2_align_tiny at 3 ranks: the last old rank's exp_avg ends in padding nobody loads,
    read only by the rank that owns the gap; the byte is found by the ranks' combined CRC."""
    copy, file_name, record = flipped_copy(deepspeed_runs["w8_s2_align_tiny"].save_dir, tmp_path, 7, pick)
    results = load_together(copy, 3, full=True)
    assert all(isinstance(r, AttestationError) for r in results), results
    messages = {str(r) for r in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "\n" not in message and "not loaded (nothing changed)" in message
    assert f"{file_name}: record {record} is corrupt: its CRC-32 is" in message, message


# ---- universal checkpoints: checksum blocks split between ranks ------------------------------


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    """A synthetic dense run saved at D=2, converted to universal with 4 KiB blocks."""
    from test_moe_checkpoint import dense_layout
    from universal_helpers import save_synthetic

    from zeroshard.checkpoint.universal import to_universal

    root = tmp_path_factory.mktemp("shared_universal")
    native = save_synthetic(root / "native", dense_layout(2))
    return to_universal(native, root / "universal", progress=False, block_size=4096), dense_layout


def assert_pattern_loaded(results: list, layout, full: bool) -> None:
    """Every rank loaded the testing pattern's values of ``layout``, bit for bit."""
    from zeroshard.checkpoint.testing import ADAM_STATES, expected_partition

    assert not any(isinstance(r, BaseException) for r in results), results
    for rank, (state, _) in enumerate(results):
        for group in range(len(layout.groups)):
            masters = expected_partition(layout, rank, group, "fp32")
            if not full:  # without optimizer state the masters are the weights: the masters cast
                masters = masters.to(torch.bfloat16).float()
            assert torch.equal(state.fp32_partitions[group], masters)
            for name in ADAM_STATES if full else ():
                assert torch.equal(state.optimizer_states[group][name], expected_partition(layout, rank, group, name))


def load_universal_together(path, layout, full: bool = True) -> list:
    """Every rank of ``layout`` loads the universal checkpoint ``path`` sharing the reads."""
    from zeroshard.checkpoint.universal import open_universal

    return load_sources_together(lambda opened: UniversalSource(open_universal(opened)), path, layout, full)


from zeroshard.checkpoint.universal.source import UniversalSource  # noqa: E402


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("full", [True, False], ids=["full", "weights"])
def test_a_universal_load_reads_each_block_once_and_holds_what_was_saved(universal, world, full):
    """Blocks where two ranks' parts of a parameter meet are read in parts, once over the
    job: the job reads the blocks any rank needs, each once (the module tensors' blocks
    aside, checked whole by the rank that reads them)."""
    from load_bytes_workers import universal_needed

    path, make_layout = universal
    layout = make_layout(world)
    results = load_universal_together(path, layout, full)
    assert_pattern_loaded(results, layout, full)
    with UniversalSource(path) as source:
        entries = source.info.model_entries
    needed = sum(
        universal_needed(path, layout, rank, full, share_checkpoint(entries, layout, rank).mine) for rank in range(world)
    )
    data = sum(stats.data for _, stats in results)
    assert data == needed, (data, needed)


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x04]))


def test_a_universal_block_split_between_ranks_is_checked_together(universal, tmp_path):
    """At D=3 a rank's partition starts inside a parameter: the block there is read in two
    parts by two ranks. A byte flipped in the second rank's part is found by the ranks'
    combined CRC, on every rank; so is one flipped where no rank reads (a weights-only load
    reads no exp_avg, but the block holding the masters' end also holds exp_avg's start)."""
    from zeroshard.checkpoint.universal import open_universal

    path, make_layout = universal
    layout = make_layout(3)
    fragment = next(f for f in layout.groups[0].fragments(1) if f.param_start > 0)  # a parameter split at rank 1
    with open_universal(path) as checkpoint:
        shard, record, begin = checkpoint.param_location(fragment.name, "fp32", fragment.param_start, fragment.param_start + 1)
        assert begin % record.block_size, "the split falls on a block boundary: nothing is shared"
        last = layout.groups[0].params[-1]
        _, _, masters_end = checkpoint.param_location(last.name, "fp32", last.numel, last.numel)
        assert masters_end % record.block_size, "the masters end on a block boundary"
    for offset, full in ((begin + 1, True), (masters_end + 2, False)):
        copy = tmp_path / f"copy-{offset}"
        shutil.copytree(path, copy)
        flip_byte(copy / shard.name, offset)
        results = load_universal_together(copy, layout, full)
        assert all(isinstance(r, AttestationError) for r in results), results
        messages = {str(r) for r in results}
        assert len(messages) == 1, messages
        message = messages.pop()
        block = offset // record.block_size
        assert f"{shard.name}: checksum block {block} is corrupt: its CRC-32 is" in message, message


# ---- native checkpoints, resharded: blocks where the new partitions meet -----------------------


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """A synthetic dense run saved at D=2 with 256-byte checksum blocks (many of them cut
    where a new layout's partitions meet)."""
    from test_moe_checkpoint import dense_layout
    from universal_helpers import save_synthetic

    return save_synthetic(tmp_path_factory.mktemp("shared_native") / "native", dense_layout(2)), dense_layout


def load_native_together(path, layout, full: bool = True) -> list:
    """Every rank of ``layout`` loads the native checkpoint ``path`` sharing the reads."""
    from zeroshard.checkpoint.native.source import NativeSource

    return load_sources_together(NativeSource, path, layout, full)


@pytest.mark.parametrize("world, full", [(1, True), (2, True), (2, False), (3, True), (3, False), (4, True), (4, False)])
def test_a_native_load_reads_each_block_once_and_holds_what_was_saved(native, world, full):
    """At the saved D and resharded, a rank-file or model-file block that two ranks need
    parts of is read in parts, once over the job, and the optimizer scalars are read alone
    (not their whole block): the job reads exactly the blocks needed, once each."""
    from load_bytes_workers import native_needed

    from zeroshard.checkpoint.native.source import NativeSource

    path, make_layout = native
    layout = make_layout(world)
    results = load_native_together(path, layout, full)
    assert_pattern_loaded(results, layout, full)
    for state, _ in results:
        for scalars in state.optimizer_scalars:
            assert scalars["step"].item() == 7.0 if full else not scalars
    with NativeSource(path) as source:
        entries = source.info.model_entries
    needed = sum(native_needed(path, layout, rank, full, share_checkpoint(entries, layout, rank).mine) for rank in range(world))
    data = sum(stats.data for _, stats in results)
    assert data == needed, (data, needed)


def test_a_native_block_split_between_ranks_is_checked_together(native, tmp_path):
    """At D=3 from D=2, new rank 1's partition starts inside old rank 0's fp32 master, in a
    block new rank 0 reads the rest of. A byte flipped in rank 1's part is found by the
    ranks' combined CRC, on every rank; so is one where no rank reads (a weights-only load
    reads no exp_avg, but the block holding the masters' end holds exp_avg's start too)."""
    from zeroshard.checkpoint.format import fp32_key, rank_file_name, state_key
    from zeroshard.checkpoint.native.source import NativeSource
    from zeroshard.checkpoint.reshard import plan_reads

    path, make_layout = native
    layout = make_layout(3)
    file_name = rank_file_name(0, 2)
    copy = next(c for plan in plan_reads(make_layout(2), layout, 1) for c in plan.copies if c.source_rank == 0)
    with NativeSource(path) as source:
        header, record = source._header(file_name), source.checkpoint.manifest.files[file_name]
    split = header[fp32_key(copy.source_group)].begin + 4 * copy.source_start
    masters_end, states_start = header[fp32_key(0)].end, header[state_key(0, "exp_avg")].begin
    assert split % record.block_size and masters_end % record.block_size, "nothing is shared"
    assert masters_end // record.block_size == states_start // record.block_size
    for offset, full in ((split + 1, True), (states_start + 2, False)):
        damaged = tmp_path / f"copy-{offset}"
        shutil.copytree(path, damaged)
        flip_byte(damaged / file_name, offset)
        results = load_native_together(damaged, layout, full)
        assert all(isinstance(r, AttestationError) for r in results), results
        messages = {str(r) for r in results}
        assert len(messages) == 1, messages
        message = messages.pop()
        assert f"{file_name}: checksum block {offset // record.block_size} is corrupt: its CRC-32 is" in message, message


def test_optimizer_scalars_read_alone_are_attested(native, tmp_path):
    """Each rank of a resharded load reads the scalars' own bytes from the rank file it
    opened first, unchecked by their block: a step changed in old rank 1's file (which new
    rank 2 reads its scalars from) is refused by every rank, naming the scalar, and the
    block's CRC, which the ranks reading its other bytes check together, names the block."""
    from zeroshard.checkpoint.format import rank_file_name, scalar_key
    from zeroshard.checkpoint.native.source import NativeSource

    path, make_layout = native
    file_name = rank_file_name(1, 2)
    with NativeSource(path) as source:
        entry = source._header(file_name)[scalar_key(0, "step")]
        block = entry.begin // source.checkpoint.manifest.files[file_name].block_size
    damaged = tmp_path / "copy"
    shutil.copytree(path, damaged)
    flip_byte(damaged / file_name, entry.begin + 2)
    results = load_native_together(damaged, make_layout(3))
    assert all(isinstance(r, AttestationError) for r in results), results
    messages = {str(r) for r in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "group 0 scalar 'step' on rank 2 holds digest" in message, message
    assert f"{file_name}: checksum block {block} is corrupt" in message, message  # whoever read the block's rest


# ---- which elements the job reads: source_runs against every rank's plan ----------------------


def _union_of_plans(old, new, params) -> dict[tuple[int, int], list[tuple[int, int]]]:
    from zeroshard.checkpoint.reshard import plan_reads
    from zeroshard.io.shared_checks import merged

    found: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for rank in range(new.world_size):
        for plan in plan_reads(old, new, rank, params):
            for copy in plan.copies:
                found.setdefault((copy.source_rank, copy.source_group), []).append(
                    (copy.source_start, copy.source_start + copy.length)
                )
    return {key: merged(runs) for key, runs in found.items()}


@pytest.mark.parametrize(
    "old_world, old_ep, new_world, new_ep, subset",
    [(4, 2, 4, 2, False), (4, 2, 2, 1, False), (2, 1, 3, 1, False), (4, 2, 8, 4, False), (4, 2, 4, 2, True), (3, 1, 5, 1, True)],
)
def test_source_runs_are_what_every_ranks_plan_reads(old_world, old_ep, new_world, new_ep, subset):
    """What the ranks agree on without a collective (JobReads.elements) is exactly what their
    plans copy: same layout (whole partitions, padding included), resharded across DP and
    EP, and with only some parameters loaded."""
    from test_moe_checkpoint import moe_layout

    from zeroshard.checkpoint.reshard import JobReads
    from zeroshard.io.shared_checks import merged

    old, new = moe_layout(old_world, old_ep), moe_layout(new_world, new_ep)
    params = [name for name in new.param_names if not (subset and name.endswith(("w2", "weight")))]
    reads = JobReads(old, new, frozenset(params), True)
    union = _union_of_plans(old, new, params)
    for rank in range(old.world_size):
        for group in range(len(old.groups)):
            assert merged(reads.elements(rank, group)) == union.get((rank, group), []), (rank, group)


# ---- a big range of a zip record, read past the page cache ------------------------------------


@pytest.mark.parametrize("aligned", [True, False])
def test_big_ranges_of_a_record_are_read_past_the_page_cache_and_checked_together(tmp_path, monkeypatch, aligned):
    """Two ranks' ranges of one 1.2 MB record, from a file not in the page cache, with
    slots of 64 KiB: each lands whole and right although the record starts off a page, the
    two ranks' terms give the record's CRC-32, and the page cache is left without them
    (read direct). Into memory ``aligned`` as the file within a page, the spans inside a
    range land in it (no copy), the first (from the page before the range) in a slot; else
    every span in a slot. The same with a byte flipped on disk: the record is named."""
    from test_direct_reads import at_phase, evict

    from zeroshard.io import direct_reads
    from zeroshard.io.direct_reads import ReadAhead, cached_fraction
    from zeroshard.torchfile import shared_reads
    from zeroshard.torchfile.shared_reads import announce, read_shared
    from zeroshard.torchfile.torch_file import load_torch_file

    landed: list[bool] = []
    same_memory = shared_reads.same_memory
    monkeypatch.setattr(shared_reads, "same_memory", lambda a, b: landed.append(same_memory(a, b)) or landed[-1])

    monkeypatch.setattr(direct_reads, "SLOT_BYTES", 64 << 10)
    monkeypatch.setattr(direct_reads, "SLOTS", 2)
    monkeypatch.setattr(direct_reads, "DIRECT_MIN_BYTES", 32 << 10)
    numel = 300_007  # 1.2 MB: a file over 1 MiB is not read whole when opened
    path = tmp_path / "t.pt"
    torch.save({"small": torch.ones(3), "big": torch.arange(numel, dtype=torch.float32)}, path)
    if direct_reads.open_direct(path) is None:
        pytest.skip(f"{tmp_path}: the file system reads nothing past the page cache (O_DIRECT)")

    def read_by_two_ranks() -> tuple[list[np.ndarray], list[RecordTerms]]:
        evict(path)
        saved = load_torch_file(path)["big"]
        assert saved.storage.data_offset % 4096, "the record starts on a page: the test shows less"
        cut = numel // 3
        found, every_rank = [], []
        for start, end in ((0, cut), (cut, numel)):
            checks, ahead = SharedRecordChecks(RecordTerms()), ReadAhead()
            phase = (saved.storage.data_offset + start * 4 + (0 if aligned else 64)) % 4096
            out = at_phase((end - start) * 4, phase).view(np.float32)
            out[:] = -1
            announce(saved, start, end, ahead, out)
            landed.clear()
            read_shared(saved, start, out, checks, lambda: [(0, numel * 4)], ahead)
            ahead.close()
            assert len(landed) > 2 and not landed[0] and all(landed[1:-1]) == aligned and any(landed) == aligned, landed
            found.append(out)
            every_rank.append(checks.terms)
        with open(path, "rb") as handle:
            begin = saved.storage.data_offset
            assert cached_fraction(handle.fileno(), begin + 4096, begin + numel * 4 - 4096) < 0.5
        return found, every_rank

    found, every_rank = read_by_two_ranks()
    assert np.array_equal(np.concatenate(found), np.arange(numel, dtype=np.float32))
    assert record_problems(every_rank) == []
    big = load_torch_file(path)["big"].storage
    flip_byte(path, big.data_offset + 5 * numel // 2)
    _, every_rank = read_by_two_ranks()
    (problem,) = record_problems(every_rank)
    assert f"{path}: record {big.record_name} is corrupt: its CRC-32 is" in problem, problem


# ---- at scale: every record tiled once, simulated without files ------------------------------


@pytest.mark.parametrize("old_world, new_world", [(768, 512), (768, 1000), (512, 768)])
def test_at_768_ranks_the_rule_tiles_every_record_once(old_world, new_world):
    """A DeepSpeed-policy layout at hundreds of ranks, where a tiny group is padding on most
    of them and the parameter alignment pads between parameters: every new rank's plan gives
    its pieces of each old rank's fp32 and state records, each rank applies the gap rule
    alone, and over the job the pieces and gaps cover every record touched exactly once
    (records nobody needs, padding-only ranks', are not touched at all)."""
    from zeroshard.checkpoint.reshard import JobReads, plan_reads
    from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout

    specs = [
        [ParamSpec.of(f"w{i}", (97 + 13 * i, 31), "bfloat16") for i in range(6)],
        [ParamSpec.of("tiny.bias", (3,), "bfloat16")],
    ]
    old = build_layout(specs, old_world, LayoutPolicy.deepspeed(parameter_alignment=True))
    new = build_layout(specs, new_world, LayoutPolicy.native())
    reads = JobReads(old, new, frozenset(old.param_names), True)
    covered: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for rank in range(new_world):
        checks = SharedRecordChecks(RecordTerms())
        for plan in plan_reads(old, new, rank):
            for copy in plan.copies:
                size = old.groups[copy.source_group].partition_numel * 4  # a state record: the whole partition
                key = (f"rank {copy.source_rank}", f"group {copy.source_group}")
                needed = [(4 * start, 4 * end) for start, end in reads.elements(copy.source_rank, copy.source_group)]
                begin, end = 4 * copy.source_start, 4 * (copy.source_start + copy.length)
                pieces = [(begin, end), *checks.gaps(key, size, begin, end, lambda: needed)]
                covered.setdefault((copy.source_rank, copy.source_group), []).extend(pieces)
    padding_only = [
        (rank, group.index) for group in old.groups for rank in range(old_world) if not group.fragments(rank)
    ]
    assert padding_only and not set(padding_only) & set(covered)
    for (rank, group), pieces in covered.items():
        pieces.sort()
        size = old.groups[group].partition_numel * 4
        assert pieces[0][0] == 0 and pieces[-1][1] == size, (rank, group, pieces[:2], pieces[-2:])
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), (rank, group)  # no gap, no overlap
