// The ternary layer for one or two batch rows (a decode step; with MTP, its token and draft; issue 19):
// y[M, N] = x · W'^T, codes streamed.
//
// Compiled at run time by NVRTC (stream_gemv.py), like mma.cu. At one row the layer is a stream of code bytes
// that must leave DRAM at full speed; everything else is arranged so that each SM keeps many of those bytes in
// flight and spends few instructions on each:
//
// - The activations stay in registers for the whole call. They come as dp4a.prepare leaves them (per group of
//   128 inputs x ≈ s1·x8 + s2·r8; int8 bytes "planar": word w of lane j holds inputs 16w + 4b + j, b = 0..3).
//   Thread c of the CTA owns words [C·c, C·c + C) of every row: it keeps those words' x8 and r8 lanes (8·C
//   registers per batch row) and its group's s1, s2 once, and for each row loads just its C words of codes (a warp reads
//   128·C contiguous bytes per row, the CTA a whole row).
// - Per code word: lane j of the word is (word >> 2j) & 0x03030303 (byte b = u of input 16w + 4b + j, u =
//   weight + 1 in {0, 1, 2}), and two dp4a per lane give Σ u·x8 and Σ u·r8. The group's Σ x8 and Σ r8 are
//   subtracted in integers, by the one thread whose words start the group (its sums start from −Σ x8, −Σ r8):
//       y[n] = Σ_g scale[n, g] · (s1[g] · (Σ u·x8 − Σ x8) + s2[g] · (Σ u·r8 − Σ r8))       (float32)
//   the integer maths of dp4a.gemv_reference.
// - The codes of the first tile are requested before the activations are read, and the kernel may be launched
//   as a programmatic dependent of the prep kernel: the weight stream then starts while the prep still runs.
// - A CTA takes a contiguous range of output rows (about N / gridDim.x: the launch makes one wave of CTAs, so the
//   bytes are balanced across SMs to a row), R rows at a time; with PF the next R rows' codes and scales are
//   loaded before this tile's dp4a run, so a thread always has a tile of loads in flight.
// - Per tile each warp folds its R per-thread partials into R row sums with R − 1 + log2(32 / R) shuffles (a
//   transposing butterfly: at each step a lane keeps half of its rows and receives the other lane's half), and
//   writes them to shared memory; after the last tile one barrier, then the CTA adds the W warps' sums of each
//   row in warp order and stores y. No K slices, no partial buffers, no atomics: the same input gives the same
//   bits every call.

typedef unsigned int u32;
typedef unsigned short u16;

#define LANES 0x03030303u

__device__ __forceinline__ int dp4a(u32 a, u32 b, int c) {
  int d;
  asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ float half_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// C words of codes where `ok` (zeros elsewhere): read once, so they bypass L1 (non-coherent path, no
// allocation). The predicate is a PTX operand, not a branch: the loads of a tile stay one basic block.
template <int C>
struct Words {
  u32 w[C];
};

template <int C>
__device__ __forceinline__ Words<C> load_words(const u32* p, bool ok) {
  Words<C> r;
  if (C == 1) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %1, 0;\n mov.b32 %0, 0;\n"
                 " @q ld.global.nc.L1::no_allocate.u32 %0, [%2];\n}"
                 : "=r"(r.w[0]) : "r"((int)ok), "l"(p));
  } else if (C == 2) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
                 " @q ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%3];\n}"
                 : "=r"(r.w[0]), "=r"(r.w[C > 1 ? 1 : 0]) : "r"((int)ok), "l"(p));
  } else {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %4, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
                 " mov.b32 %2, 0;\n mov.b32 %3, 0;\n @q ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%5];\n}"
                 : "=r"(r.w[0]), "=r"(r.w[C > 1 ? 1 : 0]), "=r"(r.w[C > 2 ? 2 : 0]), "=r"(r.w[C > 3 ? 3 : 0])
                 : "r"((int)ok), "l"(p));
  }
  return r;
}

__device__ __forceinline__ u16 load_half(const u16* p, bool ok) {
  u16 h;
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %1, 0;\n mov.b16 %0, 0;\n @q ld.global.nc.u16 %0, [%2];\n}"
               : "=h"(h) : "r"((int)ok), "l"(p));
  return h;
}

// y's element type: OUT 0 float32, 1 bfloat16, 2 float16.
template <int OUT>
__device__ __forceinline__ void store_y(void* y, long i, float v) {
  if (OUT == 0) {
    reinterpret_cast<float*>(y)[i] = v;
  } else if (OUT == 1) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    reinterpret_cast<u16*>(y)[i] = h;
  } else {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    reinterpret_cast<u16*>(y)[i] = h;
  }
}

// One tile's loads for this thread: R rows of C code words and the scale of the thread's group in each row.
template <int C, int R>
struct Tile {
  Words<C> codes[R];
  u16 scale[R];
};

// Rows n0 .. n0 + R − 1 that are below `end`; rows past it (and threads past the row's words) load nothing and
// hold zero codes and a zero scale, so their partials are exactly zero. KW is a template argument so that the
// rows' addresses are one base plus immediate offsets.
template <int C, int R, int KW>
__device__ __forceinline__ void load_tile(Tile<C, R>& t, const u32* packed, const u16* scales, long n0, long end,
                                          int w0, int g, bool active) {
  const u32* p = packed + n0 * KW + w0;
  const u16* q = scales + n0 * (KW / 8) + g;
  if (n0 + R <= end) {  // a whole tile: one predicate (this thread has words) for every load
#pragma unroll
    for (int r = 0; r < R; ++r) {
      t.codes[r] = load_words<C>(p + r * KW, active);
      t.scale[r] = load_half(q + r * (KW / 8), active);
    }
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const bool ok = active && n0 + r < end;
      t.codes[r] = load_words<C>(p + r * KW, ok);
      t.scale[r] = load_half(q + r * (KW / 8), ok);
    }
  }
}

// ---- the activation prep inside the kernel (PREP 1: x comes rotated; PREP 2: rotate it here) -------------------
// With two words per thread, thread c holds inputs [32c, 32c + 32) of a row, so a warp holds one Hadamard block of
// 1024 and four threads one group of 128: the rotation and the per-group int8 split need only shuffles within a
// warp. Every CTA prepares the whole row for itself (x is a few KB from L2) while its first codes are in flight,
// instead of a prep kernel writing it once for all: one launch less per layer. The maths is dp4a.prepare's (the
// same float32 operations, no FMA contraction); the rotation's float32 rounding differs from the prep kernel's,
// so an input on an int8 rounding boundary may land one step over, as between the two prep kernels.

#define INV127 0.007874015718698502f  // the float32 of 1/127, as torch and the prep kernels use it

__device__ __forceinline__ float round_away(float v) {  // half away from zero, as dp4a._round
  return copysignf(floorf(fabsf(v) + 0.5f), v);
}

// x (bf16) row values at inputs [32c, 32c + 32) -> v (zeros past the row: `active` false), rotated by the block's
// signed Hadamard if ROTATE (whole blocks: every thread active).
template <bool ROTATE>
__device__ __forceinline__ void load_row(float (&v)[32], const u16* x, const float* signs, int c, int lane,
                                         bool active) {
  const uint4* src = reinterpret_cast<const uint4*>(x + 32 * c);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint4 w = active ? src[q] : make_uint4(0u, 0u, 0u, 0u);
    const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      v[8 * q + 2 * h] = __int_as_float(ws[h] << 16);
      v[8 * q + 2 * h + 1] = __int_as_float(ws[h] & 0xffff0000u);
    }
  }
  if (!ROTATE) return;
#pragma unroll
  for (int t = 0; t < 32; ++t) v[t] = __fmul_rn(v[t], signs[32 * c + t]);
  // index i = 32 lane + t of the block: butterflies over t's bits in registers, then over lane's bits by shuffles
#pragma unroll
  for (int bit = 1; bit < 32; bit <<= 1)
#pragma unroll
    for (int t = 0; t < 32; ++t)
      if (!(t & bit)) {
        const float a = v[t], b = v[t | bit];
        v[t] = __fadd_rn(a, b);
        v[t | bit] = __fsub_rn(a, b);
      }
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const bool upper = lane & off;
#pragma unroll
    for (int t = 0; t < 32; ++t) {
      const float other = __shfl_xor_sync(0xffffffffu, v[t], off);
      v[t] = upper ? __fsub_rn(other, v[t]) : __fadd_rn(v[t], other);
    }
  }
#pragma unroll
  for (int t = 0; t < 32; ++t) v[t] = __fmul_rn(v[t], 0.03125f);  // 1 / sqrt(1024), exact
}

// v (this thread's 32 inputs) -> its x8 and r8 lanes of two words, the group's s1, s2 and sums (four threads).
__device__ __forceinline__ void quantize_row(float (&v)[32], u32 (&x8)[2][4], u32 (&q8)[2][4], float& s1, float& s2,
                                             int& sum1, int& sum2) {
  float amax = 0.f;
#pragma unroll
  for (int t = 0; t < 32; ++t) amax = fmaxf(amax, fabsf(v[t]));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  s1 = __fmul_rn(fmaxf(amax, 1e-30f), INV127);
  const float inv1 = __frcp_rn(s1);
  // x8 bytes packed as they are made (no array of 32 ints), v left holding the residual
  float rmax = 0.f;
  int sa = 0, sb = 0;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      u32 w = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {  // byte b of lane j of word i: input 16 i + 4 b + j
        const int t = 16 * i + 4 * b + j;
        const int q = (int)fminf(fmaxf(round_away(__fmul_rn(v[t], inv1)), -127.f), 127.f);
        v[t] = __fsub_rn(v[t], __fmul_rn((float)q, s1));  // the residual, rounded twice as torch does
        rmax = fmaxf(rmax, fabsf(v[t]));
        sa += q;
        w |= (u32)(q & 0xff) << (8 * b);
      }
      x8[i][j] = w;
    }
  rmax = fmaxf(rmax, __shfl_xor_sync(0xffffffffu, rmax, 1));
  rmax = fmaxf(rmax, __shfl_xor_sync(0xffffffffu, rmax, 2));
  s2 = __fmul_rn(fmaxf(rmax, 1e-30f), INV127);
  const float inv2 = __frcp_rn(s2);
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      u32 w = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int r = (int)fminf(fmaxf(round_away(__fmul_rn(v[16 * i + 4 * b + j], inv2)), -127.f), 127.f);
        sb += r;
        w |= (u32)(r & 0xff) << (8 * b);
      }
      q8[i][j] = w;
    }
  sa += __shfl_xor_sync(0xffffffffu, sa, 1);
  sa += __shfl_xor_sync(0xffffffffu, sa, 2);
  sb += __shfl_xor_sync(0xffffffffu, sb, 1);
  sb += __shfl_xor_sync(0xffffffffu, sb, 2);
  sum1 = sa;
  sum2 = sb;
}

// Template: M batch rows (1, or 2: one user's token and its MTP draft), C code words per thread, R output rows per
// tile (M · R <= 32), KW = K / 16 words per row (the CTA has W = ceil(KW / 32C) warps), PF: prefetch the next tile,
// OUT: y's type. Arguments: packed int32 [N, K/16], scales fp16 [N, K/128], the M activation rows (xa, xr int32
// [M, 4, K/16]; gx, gr int32 [M, K/128]; s float32 [M, 2, K/128]), y [M, N] (contiguous), N, and the
// shared-memory row capacity `cap` (>= the rows of any CTA: ceil(N / gridDim.x)); dynamic shared memory
// W · M · cap floats. PREP 1 or 2 (two words per thread): the activations are prepared here from x (bf16 [M, ldx],
// rotated already, or rotated here with `signs` float32 [K] per block of 1024); xa .. s are then not read.
template <int M, int C, int R, int KW, bool PF, int OUT, int PREP>
__global__ void __launch_bounds__(32 * ((KW + 32 * C - 1) / (32 * C))) ternary_stream_gemv(const u32* __restrict__ packed,
                                                            const u16* __restrict__ scales,
                                                            const u32* __restrict__ xa, const u32* __restrict__ xr,
                                                            const int* __restrict__ gx, const int* __restrict__ gr,
                                                            const float* __restrict__ s,
                                                            const u16* __restrict__ x, const float* __restrict__ signs,
                                                            int ldx, void* __restrict__ y, int N, int cap) {
  static_assert(M == 1 || M == 2 || M == 4, "M: 1, 2 or 4 batch rows");
  static_assert(R == 1 || R == 2 || R == 4 || R == 8 || R == 16 || R == 32, "R: a power of two up to 32");
  static_assert(M * R <= 32, "M · R partials per thread at most (one per lane after the butterfly)");
  static_assert(C == 1 || C == 2 || C == 4, "C: 1, 2 or 4 words");
  static_assert(KW % 8 == 0, "K: whole groups of 128 inputs");
  static_assert(PREP == 0 || C == 2, "the prep inside: two words per thread (four threads a group)");
  static_assert(PREP != 2 || KW % 64 == 0, "the rotation inside: whole blocks of 1024 inputs, one per warp");
  constexpr int W = (KW + 32 * C - 1) / (32 * C), groups = KW / 8, MR = M * R;
  extern __shared__ float warp_sums[];  // [W][M][cap]: warp w's sum of batch row m, output row r0 + i
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int w0 = C * threadIdx.x;  // this thread's first word of each row
  const bool active = KW % (32 * C) == 0 || w0 < KW;  // false only in the last warp, when KW is not whole warps
  const int g = active ? w0 >> 3 : 0;  // its group of 128 inputs (C <= 4 words never straddle two)
  const long r0 = (long)blockIdx.x * N / gridDim.x, r1 = (long)(blockIdx.x + 1) * N / gridDim.x;

  // The first tile's codes go out before anything else: they do not depend on the activations. Launched as a
  // programmatic dependent of the activation prep (stream_gemv.py), the kernel gets here while the prep still
  // runs; griddepcontrol.wait then waits for the prep's end and its stores (a no-op on an ordinary launch).
  Tile<C, R> cur;
  load_tile<C, R, KW>(cur, packed, scales, r0, r1, w0, g, active);
  asm volatile("griddepcontrol.wait;" ::: "memory");

  u32 x8[M][C][4], q8[M][C][4];  // x8 and r8 lanes of this thread's words, per batch row
  float s1[M], s2[M];
  int init1[M], init2[M];  // −Σ x8, −Σ r8 of the group, on the thread whose words start it
  if (PREP) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float v[32];
      int sum1, sum2;
      load_row<PREP == 2>(v, x + (long)m * ldx, signs, threadIdx.x, lane, active);
      quantize_row(v, reinterpret_cast<u32(&)[2][4]>(x8[m]), reinterpret_cast<u32(&)[2][4]>(q8[m]), s1[m], s2[m],
                   sum1, sum2);
      const bool first = (w0 & 7) == 0;
      init1[m] = first ? -sum1 : 0;
      init2[m] = first ? -sum2 : 0;
    }
  }
#pragma unroll
  for (int m = 0; m < M && !PREP; ++m) {
#pragma unroll
    for (int i = 0; i < C; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        x8[m][i][j] = active ? xa[(m * 4 + j) * KW + w0 + i] : 0u;
        q8[m][i][j] = active ? xr[(m * 4 + j) * KW + w0 + i] : 0u;
      }
    const bool first = active && (w0 & 7) == 0;
    s1[m] = active ? s[2 * m * groups + g] : 0.f;
    s2[m] = active ? s[(2 * m + 1) * groups + g] : 0.f;
    init1[m] = first ? -gx[m * groups + g] : 0;
    init2[m] = first ? -gr[m * groups + g] : 0;
  }

  for (long n0 = r0; n0 < r1; n0 += R) {
    Tile<C, R> next;
    if (PF && n0 + R < r1) load_tile<C, R, KW>(next, packed, scales, n0 + R, r1, w0, g, active);

    float p[MR];  // this thread's partial of (batch row m, output row r) at m · R + r
#pragma unroll
    for (int r = 0; r < R; ++r) {
      int a1[M], a2[M];
#pragma unroll
      for (int m = 0; m < M; ++m) a1[m] = init1[m], a2[m] = init2[m];
#pragma unroll
      for (int i = 0; i < C; ++i) {
        const u32 word = cur.codes[r].w[i];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const u32 u = (word >> (2 * j)) & LANES;  // decoded once for all batch rows
#pragma unroll
          for (int m = 0; m < M; ++m) {
            a1[m] = dp4a(u, x8[m][i][j], a1[m]);
            a2[m] = dp4a(u, q8[m][i][j], a2[m]);
          }
        }
      }
      const float scale = half_to_float(cur.scale[r]);
#pragma unroll
      for (int m = 0; m < M; ++m) p[m * R + r] = scale * fmaf(s1[m], (float)a1[m], s2[m] * (float)a2[m]);
    }

    // Transposing butterfly over the MR partials: after the step across lane bit b (16, 8, ...), a lane keeps the
    // half of its values that bit selects; once one is left, plain butterfly steps finish its sum. Lane l ends
    // with the warp's sum of value l / (32 / MR) (on all 32 / MR lanes of its group).
#pragma unroll
    for (int step = 0; step < 5; ++step) {
      const int off = 16 >> step, vals = MR >> (step + 1);  // values a lane keeps after this step (0: one, summed)
      if (vals >= 1) {
        const bool upper = lane & off;
#pragma unroll
        for (int i = 0; i < MR / 2; ++i) {
          if (i < vals) {
            const float send = upper ? p[i] : p[i + vals];
            const float keep = upper ? p[i + vals] : p[i];
            p[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
          }
        }
      } else {
        p[0] += __shfl_xor_sync(0xffffffffu, p[0], off);
      }
    }
    const int v = lane / (32 / MR), m = v / R, row = v % R;
    if (lane % (32 / MR) == 0 && n0 + row < r1) warp_sums[(warp * M + m) * cap + (n0 - r0) + row] = p[0];

    if (PF) cur = next;
    else if (n0 + R < r1) load_tile<C, R, KW>(cur, packed, scales, n0 + R, r1, w0, g, active);
  }

  __syncthreads();
  const int rows = r1 - r0;
  for (int i = threadIdx.x; i < M * rows; i += 32 * W) {
    const int m = i / rows, row = i - m * rows;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) sum += warp_sums[(w * M + m) * cap + row];
    store_y<OUT>(y, (long)m * N + r0 + row, sum);
  }
}
