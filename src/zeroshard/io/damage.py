"""The error for a checkpoint that does not hold what was saved.

Raised for damage, as opposed to a mismatch between a checkpoint and the run loading it: a
checksum block that does not match, a file shorter than recorded, a rank file that does not
belong where the manifest puts it, a load whose attestation fails. A ValueError, as every
one-line checkpoint error is; the Checkpointer's resume can fall back to an older checkpoint
on this one alone (:class:`~zeroshard.checkpoint.checkpointer.Checkpointer`, ``fallback``).
"""

from __future__ import annotations


class CheckpointDamagedError(ValueError):
    """A checkpoint's files or values are not those that were saved (one line, naming the file
    or parameter)."""


class MissingFileError(CheckpointDamagedError, FileNotFoundError):
    """A file the checkpoint's manifest lists, or the tag ``latest`` names, is not there."""
