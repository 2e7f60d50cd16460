"""kvarn/layout.py: exact bytes (docs/kvarn.md, "The quantizer"), presets, validation, stamp."""

from __future__ import annotations

import dataclasses

import pytest

from kvarn.layout import BITS, PRESETS, KVLayout

FINGERPRINT = "0123456789abcdef"
# sha256 of the layout + fingerprint JSON, first 16 hex digits. Changing it invalidates every
# prefix-cache key in the field: only ever update it together with FORMAT_VERSION.
STAMP_K4V2_G128 = "c85d2542ddf43d06"  # format 2 (format 1: 0ae283f2c437646f)


def spec_bytes_per_token(bk: int, bv: int, d: int, g: int) -> float:
    """The spec's formula, per KV head, for one record slice of D <= 128 channels."""
    return (bk + bv) * d / 8 + 2 * (3 * d + 3 * g) / g


# --------------------------------------------------------------------------------------------
# bytes
# --------------------------------------------------------------------------------------------

def test_spec_anchor_k4v2_is_108_bytes_and_fp16_is_512():
    assert KVLayout.kvarn("k4v2").bytes_per_token(128, 1) == 108.0
    assert KVLayout.kvarn("k4v2", tile_size=128).bytes_per_token(128, 8) == 864.0
    assert KVLayout.fp16().bytes_per_token(128, 1) == 512
    assert KVLayout.fp16("bfloat16").bytes_per_token(128, 1) == 512
    assert KVLayout.fp16("float32").bytes_per_token(128, 1) == 1024
    # 4.74x, as the spec says
    assert round(512 / 108, 2) == 4.74


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("g", [64, 128])
@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_bytes_per_token_matches_spec_formula(preset, g, d):
    bk, bv = PRESETS[preset]
    layout = KVLayout.kvarn(preset, tile_size=g)
    w = min(d, 128)
    want = spec_bytes_per_token(bk, bv, w, g) * (d // w)
    assert layout.bytes_per_token(d, 1) == want
    assert layout.bytes_per_token(d, 4) == 4 * want


@pytest.mark.parametrize("d,g,want", [(64, 64, 60.0), (64, 128, 57.0), (128, 64, 114.0), (128, 128, 108.0),
                                      (256, 128, 216.0), (512, 64, 456.0)])
def test_bytes_per_token_k4v2_hand_values(d, g, want):
    assert KVLayout.kvarn("k4v2", tile_size=g).bytes_per_token(d, 1) == want


def test_affine_bytes_per_token():
    # 4-bit codes (64 B) + fp16 scale and bias per 64 channels (4 B) per leg, two legs
    assert KVLayout.affine(4, 64).bytes_per_token(128, 1) == 2 * (64 + 2 * 2 * 2)
    assert KVLayout.affine(8, 32, storage_dtype="float32").bytes_per_token(128, 2) == 2 * 2 * (128 + 2 * 4 * 4)


@pytest.mark.parametrize("g", [64, 128])
def test_sequence_bytes_counts_sink_tail_and_whole_records(g):
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    d, h = 128, 2
    buffers = 2 * 2 * g * d * 2 * h  # sink + tail, K and V, fp16
    record = int(g * layout.bytes_per_token(d, h))
    assert layout.sequence_bytes(0, d, h) == 0
    for n in (1, g - 1, g, g + 1, 2 * g - 1):
        assert layout.sequence_bytes(n, d, h) == buffers, n
    assert layout.sequence_bytes(2 * g, d, h) == buffers + record
    assert layout.sequence_bytes(5 * g + 3, d, h) == buffers + 4 * record
    # fp16 and affine: per token, no buffers
    assert KVLayout.fp16().sequence_bytes(100, d, h) == 100 * 512 * h
    assert KVLayout.fp16().sequence_bytes(0, d, h) == 0


# --------------------------------------------------------------------------------------------
# presets, names, describe
# --------------------------------------------------------------------------------------------

def test_presets():
    assert PRESETS == {"k4v2": (4, 2), "k4v4": (4, 4), "k8v8": (8, 8), "k3v3": (3, 3), "k2v2": (2, 2)}
    for name, (bk, bv) in PRESETS.items():
        layout = KVLayout.kvarn(name)
        assert (layout.scheme, layout.key_bits, layout.value_bits, layout.tile_size) == ("kvarn", bk, bv, 128)
        assert layout.name == f"kvarn-{name}-g128"
    assert KVLayout.kvarn() == KVLayout() == KVLayout.kvarn("k4v2")
    assert KVLayout.kvarn((5, 3), tile_size=64).name == "kvarn-k5v3-g64"
    assert KVLayout.affine(4, 32).name == "affine-4-g32"
    assert KVLayout.fp16("bfloat16").name == "fp16-bfloat16"
    assert KVLayout().iters == 8 and KVLayout().format_version == 2


def test_describe():
    d = KVLayout.kvarn("k4v2").describe(FINGERPRINT)
    assert d == {"scheme": "kvarn", "key_bits": 4, "value_bits": 2, "tile": 128, "group_size": None,
                 "dtype": "float16", "iters": 8, "format_version": 2, "stamp": STAMP_K4V2_G128}
    f = KVLayout.fp16("bfloat16").describe(FINGERPRINT)
    assert (f["key_bits"], f["value_bits"], f["tile"], f["dtype"], f["iters"]) == (16, 16, None, "bfloat16", None)


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, 1, 7, 9, 16])
def test_invalid_widths_raise(bad):
    assert bad not in BITS
    with pytest.raises(ValueError, match="key bits"):
        KVLayout(key_bits=bad)
    with pytest.raises(ValueError, match="value bits"):
        KVLayout(value_bits=bad)
    with pytest.raises(ValueError, match="key bits"):
        KVLayout.kvarn((bad, 2))


@pytest.mark.parametrize("tile", [0, 16, 32, 96, 256])
def test_invalid_tiles_raise(tile):
    with pytest.raises(ValueError, match="tile"):
        KVLayout.kvarn("k4v2", tile_size=tile)


def test_invalid_schemes_and_affine_options_raise():
    with pytest.raises(ValueError, match="scheme"):
        KVLayout(scheme="int4")
    with pytest.raises(ValueError, match="storage dtype"):
        KVLayout(storage_dtype="int8")
    with pytest.raises(ValueError, match="one width"):
        KVLayout(scheme="affine", key_bits=4, value_bits=2)
    with pytest.raises(ValueError, match="group size"):
        KVLayout.affine(4, group_size=16)
    with pytest.raises(ValueError, match="key bits must be one of"):
        KVLayout.kvarn("k9v9")
    with pytest.raises(ValueError, match="written kXvY"):
        KVLayout.kvarn("4/2")
    assert (KVLayout.kvarn("k5v3").key_bits, KVLayout.kvarn("k5v3").value_bits) == (5, 3)  # any kXvY
    for bits in BITS:  # every supported width is accepted on either leg
        KVLayout.kvarn((bits, 2))
        KVLayout.kvarn((4, bits))


# --------------------------------------------------------------------------------------------
# stamp
# --------------------------------------------------------------------------------------------

def test_stamp_is_stable():
    layout = KVLayout.kvarn("k4v2", tile_size=128)
    assert layout.stamp(FINGERPRINT) == STAMP_K4V2_G128
    assert KVLayout().stamp(FINGERPRINT) == STAMP_K4V2_G128  # same fields, same stamp
    assert len(STAMP_K4V2_G128) == 16 and int(STAMP_K4V2_G128, 16) >= 0


CHANGES = {"scheme": "affine", "key_bits": 8, "value_bits": 4, "tile_size": 64, "group_size": 32, "iters": 4,
           "storage_dtype": "float32", "format_version": 3, "max_kv_size": 1024}


def test_stamp_changes_with_every_field_and_the_fingerprint():
    base = KVLayout.kvarn("k4v2")
    assert set(CHANGES) == {f.name for f in dataclasses.fields(KVLayout)}
    stamps = {base.stamp(FINGERPRINT)}
    for name, value in CHANGES.items():
        kwargs = {name: value}
        if name == "scheme":  # a valid affine layout needs one width
            kwargs["value_bits"] = base.key_bits
        changed = dataclasses.replace(base, **kwargs)
        stamp = changed.stamp(FINGERPRINT)
        assert stamp != base.stamp(FINGERPRINT), name
        stamps.add(stamp)
    stamps.add(base.stamp("0123456789abcdee"))
    stamps.add(base.stamp(""))
    assert len(stamps) == len(CHANGES) + 3
