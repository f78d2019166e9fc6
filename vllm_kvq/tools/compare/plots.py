"""The report's PNG plots: quality vs bytes, whole-engine speed vs context, kernel alone."""
from __future__ import annotations

from pathlib import Path

from vllm_kvq.tools.compare.markdown import ctx_label
from vllm_kvq.tools.compare.plan import BASELINE
from vllm_kvq.tools.evaluate import VLLM_PEERS


def plots(result: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    files = []
    rows = [r for r in result["rows"] if not r.get("unavailable")]
    cmap = plt.get_cmap("tab20")
    color = {r["method"]: cmap(i % 20) for i, r in enumerate(result["rows"])}

    def ctx_axis(ax, ctxs):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctxs, [ctx_label(c) for c in ctxs])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3, which="both")

    q_rows = [r for r in rows if r.get("quality") and r["method"] != BASELINE]
    if q_rows:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
        for ax, key, label in ((axes[0], "mean_kl", "mean KL vs bf16 (nats, log)"),
                               (axes[1], "ppl_change", "perplexity change vs bf16 (log)")):
            for r in q_rows:
                y = abs(r["quality"][key]) if key == "ppl_change" else r["quality"][key]
                y = max(y, 1e-5)
                x = r["bytes_per_token_head"]
                c = "tab:red" if r["quality"]["verdict"] == "broken" else (
                    "tab:gray" if r["method"] in VLLM_PEERS else "tab:blue")
                ax.scatter([x], [y], color=c)
                ax.annotate(r["method"], (x, y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
            bf16 = next(r for r in result["rows"] if r["method"] == BASELINE)
            ax.axvline(bf16["bytes_per_token_head"], color="k", lw=0.5, ls=":")
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_yscale("log")
            ax.set_xlabel("bytes per token per kv head (scales included)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3, which="both")
        fig.suptitle(f"Quality vs memory, {Path(result['plan']['model']).name} "
                     f"(dotted line: bf16; |Δppl| shown)")
        fig.tight_layout()
        files.append(out / "quality_vs_bytes.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    s_rows = [r for r in rows if r.get("speed")]
    if s_rows:
        batches = result["plan"]["batches"]
        fig, axes = plt.subplots(1, len(batches) + 1, figsize=(4.2 * (len(batches) + 1), 4.4),
                                 squeeze=False)
        axes = axes[0]
        for r in s_rows:
            ctxs = [x["context"] for x in r["speed"]]
            ls = "--" if r["method"] in VLLM_PEERS else "-"
            for i, b in enumerate(batches):
                ys = [next(d["decode_tok_s"] for d in x["decode"] if d["batch"] == b)
                      for x in r["speed"]]
                axes[i].plot(ctxs, ys, ls, marker="o", ms=3, color=color[r["method"]],
                             label=r["method"])
            axes[-1].plot(ctxs, [x["prefill_tok_s"] for x in r["speed"]], ls, marker="o",
                          ms=3, color=color[r["method"]], label=r["method"])
        for i, b in enumerate(batches):
            axes[i].set_title(f"decode, batch {b}")
            axes[i].set_ylabel("tokens/s (all sequences)")
        axes[-1].set_title("prefill (one prompt)")
        axes[-1].set_ylabel("tokens/s")
        for ax in axes:
            ctx_axis(ax, result["plan"]["contexts"])
            ax.set_ylim(bottom=0)
        axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.suptitle("Whole-engine speed vs context (dashed: vLLM's own attention)")
        fig.tight_layout()
        files.append(out / "speed_vs_context.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    k = result.get("kernel")
    if k and k["rows"]:
        batches = sorted({r["batch"] for r in k["rows"]})
        fig, axes = plt.subplots(1, len(batches), figsize=(4.6 * len(batches), 4.2),
                                 squeeze=False)
        for i, b in enumerate(batches):
            sub = [r for r in k["rows"] if r["batch"] == b]
            for name in sub[0]["ms"]:
                axes[0][i].plot([r["context"] for r in sub], [r["ms"][name] for r in sub],
                                "--" if name == "vllm" else "-", marker="o", ms=3,
                                color="k" if name == "vllm" else color.get(name),
                                label="vLLM bf16 op" if name == "vllm" else name)
            axes[0][i].set_title(f"attention kernel alone, batch {b}")
            ctx_axis(axes[0][i], sorted({r["context"] for r in sub}))
            axes[0][i].set_yscale("log")
            axes[0][i].set_ylabel("ms per decode call (log)")
        axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.tight_layout()
        files.append(out / "kernel_vs_context.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files
