"""A decode step's attention over vLLM's KV-cache layout, on 4 KiB pages vs huge pages.

vLLM 0.32 puts every layer's cache in one buffer, block b of layer l at b * block_stride +
l * layer_stride (vllm/v1/worker/utils.py allocate_kv_cache): this benchmark builds such a
buffer for L layers twice, once as allocated (4 KiB pages where transparent huge pages are
in `madvise` mode) and once through vllm_kvq.hugepages.advise_huge_pages (what the plugin
does for an engine served by vllm-kvq), fills every layer with the same sequences
(shuffled block tables, half the pool's blocks in use), and times one decode step of
attention: L calls, one per layer, the two buffers alternating. vLLM's own bf16 op is a row
of the same run, on the same two kinds of buffer.

  python benchmarks/bench_huge_pages.py [--formats bf16,int4_group32,kivi2] [--batch 16]
      [--context 1024] [--layers 30] [--repeats 10] [--threads 2]

Formats with a residual window read their window's rows from a separate staging tensor, as
the kernel benchmark does (in an engine they come from window blocks of the same buffer).
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # process CPU time = work done

import torch  # noqa: E402

from vllm_kvq import hugepages, ops  # noqa: E402
from vllm_kvq.formats import parse_format  # noqa: E402
from vllm_kvq.reference import uniform_codebooks  # noqa: E402
from vllm_kvq.tools.kernel_timing import (BLOCK, cache_tensor, staging_inputs,  # noqa: E402
                                          vllm_available, vllm_isa)


class Case:
    """One method's L-layer buffer and a step() of L attention calls."""

    def __init__(self, method, huge, Hq, H, D, batch, ctx, L, gen):
        nblk = (ctx + BLOCK - 1) // BLOCK
        total = 2 * batch * nblk  # half the pool in use, shuffled, as in a served engine
        self.bt = torch.randperm(total, generator=gen)[:batch * nblk].to(torch.int32)
        self.bt = self.bt.reshape(batch, nblk)
        slots = (self.bt.long().unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).reshape(batch, -1)
        slots = slots[:, :ctx].reshape(-1)
        k = torch.randn(batch * ctx, H, D, generator=gen).to(torch.bfloat16)
        v = torch.randn(batch * ctx, H, D, generator=gen).to(torch.bfloat16)
        self.q = torch.randn(batch, Hq, D, generator=gen).to(torch.bfloat16)
        self.out = torch.empty_like(self.q)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32)
        self.scale = D ** -0.5
        if method == "vllm":
            isa = vllm_isa()
            page = H * BLOCK * 2 * D  # bf16 K then V rows of one block and layer
            self.buf = cache_tensor(total * L * page * 2, dtype=torch.uint8, huge=huge)
            view = self.buf.view(torch.bfloat16).view(total, L, H, BLOCK, 2 * D)
            self.layers = [self._vllm_views(view[:, l], total, H, D) for l in range(L)]
            for kc, vc in self.layers:
                torch.ops._C.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, 1.0, 1.0,
                                                        "auto")
            meta = torch.ops._C.get_scheduler_metadata(batch, Hq, H, D, self.seq_lens,
                                                       torch.bfloat16, self.qsl, True, -1,
                                                       isa, True, None, "auto")

            def call(layer):
                kc, vc = layer
                torch.ops._C.cpu_attention_with_kv_cache(
                    self.q, kc, vc, self.out, self.qsl, self.seq_lens, self.scale, True, None,
                    -1, self.bt, 0.0, meta, None, None, 1.0, 1.0, "auto")
        else:
            fmt = parse_format(method)
            lay = fmt.layout(D, BLOCK)
            lops = ops.LayerOps(fmt, H, D, self.q.device, **uniform_codebooks(fmt))
            extra = staging_inputs(fmt, batch, ctx, H, D, gen)
            self.buf = cache_tensor(total * L * H * BLOCK * lay.token_bytes, dtype=torch.uint8,
                                    huge=huge)
            view = self.buf.view(total, L, H, BLOCK, lay.token_bytes)
            self.layers = [view[:, l] for l in range(L)]
            for cache in self.layers:
                lops.write(k, v, cache, slots)

            def call(cache):
                lops.attend(self.q, cache, self.bt, self.seq_lens, self.qsl, self.scale,
                            self.out, **extra)
        self.call = call

    @staticmethod
    def _vllm_views(layer, total, H, D):
        # one layer's blocks [total, H, BLOCK, 2D] (block stride: all layers' pages) -> its
        # K and V caches [total, H, BLOCK, D], as tests' vllm_decode_case splits one block
        return layer.view(total, H, 2 * BLOCK, D).chunk(2, dim=2)

    def step(self):
        for layer in self.layers:
            self.call(layer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,int8_token,int4_group32,kivi2,nuq3")
    ap.add_argument("--shape", default="9/3/64", help="Hq/H/D (9/3/64: SmolLM2)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    Hq, H, D = (int(x) for x in args.shape.split("/"))
    methods = ([] if args.no_vllm or not vllm_available() else ["vllm"]) + \
        args.formats.split(",")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, vllm-kvq SIMD path "
          f"{ops.simd_path()}, transparent huge pages: {hugepages.thp_mode() or 'none'}; "
          f"{Hq}/{H}/{D}, batch {args.batch}, context {args.context}, {args.layers} layers")
    print(f"{'method':>16} {'4 KiB ms':>9} {'huge ms':>8} {'x':>5} {'4 KiB cpu':>10} "
          f"{'huge cpu':>9} {'x cpu':>6}")
    for method in methods:
        cases = {huge: Case(method, huge, Hq, H, D, args.batch, args.context, args.layers,
                            torch.Generator().manual_seed(0)) for huge in (False, True)}
        wall = {False: [], True: []}
        cpu = {False: [], True: []}
        for r in range(args.repeats):
            order = list(cases.items())
            for huge, case in order if r % 2 == 0 else order[::-1]:  # neither always first
                case.step()
                t0, c0 = time.perf_counter(), time.process_time()
                case.step()
                wall[huge].append(time.perf_counter() - t0)
                cpu[huge].append(time.process_time() - c0)
        med = {h: sorted(x)[len(x) // 2] * 1e3 for h, x in wall.items()}
        medc = {h: sorted(x)[len(x) // 2] * 1e3 for h, x in cpu.items()}
        print(f"{method:>16} {med[False]:9.2f} {med[True]:8.2f} {med[False] / med[True]:5.2f} "
              f"{medc[False]:10.2f} {medc[True]:9.2f} {medc[False] / medc[True]:6.2f}")
    print("medians over the repeats of one step (a call per layer); x > 1: faster on huge pages")


if __name__ == "__main__":
    main()
