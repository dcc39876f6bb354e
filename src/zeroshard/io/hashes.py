"""Values of equal hashes, found before they go into a set or a dict.

A set or a dict compares a new key with every stored key of the same hash, and a file can
choose hashes: an int's is itself modulo 2^61 - 1, and a tuple's mixes its items' by steps
that can be solved for an item, so 20,000 keys read from a file can cost 200 M comparisons
(seconds) where they would cost 20,000 steps. A string's hash is keyed by the process's
random seed. Where our code builds a set or a dict from values a file chose that may be
anything but strings (a JSON manifest's dict with non-string keys, a pickle's ``set(L)``),
:func:`crowded` looks first, at a cost linear in the values.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

# Distinct values of one hash a file may hold: values it did not choose share a 64-bit hash
# with odds of 2^-64 a pair (ints do when they differ by a multiple of 2^61 - 1: a 64-bit
# int has 10 such at most), so more than this many is a file choosing them.
MAX_ALIKE = 16


def crowded(values: Iterable[Hashable]) -> bool:
    """Whether more than MAX_ALIKE distinct ``values`` share a hash. Each value is compared
    with at most MAX_ALIKE others of its hash; hashing them must be affordable (the caller's
    budget charged it). The hashes themselves are ints below 2^61 in magnitude, which hash
    to themselves: apart."""
    alike: dict[int, list[Hashable]] = {}
    for value in values:
        held = alike.setdefault(hash(value), [])
        if value not in held:  # identity first, then equality, as a set compares
            if len(held) == MAX_ALIKE:
                return True
            held.append(value)
    return False
