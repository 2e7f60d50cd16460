"""The ``kvarn`` command's shared flags: the model and its KV cache layout (serve, run, bench),
and the parsers of sizes in bytes and of attention windows (no MLX imported here)."""

from __future__ import annotations

import argparse
import re

DTYPES = ("auto", "native", "float32", "float16", "bfloat16")
_BITS = (2, 3, 4, 5, 6, 8)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="local mlx-lm model folder (bf16, fp16 or mlx-quantized); default: the bundled "
                        "fixture-chat-29m-q8")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="compute dtype; 'auto' dequantizes to float32 on MLX's CPU backend (fastest there, "
                        "measured) and keeps the stored weights on a GPU; 'native' always keeps them (default: "
                        "%(default)s)")
    p.add_argument("--no-openblas", action="store_true",
                   help="do not re-execute with Debian's OpenBLAS preloaded (also: KVARN_NO_OPENBLAS=1)")
    kv = p.add_argument_group("KV cache layout")
    kv.add_argument("--kv-scheme", choices=("kvarn", "affine", "fp16"), default="kvarn",
                    help="kvarn, affine (mlx-lm QuantizedKVCache) or fp16 (unquantized) (default: %(default)s)")
    kv.add_argument("--kv-bits", type=int, default=None, choices=_BITS,
                    help="bits for keys and values (kvarn default: 4-bit keys, 2-bit values; affine: 4)")
    kv.add_argument("--kv-key-bits", type=int, default=None, choices=_BITS,
                    help="key bits, overriding --kv-bits (default: --kv-bits)")
    kv.add_argument("--kv-value-bits", type=int, default=None, choices=_BITS,
                    help="value bits, overriding --kv-bits (default: --kv-bits)")
    kv.add_argument("--kv-tile", type=int, default=128, choices=(64, 128),
                    help="KVarN tile size G (default: %(default)s)")
    kv.add_argument("--kv-group-size", type=int, default=64, choices=(32, 64, 128),
                    help="affine group size (default: %(default)s)")
    kv.add_argument("--kv-layout", default=None, metavar="auto|SPEC",
                    help="the layout in one word instead of the flags above: kvarn:kXvY[:gG], affine:B[:gG], fp16, "
                         "or auto (serve only): the advice `kvarn advise` stored for this model, else measured "
                         "once at start-up (about 2 minutes for the bundled model on 2 CPU cores) and stored "
                         "(default: none: the flags above)")
    kv.add_argument("--advise-prompts", type=int, default=2,
                    help="--kv-layout auto without stored advice: prompts measured at start-up (default: %(default)s)")
    kv.add_argument("--advise-tokens", type=int, default=384,
                    help="--kv-layout auto without stored advice: decode positions a prompt (default: %(default)s)")
    kv.add_argument("--max-kv-size", type=window_arg, default=None, metavar="N",
                    help="attention window of every row in tokens, any scheme: KVarN keeps the sink and the "
                         "newest whole tiles within N (N >= 2 tiles), fp16/affine are rotating caches of N "
                         "keeping the first 4 tokens, as mlx-lm's max_kv_size; a row's KV bytes stay flat at "
                         "N tokens however long it generates (default: none: unbounded)")


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def size_arg(text: str) -> int:
    """Bytes from '4000000', '512MiB', '2G' (decimal K/M/G, binary KiB/MiB/GiB)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match[2].lower().removesuffix("b") if match and match[2].lower() not in ("b",) else ""
    unit = {"ki": "kib", "mi": "mib", "gi": "gib"}.get(unit, unit)
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 536870912, 512MiB, 2G)")
    return int(float(match[1]) * _UNITS[unit])


def window_arg(text: str) -> int:
    """A ``--max-kv-size``: a positive number of tokens (each scheme's own floor is checked with
    the layout, at start)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of tokens: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of tokens, not {value}")
    return value


def spec_config(args: argparse.Namespace):  # -> engine.speculator.SpecConfig | None
    """``kvarn serve``'s speculative decoding settings (None: off); bad ones stop the command."""
    if args.speculative is None:
        if args.draft_model is not None:
            raise SystemExit("kvarn serve: --draft-model needs --speculative draft")
        return None
    from engine.speculator import SpecConfig

    try:
        k = args.num_speculative_tokens
        if k is None:  # a draft model's drafts cost a forward each: fewer by default
            k = 8 if args.speculative == "ngram" else 4
        config = SpecConfig(args.speculative, k, args.speculative_ngram_min,
                            args.speculative_ngram_max, args.speculative_max_batch, args.draft_model)
        if config.method == "draft":  # refused here, before either model loads
            from engine.draft_model import check_draft_folder
            from engine.loader import BUNDLED_MODEL_DIR

            check_draft_folder(args.model or BUNDLED_MODEL_DIR, config.draft_model)
        return config
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"kvarn serve: {exc}") from None
