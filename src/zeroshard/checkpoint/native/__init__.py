"""The native zeroshard checkpoint: one safetensors file per rank plus a JSON manifest.

Saved by :mod:`.save`, read as a ShardSource by :mod:`.source`, loaded by :mod:`.load`.
"""
