// The rotation of rotated formats (vllm_kvq/rotation.py) on one SIMD path: rows of D values
// through x -> fwht(x * sc) (forward) or x -> fwht(x) * sc (inverse), sc = signs / sqrt(D),
// in fp32, read from and rounded once to float32 / float16 / bfloat16.
//
// fwht runs the butterfly stages in rotation.fwht's order, h = 1, 2, 4, ..., D/2: the
// element pair (i, i + h) (bit h of i clear) becomes (x_i + x_{i+h}, x_i - x_{i+h}). Each
// output is one add or subtract of the same two floats as there, so every path and the
// PyTorch reference round every value the same way (bit-identical results). Stages h < W
// pair lanes of one register (vbfly, per path), the rest pair whole registers.
//
// Included by attn_body.h after load_row_f / store_row_f (with VF, W, vbfly, ... of the path):
// run_task's fused rotation (AttnParams::rot_q / rot_out) uses fwht_row and scale_row.

// x [N * W] in place; N known at compile time, so the row can stay in registers (the
// attention kernel rotates every query and output row of a decode; a 512-token call at
// D = 64 timed the same either way, within this VM's noise).
template <int N>
static inline void fwht_regs(float* x) {
  VF r[N];
  for (int k = 0; k < N; ++k) r[k] = vload(x + k * W);
  for (int h = 1; h < W; h *= 2)
    for (int k = 0; k < N; ++k) r[k] = vbfly(r[k], h);
  for (int hk = 1; hk < N; hk *= 2)
    for (int k = 0; k < N; ++k)
      if (!(k & hk)) {
        const VF a = r[k], b = r[k + hk];
        r[k] = vadd(a, b);
        r[k + hk] = vsub(a, b);
      }
  for (int k = 0; k < N; ++k) vstore(x + k * W, r[k]);
}

// x [D] in place, D a power of two in [W, kMaxRotD].
static inline void fwht_row(float* x, int D) {
  static_assert(kMaxRotD / W <= 32, "fwht_row's cases cover kMaxRotD");
  switch (D / W) {
    case 1: fwht_regs<1>(x); break;
    case 2: fwht_regs<2>(x); break;
    case 4: fwht_regs<4>(x); break;
    case 8: fwht_regs<8>(x); break;
    case 16: fwht_regs<16>(x); break;
    default: fwht_regs<32>(x); break;
  }
}

static inline void scale_row(float* x, const float* sc, int D) {
  for (int d = 0; d < D; d += W) vstore(x + d, vmul(vload(x + d), vload(sc + d)));
}

// Rows [r0, r1) of a.in -> a.out (row r = (r / a.rows_inner, r % a.rows_inner)).
static void hadamard_rows_impl(const HadamardArgs& a, int64_t r0, int64_t r1) {
  alignas(64) float x[kMaxRotD];
  const int D = a.D;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r / a.rows_inner, j = r % a.rows_inner;
    load_row_f(a.in, a.in_dtype, i * a.in_s0 + j * a.in_s1, D, 1.0f, x);
    if (!a.inverse) scale_row(x, a.sc, D);
    fwht_row(x, D);
    if (a.inverse) scale_row(x, a.sc, D);
    store_row_f(a.out, a.out_dtype, i * a.out_s0 + j * a.out_s1, D, x);
  }
}
