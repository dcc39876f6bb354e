"""Bytes and files, no format: what every reader and writer of files in zeroshard builds on.

Owns the per-file byte budget (:mod:`.budget`), the hostile-file checks on names and opens
(:mod:`.members`), :class:`~.damage.CheckpointDamagedError`, the dtype table and casts
(:mod:`.dtypes`), JSON values (:mod:`.jsonvalue`), block checksums (:mod:`.checksum`) and the
CRC-32 piece terms digests combine (:mod:`.digest`), safetensors files written and read by
range (:mod:`.safetensors_io`, :mod:`.block_reader`, :mod:`.streaming`), the bytes a load
reads (:mod:`.read_stats`), and the one-writer lock (:mod:`.writer_lock`).

May import: ``zeroshard.layout`` (the rules for tensor names and shapes) and nothing else of
zeroshard; torch only inside the functions that hand tensors to it.
"""
