"""The kernel's weight layout (lowbit_layout.hpp): rows in tiles of 16, per tile and group the
64-byte chunks one VNNI dot product reads (16 rows x 4 consecutive weights), and the per-row
scales of a tile and group side by side."""
from __future__ import annotations

import itertools

import numpy as np

TILE = 16
_ROWS_AT_ONCE = 4096  # bounds pack_weights' padded and transposed copies of a large matrix


def unsigned(packed: np.ndarray, rows: int, k: int, bits: int, signed: bool) -> np.ndarray:
    """An OpenVINO constant's bytes (4-bit: values 2j and 2j + 1 in the low and high nibble of
    byte j) -> uint8 [rows, k] with the sign bias added (i4 + 8, i8 + 128)."""
    data = np.frombuffer(packed, dtype=np.uint8) if not isinstance(packed, np.ndarray) else packed.view(np.uint8)
    if bits == 4:
        data = data.reshape(rows, k // 2)
        if signed:
            data = data ^ 0x88
        return np.stack([data & 0x0F, data >> 4], axis=-1).reshape(rows, k)
    data = data.reshape(rows, k)
    return data ^ 0x80 if signed else data


# MXFP4's E2M1 values doubled (weights.py keeps them so, as int8), by code; the kernel reads a
# code through lowbit_layout.hpp's E2M1_TABLE as the value plus E2M1_BIAS
E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int16)
E2M1_BIAS = 12
_E2M1_CODE = np.full(256, 255, np.uint8)  # int8 + 128 -> its code (255: none; 0 is code 0, not -0's 8)
_E2M1_CODE[E2M1_DOUBLED[::-1] + 128] = np.arange(15, -1, -1)


def e2m1_codes(u: np.ndarray) -> np.ndarray | None:
    """uint8 [rows, k] (int8 + 128) -> each value's E2M1 code, where every value is a doubled
    E2M1 value (an MXFP4 tensor's), else None. Exact: the codes give the values back."""
    codes = np.empty_like(u)
    for r in range(0, len(u), 4096):  # slices: no full-size temporaries beyond the codes
        codes[r:r + 4096] = _E2M1_CODE[u[r:r + 4096]]
        if (codes[r:r + 4096] == 255).any():
            return None
    return codes


def pack_weights(u: np.ndarray, bits: int, group: int) -> np.ndarray:
    """uint8 [rows, k] (values < 2**bits; 4, 5, 6 or 8 bits) -> the tiled bytes, rows padded to a
    multiple of 16."""
    parts = [_pack_rows(u[r:r + _ROWS_AT_ONCE], bits, group) for r in range(0, u.shape[0], _ROWS_AT_ONCE)]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def _pack_rows(u: np.ndarray, bits: int, group: int) -> np.ndarray:
    rows, k = u.shape
    tiles = -(-rows // TILE)
    u = np.pad(u, ((0, tiles * TILE - rows), (0, 0)))
    quads = group // 4
    # [tile, row, group, quad, 4] -> [tile, group, quad, row, 4]
    t = u.reshape(tiles, TILE, k // group, quads, 4).transpose(0, 2, 3, 1, 4)
    if bits == 4:
        half = quads // 2
        t = t[:, :, :half] | (t[:, :, half:] << 4)
    elif bits in (5, 6):  # the low four bits as 4-bit's, then the top one or two of 8 or 4 chunks a byte
        per = 8 // (bits - 4)
        low, top = t & 0x0F, (t >> 4).reshape(tiles, k // group, quads // per, per, TILE, 4)
        half = quads // 2
        planes = top[:, :, :, 0]
        for i in range(1, per):
            planes = planes | top[:, :, :, i] << ((bits - 4) * i)
        t = np.concatenate([(low[:, :, :half] | (low[:, :, half:] << 4)).reshape(tiles, k // group, -1),
                            planes.reshape(tiles, k // group, -1)], axis=-1)
    return np.ascontiguousarray(t).reshape(-1)


def pack_floats(x: np.ndarray) -> np.ndarray:
    """[rows, groups] -> [tiles, groups, 16], rows padded with zeros."""
    rows, groups = x.shape
    tiles = -(-rows // TILE)
    x = np.pad(x, ((0, tiles * TILE - rows), (0, 0)))
    return np.ascontiguousarray(x.reshape(tiles, TILE, groups).transpose(0, 2, 1))


_FIRST = [(63, 1), (63, -1), (128, 1), (128, -1), (127, 1), (127, -1)]  # llama.cpp's largest sub-scales
_REST = list(itertools.product(range(126, 0, -1), (1, -1)))


def factor(s: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray] | None:
    """f32 [rows, groups] -> (f16 [rows, groups // block], int8 [rows, groups]) whose products are
    s exactly in f32, or None where some block of `block` groups has no such factors.

    K-quants store a scale as an f16 per 256 weights times a 6- or 8-bit integer per group;
    weights.py hands the graph their f32 products, so the factors are found again: a block's
    largest magnitude is d times some integer c, 63 for Q4_K's and Q5_K's sub-scales and -128 for
    Q6_K's as llama.cpp quantizes (tried in the order that solves most of a sample of blocks),
    then any other on the few blocks still unsolved. Where those leave more than 1% unsolved, the
    scales are not a K-quant's, and each further candidate would be another pass over them."""
    rows, groups = s.shape
    b = s.reshape(-1, block)
    m = np.abs(b[:, 0])
    for j in range(1, block):  # column by column: a reduction over a short last axis is slow
        np.maximum(m, np.abs(b[:, j]), out=m)
    d = np.zeros(len(b), np.float16)
    q = np.zeros(b.shape, np.int8)
    todo = np.flatnonzero(m)  # all-zero blocks: d = 0, q = 0
    sample = todo[:1024]
    first = sorted(_FIRST, key=lambda cs: -_solve(b[sample], m[sample], *cs)[2].sum())
    for i, (c, sign) in enumerate(first + _REST):
        if not len(todo) or (i == len(first) and len(todo) > len(b) // 100):
            break
        whole = len(todo) == len(b)  # views, not gathered copies, for the pass that solves most
        dc, qc, ok = _solve(b if whole else b[todo], m if whole else m[todo], c, sign)
        if whole and ok.all():
            return _unsigned(dc, qc.astype(np.int8), rows, groups, block)
        d[todo[ok]], q[todo[ok]] = dc[ok], qc[ok].astype(np.int8)
        todo = todo[~ok]
    return None if len(todo) else _unsigned(d, q, rows, groups, block)


def _unsigned(d: np.ndarray, q: np.ndarray, rows: int, groups: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks whose integers are all <= 0 (some < 0) negated, d and integers both (the same
    products, bit for bit): a K-quant's minimums, -dmin * m, then take 6 bits as its scales do."""
    q = q.reshape(-1, block)
    low = q.min(axis=1)
    flip = (q.max(axis=1) <= 0) & (low < 0) & (low > -128)
    d = np.where(flip, -d.reshape(-1), d.reshape(-1))
    q = np.where(flip[:, None], -q, q)
    return d.reshape(rows, groups // block), q.reshape(rows, groups)


def _solve(b: np.ndarray, m: np.ndarray, c: int, sign: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each block's d = sign * m / c as f16, its integers b / d, and whether they give b back."""
    # d = 0 or beyond f16's range (inf) gives nan or inf integers, which fail the test
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        dc = (sign * m / np.float32(c)).astype(np.float16)
        wide = dc.astype(np.float32)[:, None]
        qc = np.rint(b / wide)
        exact = (qc >= -128) & (qc <= 127) & (wide * qc == b)
    ok = dc != 0
    for j in range(b.shape[1]):
        ok &= exact[:, j]
    return dc, qc, ok


def factor_bits(*ints: np.ndarray) -> int:
    """6 where factor()'s integers all lie in [0, 64) (Q4_K's and Q5_K's sub-scales and minimums,
    as the file keeps them), else 8."""
    return 6 if all(int(q.min()) >= 0 and int(q.max()) < 64 for q in ints) else 8


def pack_factored(d: np.ndarray, q: np.ndarray, bits: int) -> np.ndarray:
    """factor()'s f16 [rows, blocks] and int8 [rows, groups] -> bytes: per tile and block the 16
    rows' f16s, then per group of the block the 16 rows' integers, a byte each or (bits 6) row j's
    at bits 6j..6j+5 of the group's 12 bytes: 4.5 bits a Q4_K weight, as in the file, where a
    byte each made 4.625 (bytes: the plugin widens f16 constants)."""
    blocks = d.shape[1]
    head = pack_floats(d).view(np.uint8).reshape(-1, blocks, 2 * TILE)
    ints = pack_floats(q).view(np.uint8)
    if bits == 6:  # four rows' 6 bits in three bytes
        v = ints.astype(np.uint32).reshape(*ints.shape[:2], TILE // 4, 4)
        word = v[..., 0] | v[..., 1] << 6 | v[..., 2] << 12 | v[..., 3] << 18
        ints = np.stack([word, word >> 8, word >> 16], axis=-1).astype(np.uint8)
    return np.concatenate([head, ints.reshape(head.shape[0], blocks, -1)], axis=-1).reshape(-1)


def minimum(offset: np.ndarray, scale: np.ndarray, centre: int) -> np.ndarray | None:
    """weights.py's centred offset (o + centre * scale in f32, o the block's minimum) -> o, where
    the kernel's fma(scale, centre, o) gives the offset back exactly; else None."""
    lead = np.float32(centre) * scale
    o = offset - lead
    total = lead.astype(np.float64) + o.astype(np.float64)
    exact = total - lead == o  # the f64 sum is exact, so its f32 rounding is fma's single one
    return o if np.all(exact & (total.astype(np.float32) == offset)) else None
