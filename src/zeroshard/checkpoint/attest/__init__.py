"""Attestation: every load proves that each rank holds what was saved, or nothing is loaded.

Owns the digests a checkpoint records and a rank computes (:mod:`.digests`: digest keys,
:class:`~.digests.StateDigests`, partial digests of partitions), the evidence the loader
fills and the verdict on it (:mod:`.attestation`: :class:`~.attestation.Evidence`,
:func:`~.attestation.judge`, :class:`~.attestation.Attestation`), loads every rank attests
together (:mod:`.attested`), and the check of what converters and ``verify`` read against
the recorded digests (:mod:`.read_digests`).

May import: ``zeroshard.layout``, ``zeroshard.state``, ``zeroshard.io``, and of the checkpoint
layer only its base (``source``, ``loader``, ``coordinator``); nothing of the formats
(``native``, ``universal``, ``export``), which build on it.
"""
