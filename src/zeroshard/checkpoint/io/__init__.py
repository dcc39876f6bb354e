"""Byte I/O under every checkpoint kind: safetensors files read and written by range, block
checksums, hostile-file checks, JSON values, and the atomic-directory protocol.

Imports nothing from the formats above it (native, universal, export).
"""
