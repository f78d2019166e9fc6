"""`vllm-kvq` command line: formats (and, as they land, serve / compare / calibrate)."""
from __future__ import annotations

import argparse
import json
import sys

from vllm_kvq.formats import EXAMPLE_NAMES, FormatError, KVFormat, parse_format

LISTED = EXAMPLE_NAMES + ("fp8_e5m2_token", "int3_group32",
                          "int2_token", "int4_group32_sym")


def format_row(fmt: KVFormat, head_dim: int, block_size: int) -> dict:
    per = fmt.bytes_per_token(head_dim, block_size)
    return {
        "name": fmt.name,
        "key": fmt.key.describe(),
        "value": fmt.value.describe(),
        "residual_tokens": fmt.residual_tokens,
        "bits_per_value": round(fmt.bits_per_value(head_dim, block_size), 4),
        "k_bytes_per_token": per["k"],
        "v_bytes_per_token": per["v"],
        "padding_bytes_per_token": per["padding"],
        "bytes_per_token": per["total"],
        "ratio_vs_bf16": round(fmt.ratio_vs_bf16(head_dim, block_size), 4),
    }


def cmd_formats(args) -> int:
    names = args.names or LISTED
    rows = []
    for name in names:
        fmt = parse_format(name)
        try:
            fmt.check(args.head_dim, args.block_size)
        except FormatError as e:
            if args.names:
                raise
            print(f"# skipped {name}: {e}", file=sys.stderr)
            continue
        rows.append(format_row(fmt, args.head_dim, args.block_size))
    if args.json:
        print(json.dumps({"head_dim": args.head_dim, "block_size": args.block_size,
                          "unit": "bytes per token per kv head (K+V, scales included)",
                          "formats": rows}, indent=2))
        return 0
    print(f"head_dim={args.head_dim} block_size={args.block_size}; bytes per token per kv "
          f"head, scales/zero-points/padding included; residual window is per sequence")
    cols = [("name", 22), ("key", 16), ("value", 16), ("residual_tokens", 8),
            ("bits_per_value", 8), ("k_bytes_per_token", 8), ("v_bytes_per_token", 8),
            ("bytes_per_token", 8), ("ratio_vs_bf16", 8)]
    heads = {"residual_tokens": "resid", "bits_per_value": "bits/val", "k_bytes_per_token": "K B/tok",
             "v_bytes_per_token": "V B/tok", "bytes_per_token": "B/tok", "ratio_vs_bf16": "x bf16"}
    print("  ".join(heads.get(c, c).ljust(w) for c, w in cols))
    for r in rows:
        print("  ".join(f"{r[c]:g}".ljust(w) if isinstance(r[c], float) else str(r[c]).ljust(w)
                        for c, w in cols))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-kvq", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("formats", help="list cache formats and their bytes per token")
    f.add_argument("names", nargs="*", help="format names (default: a representative list)")
    f.add_argument("--head-dim", type=int, default=128)
    f.add_argument("--block-size", type=int, default=128)
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_formats)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FormatError as e:
        print(f"vllm-kvq: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
