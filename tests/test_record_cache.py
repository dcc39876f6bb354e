"""RecordCache: ranges of a stored tensor from its zip record, the record read once (issue 33)."""

from __future__ import annotations

import numpy as np
import torch

from zeroshard.io.read_stats import ReadStats
from zeroshard.torchfile.record_cache import RecordCache
from zeroshard.torchfile.torch_file import load_torch_file

NUMEL = 3 << 18  # 3 MiB of fp32: above the 1 MiB a file is read whole at opening


def saved(tmp_path, count: int = 1):
    path = tmp_path / "t.pt"
    torch.save({f"t{i}": torch.arange(NUMEL, dtype=torch.float32) + i for i in range(count)}, path)
    return load_torch_file(path)


def test_ranges_of_a_record_read_it_once(tmp_path):
    """Four quarters of one tensor: the record's bytes are read once, and the values are the
    tensor's. Read range by range without the cache, the first read takes the record's
    CRC-32 (its only checksum) over all of it, the range included, and each other range is
    read again."""
    quarter = NUMEL // 4
    tensor = saved(tmp_path)["t0"]
    record = tensor.storage.record_size
    cache, stats = RecordCache(), ReadStats()
    with stats.counting():
        pieces = [cache.elements(tensor, i * quarter, (i + 1) * quarter) for i in range(4)]
    assert np.array_equal(np.concatenate(pieces), np.arange(NUMEL, dtype=np.float32))
    assert stats.data == record, (stats.data, record)
    tensor, alone = saved(tmp_path)["t0"], ReadStats()  # a new load: its record not yet checked
    with alone.counting():
        for i in range(4):
            tensor.read(i * quarter, (i + 1) * quarter)
    assert alone.data == record + 3 * quarter * 4, (alone.data, record)  # what the cache saves


def test_what_the_cache_leaves_to_straight_reads(tmp_path):
    """The whole tensor, an empty range, one past its end, a record over the limit: None."""
    tensor = saved(tmp_path)["t0"]
    cache = RecordCache()
    assert cache.elements(tensor, 0, NUMEL) is None
    assert cache.elements(tensor, 5, 5) is None
    assert cache.elements(tensor, 5, NUMEL + 1) is None
    assert RecordCache(limit=tensor.storage.record_size - 1).elements(tensor, 0, 10) is None


def test_a_record_past_the_limit_is_read_straight_and_none_is_dropped(tmp_path):
    """Two records under a limit that holds one, asked for alternately: the first is kept,
    the second left to straight reads (None), and no record is read twice by the cache."""
    tensors = saved(tmp_path, 2)
    record = tensors["t0"].storage.record_size
    cache, stats = RecordCache(limit=record + record // 2), ReadStats()
    with stats.counting():
        found = [cache.elements(tensors[name], 1, 3) for name in ("t0", "t1", "t0", "t1")]
    assert [None if f is None else f[0] for f in found] == [1, None, 1, None]
    assert stats.data == record, (stats.data, record)


def test_deepspeeds_module_weights_read_each_record_once(deepspeed_runs):
    """DeepSpeed saves a param group's bf16 weights as views of one flat storage: one zip
    record, whose CRC-32 covers all of it. Its source reads the module's weights together
    with each record read once, the values those of each tensor read alone; one by one,
    each weight would read the whole record again."""
    from zeroshard.checkpoint.formats import open_source
    from zeroshard.checkpoint.source import read_model_tensors

    with open_source(deepspeed_runs["w1_s1"].save_dir) as source:
        names = list(source.layout.param_names)
        module = {name: source._model.module[source.info.aliases.get(name, name)] for name in names}
        records = {(str(t.storage.path), t.storage.record_name): t.storage.record_size for t in module.values()}
        assert len(records) < len(names)  # the check below means something: records are shared
        stats = ReadStats()
        with stats.counting():
            found = read_model_tensors(source, names)
        assert stats.data == sum(records.values()), (stats.data, records)
        for name in names:
            alone = source.model_tensor(name)
            assert found[name].shape == alone.shape and found[name].tobytes() == alone.tobytes(), name
