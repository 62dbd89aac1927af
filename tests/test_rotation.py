"""RoPE re-rotation: keys encoded at p, rotated by d, equal keys encoded at p - d, through the host
applier for every cache precision (within its tolerance), with [R, 1] and [R, B] deltas."""
from __future__ import annotations

import numpy as np
import openvino as ov
import pytest

from vinoserve.cache.key_codec import KeyCodec
from vinoserve.cache.rotation import HostRotator, LayerRotation, RotationTable, rotate
from vinoserve.model.rope import RopeConfig

B, H, S = 32, 2, 64
ROPE = RopeConfig(theta=100000.0, dim=S)


def rope_encode(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x [..., tokens, S] raw keys -> RoPE at `positions` [..., tokens] (rotate-half, as HF)."""
    angles = positions[..., None] * ROPE.inverse_frequencies()
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., :S // 2], x[..., S // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(np.float32)


# (element type, block shape, tolerance as a fraction of the keys' range)
LAYOUTS = {
    "f32": (ov.Type.f32, (H, B, S), 1e-5),
    "f16": (ov.Type.f16, (H, B, S), 2e-3),
    "bf16": (ov.Type.bf16, (H, B, S), 1e-2),
    "u8-by-channel": (ov.Type.u8, (H, B + 8, S), 2.5e-2),
    "u8-by-token": (ov.Type.u8, (H, B, S + 8), 2.5e-2),
    "u4-by-channel": (ov.Type.u4, (H, B + 16, S), 0.25),
    "u4-by-token": (ov.Type.u4, (H, B, S + 16), 0.25),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("per_token", [False, True])
def test_host_rotation_matches_encoding_at_the_new_position(layout, per_token):
    etype, shape, tol = LAYOUTS[layout]
    rng = np.random.default_rng(0)
    tensor = ov.Tensor(etype, [6, *shape])
    codec = KeyCodec.for_tensor(tensor, B, S)
    raw = rng.standard_normal((3, H, B, S)).astype(np.float32) * 3
    blocks = np.array([4, 1, 5])
    start = np.array([5, 9, 40]) * B  # each block's first position before the move
    valid = np.array([B, B, 20])  # the last block is partly filled
    shift_blocks = np.array([1, 3, 17])  # rows of the table: moves of 1, 3 and 17 blocks
    positions = start[:, None] + np.arange(B)
    codec.write(blocks, rope_encode(raw, positions[:, None, :]), valid)

    table = RotationTable(ROPE.inverse_frequencies(), B, rows=4)  # too small: must grow to row 17
    table.ensure(int(shift_blocks.max()))
    deltas = np.repeat(shift_blocks[:, None], B, axis=1) if per_token else shift_blocks[:, None]
    rotator = HostRotator([tensor], B, S)
    rotator.apply(0, LayerRotation(blocks, deltas.astype(np.int32), valid), table)

    got = codec.read(blocks)
    expected = rope_encode(raw, (positions - shift_blocks[:, None] * B)[:, None, :])
    span = np.abs(expected).max()
    for r, n in enumerate(valid):
        err = np.abs(got[r, :, :n] - expected[r, :, :n]).max() / span
        assert err < tol, (layout, r, err)


def test_rotation_is_exact_in_float64_and_composes():
    rng = np.random.default_rng(1)
    raw = rng.standard_normal((1, H, B, S))
    table = RotationTable(ROPE.inverse_frequencies(), B, rows=8)
    keys = rope_encode(raw, np.full((1, 1, B), 7 * B) + np.arange(B))
    twice = rotate(rotate(keys, table.table, np.array([[2]])), table.table, np.array([[3]]))
    once = rotate(keys, table.table, np.array([[5]]))
    np.testing.assert_allclose(twice, once, atol=1e-4)
    np.testing.assert_allclose(once, rope_encode(raw, np.full((1, 1, B), 2 * B) + np.arange(B)), atol=1e-4)


def test_table_uses_the_models_own_frequencies():
    t10k = RotationTable(RopeConfig(10000.0, S).inverse_frequencies(), B, rows=2).table
    t100k = RotationTable(ROPE.inverse_frequencies(), B, rows=2).table
    assert not np.allclose(t10k[1], t100k[1])
    np.testing.assert_allclose(t100k[1, :S // 2], np.cos(B * ROPE.inverse_frequencies()), rtol=1e-6)
    np.testing.assert_allclose(t100k[1, S // 2:], -np.sin(B * ROPE.inverse_frequencies()), rtol=1e-6)
