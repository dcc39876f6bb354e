"""The native zeroshard checkpoint: one safetensors file per rank plus a JSON manifest.

Saved by :mod:`.save`, read as a ShardSource by :mod:`.source`, loaded by :mod:`.load`.

May import: the checkpoint layer's hub (source, formats, format, directory, ...) and
:mod:`..attest`, ``zeroshard.io``, ``layout`` and ``state``; not :mod:`..universal` nor
:mod:`..export`.
"""
