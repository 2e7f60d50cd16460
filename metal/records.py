"""The KVarN record fields every kernel reads or writes, whatever the backend: their names and
their block-major shapes (``kvarn/pool.py`` keeps one array per field and layer)."""

from __future__ import annotations

RECORD_FIELDS = ("k_codes", "k_alpha", "k_beta", "k_r", "v_codes", "v_alpha", "v_beta", "v_c")


def output_shapes(n: int, H: int, G: int, D: int, key_bits: int, value_bits: int) -> dict[str, tuple[int, ...]]:
    """The record fields of n blocks of H heads, tile size G, head dim D (W = min(D, 128)-channel
    slices, S = D / W of them)::

        k_codes [n, H, S, W, G*kb/32] uint32   k_alpha, k_beta [n, H, S, W] f16   k_r [n, H, S, G] f16
        v_codes [n, H, G, D*vb/32]    uint32   v_alpha, v_beta [n, H, G, S] f16   v_c [n, H, D]    f16
    """
    W = min(D, 128)
    S = D // W
    return {"k_codes": (n, H, S, W, G * key_bits // 32), "k_alpha": (n, H, S, W), "k_beta": (n, H, S, W),
            "k_r": (n, H, S, G), "v_codes": (n, H, G, D * value_bits // 32), "v_alpha": (n, H, G, S),
            "v_beta": (n, H, G, S), "v_c": (n, H, D)}
