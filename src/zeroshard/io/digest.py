"""Digests of tensors that any split into pieces can recompute: CRC-32 with a position shift.

The digest of a tensor is ``zlib.crc32`` of its bytes in logical order (little-endian, the
values as stored). A piece of it, bytes ``[offset, offset + n)`` of a tensor of ``total``
bytes, contributes a 32-bit *term*: the piece's CRC with its initial and final inversions
removed (its "raw" CRC, linear over GF(2) in the bytes), multiplied by ``x^(8 * trailing)``
modulo the CRC polynomial, where ``trailing = total - offset - n`` (what appending that many
zero bytes does to a raw CRC). The raw CRC of the whole is the XOR of the terms of any set of
pieces that tiles it, in any order, computed on any ranks; the digest is that XOR with the
CRC of ``total`` zero bytes. So each rank digests the fragments it already holds and one XOR
per tensor combines them (:func:`piece_term`, :func:`finish`).

Why CRC-32 (and not a multiply-add hash over (index, value)): it runs at memory speed
(zlib-ng, ~15 GB/s here) in the same pass that already checksums the bytes, it is the value
``zlib.crc32`` gives for the whole tensor (anyone can check it), it is position-sensitive
through the shift and it has no blind spot for zero values: a run of zeros moved, added or
removed changes it, where a sum of ``value * f(index)`` ignores zeros. Strength, per digest:
any change confined to 32 consecutive bits (one fp32 element, whatever its bits) is always
detected; a change of one element or of any odd number of bits is detected in tensors under
``2^32 - 1`` bits; any other change (a swapped or shifted range) leaves the digest unchanged
with probability ``2^-32`` for unrelated content, independently per digest, and a misplaced
range usually changes several digests at once. It is not a defence against deliberate
tampering: CRCs are linear, so anyone who can edit a checkpoint can recompute them.

The terms must be kept to XOR: a piece counted twice cancels, so callers also count the bytes
each digest covers (a piece counted twice, or missing, shows there).

Pure integers and byte buffers; no torch.
"""

from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # the standard library's: the same values, slower
    from zlib import crc32

try:
    from zlib_ng.zlib_ng import crc32_combine as _native_combine
except ImportError:  # zlib-ng not installed, or too old to have it
    _native_combine = None

ALGORITHM = "crc32"  # the name manifests record: zlib's CRC-32 of the logical bytes
_POLY = 0xEDB88320  # zlib's polynomial, bit-reflected
_ALL_ONES = 0xFFFFFFFF


def raw_crc(data: memoryview | bytes, previous: int | None = None) -> int:
    """The raw CRC-32 (no initial or final inversion) of ``data``, continuing ``previous``
    (the raw CRC of the bytes before it in the same piece) if given."""
    start = _ALL_ONES if previous is None else previous ^ _ALL_ONES
    return crc32(data, start) ^ _ALL_ONES


def piece_term(raw: int, trailing_bytes: int) -> int:
    """The term of a piece whose raw CRC is ``raw`` and which ``trailing_bytes`` bytes of its
    tensor follow."""
    return shift(raw, trailing_bytes)


def finish(terms: int, total_bytes: int) -> int:
    """The digest (``zlib.crc32`` of all the bytes) from the XOR of the terms of pieces tiling
    a tensor of ``total_bytes`` bytes."""
    return terms ^ shift(_ALL_ONES, total_bytes) ^ _ALL_ONES


def digest(data: memoryview | bytes) -> int:
    """The digest of a whole tensor's bytes: ``zlib.crc32`` of them."""
    return crc32(data)


FUSED = _native_combine is not None
"""A writer can CRC each segment once for its block checksums and the digests, combining the
CRCs (3 us each with zlib-ng); without zlib-ng's combine, digests take a second CRC pass."""


def combine(first: int, second: int, second_bytes: int) -> int:
    """``zlib.crc32(a + b)`` from ``zlib.crc32(a)``, ``zlib.crc32(b)`` and ``len(b)``."""
    return shift(first, second_bytes) ^ second


def zeros_crc(count: int) -> int:
    """``zlib.crc32`` of ``count`` zero bytes."""
    return shift(_ALL_ONES, count) ^ _ALL_ONES


class RunningDigest:
    """The digest of one whole tensor fed as a writer streams it (an
    :class:`~.safetensors_io.Observer`): chunk by chunk, or segment by segment with each
    segment's CRC computed once by the writer."""

    def __init__(self) -> None:
        self.value = 0  # zlib.crc32 of the bytes so far

    def __call__(self, offset: int, chunk: memoryview) -> None:
        self.value = crc32(chunk, self.value)

    def cuts(self, begin: int, end: int) -> tuple[int, ...]:
        """None: one whole tensor has no boundary inside it, so a writer need not cut its bytes."""
        return ()

    def segment(self, offset: int, length: int, crc: int) -> None:
        """The next ``length`` bytes, from ``offset``, have CRC-32 ``crc``: join it to the digest so far."""
        self.value = crc if offset == 0 else combine(self.value, crc, length)


def shift(value: int, count: int) -> int:
    """``value`` (a raw CRC) followed by ``count`` zero bytes: times ``x^(8 count)`` mod P."""
    if count == 0 or value == 0:
        return value
    if _native_combine is not None:
        return _native_combine(value, 0, count)
    return shift_python(value, count)


# ---- the same in Python, for installs without zlib-ng's crc32_combine (tests check both) -----


def shift_python(value: int, count: int) -> int:
    """:func:`shift` without zlib-ng: ``x^(8 count) mod P`` by squaring, then one product."""
    return _multiply(_x_to_8n(count), value)


def _multiply(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial, both bit-reflected (bit 31 is x^0), as zlib does."""
    product = 0
    mask = 1 << 31
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """x^(2^k) mod P for k = 0..79 (reflected): enough for any count below 2^76 bytes."""
    found = [1 << 30]  # x^1
    for _ in range(79):
        found.append(_multiply(found[-1], found[-1]))
    return found


_X_POW_2K = _powers()


def _x_to_8n(count: int) -> int:
    """x^(8 count) mod P (reflected)."""
    result, k = 1 << 31, 3  # x^0; 8 count = count * 2^3
    while count:
        if count & 1:
            result = _multiply(_X_POW_2K[k], result)
        count >>= 1
        k += 1
    return result
