"""`vllm-kvq calibrate`: the command's flags and its run (text -> hooked model -> histograms
-> codebooks -> file, optionally measured on held-out text)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

from vllm_kvq.codebook_file import CalibrationError
from vllm_kvq.tools.calibrate.collect import (BITS, GRANULARITIES, SENSITIVITY, Accumulator,
                                              collect)
from vllm_kvq.tools.calibrate.evaluate import EVAL_CONFIGS, evaluate, evaluation_markdown
from vllm_kvq.tools.calibrate.hooks import load_model, model_dims
from vllm_kvq.tools.calibrate.normalize import parse_granularity
from vllm_kvq.tools.corpus import calibration_windows, file_windows, held_out_windows


def add_arguments(p) -> None:
    p.add_argument("--model", default=None,
                   help="model folder or name (default: SmolLM2-135M-Instruct, prepared locally)")
    p.add_argument("--corpus", default=None, metavar="FILE",
                   help="calibration text file (default: State of the Union speeches 1946-1989, "
                   "disjoint from the text the tests and `compare` measure on)")
    p.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--bits", default="2,3,4", help="codebook sizes, comma-separated (default 2,3,4)")
    p.add_argument("--granularities", default=",".join(GRANULARITIES),
                   help=f"scale groups to fit (default {','.join(GRANULARITIES)})")
    p.add_argument("--out", required=True, metavar="FILE", help="output .safetensors file")
    p.add_argument("--eval-windows", type=int, default=0, metavar="N",
                   help="then measure fisher vs unweighted vs uniform levels on N held-out "
                   "windows (default 0: skip)")
    p.add_argument("--eval-seq-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def cmd_calibrate(args) -> int:
    import time

    from transformers import AutoTokenizer

    t0 = time.time()
    model_path = args.model
    if model_path is None:
        from vllm_kvq.model_prep import ensure_default_model
        model_path = str(ensure_default_model())
    try:
        bits = tuple(int(b) for b in args.bits.split(","))
    except ValueError:
        raise CalibrationError(f"--bits {args.bits!r}: expected integers like 2,3,4") from None
    if not bits or any(b not in BITS for b in bits):
        raise CalibrationError(f"--bits {args.bits!r}: allowed: {', '.join(map(str, BITS))}")
    grans = tuple(g.strip() for g in args.granularities.split(",") if g.strip())
    for g in grans:
        parse_granularity(g)
    if args.tokens < 2 or args.seq_len < 2:
        raise CalibrationError("--tokens and --seq-len must be at least 2")
    tok = AutoTokenizer.from_pretrained(model_path)
    n = math.ceil(args.tokens / args.seq_len)
    if args.corpus:
        windows, corpus = file_windows(tok, Path(args.corpus), n, args.seq_len)
    else:
        windows, corpus = calibration_windows(tok, n, args.seq_len, args.seed)
    model = load_model(model_path)
    dims = model_dims(model.config)
    print(f"calibrating {model_path} ({dims['num_layers']} layers, {dims['num_kv_heads']} kv "
          f"heads, head_dim {dims['head_dim']}) on {corpus}", file=sys.stderr, flush=True)
    from vllm_kvq.rotation import HEAD_SIZES
    # codebooks for rotated formats too, where the head size has a Hadamard rotation
    rotations = ("none", "hadamard") if dims["head_dim"] in HEAD_SIZES else ("none",)
    acc = Accumulator(dims["num_layers"], grans, rotations=rotations)
    loss = collect(model, windows, acc, progress=not args.quiet)
    meta = dict(dims, model=Path(model_path).name if Path(model_path).exists() else model_path,
                corpus=corpus, tokens=sum(map(len, windows)), seq_len=args.seq_len,
                sequences=len(windows), calibration_loss=round(loss, 4), sensitivity=SENSITIVITY,
                normalization="per scale group: zero=(max+min)/2, scale=(max-min)/2, "
                "x_norm=(x-zero)/scale; keys after RoPE; channel<G> groups aligned to "
                "multiples of G from position 0; _o1: largest-|x| value of each head vector "
                "excluded", outlier_threshold="|x| in model units exceeded by the fraction "
                "of a layer's keys (or values)")
    import vllm_kvq
    meta["vllm_kvq_version"] = getattr(vllm_kvq, "__version__", "0.1.0")
    cal = acc.fit(bits, meta)
    cal.meta["seconds"] = round(time.time() - t0, 1)
    if args.eval_windows:
        t1 = time.time()
        ew = held_out_windows(tok, args.eval_windows, args.eval_seq_len, seed=args.seed)
        configs = [c for c in EVAL_CONFIGS if c["bits"] in bits and c["k"] in grans
                   and c["v"] in grans]
        rows = evaluate(model, ew, cal, configs, progress=not args.quiet)
        cal.meta["evaluation"] = {"windows": args.eval_windows, "window": args.eval_seq_len,
                                  "seconds": round(time.time() - t1, 1),
                                  "rows": [{k: (round(v, 6) if isinstance(v, float) else v)
                                            for k, v in r.items()} for r in rows]}
        print(evaluation_markdown(rows, args.eval_windows, args.eval_seq_len))
    out = cal.save(args.out)
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(windows)} x {args.seq_len} tokens, "
          f"calibration {cal.meta['seconds']} s, total {time.time() - t0:.1f} s)",
          file=sys.stderr)
    return 0
