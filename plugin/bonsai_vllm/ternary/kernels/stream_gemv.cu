// The ternary layer for one, two or four batch rows (a decode step; with MTP, its token and draft; issue 19):
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

#include "common.cuh"  // u32, u16, LANES, half_to_float, store_y

__device__ __forceinline__ int dp4a(u32 a, u32 b, int c) {
  int d;
  asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
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

// Template: M batch rows (1, or 2: one user's token and its MTP draft), C code words per thread, R output rows per
// tile (M · R <= 32), KW = K / 16 words per row (the CTA has W = ceil(KW / 32C) warps), PF: prefetch the next tile,
// OUT: y's type. Arguments: packed int32 [N, K/16], scales fp16 [N, K/128], the M activation rows (xa, xr int32
// [M, 4, K/16]; gx, gr int32 [M, K/128]; s float32 [M, 2, K/128]), y [M, N] (contiguous), N, and the
// shared-memory row capacity `cap` (>= the rows of any CTA: ceil(N / gridDim.x)); dynamic shared memory
// W · M · cap floats.
template <int KW, int C>
struct Warps {  // the CTA's warps: KW words of a row, C per thread
  static constexpr int value = (KW + 32 * C - 1) / (32 * C);
};

template <int M, int C, int R, int KW, bool PF, int OUT>
__global__ void __launch_bounds__(32 * Warps<KW, C>::value) ternary_stream_gemv(const u32* __restrict__ packed,
                                                            const u16* __restrict__ scales,
                                                            const u32* __restrict__ xa, const u32* __restrict__ xr,
                                                            const int* __restrict__ gx, const int* __restrict__ gr,
                                                            const float* __restrict__ s, void* __restrict__ y,
                                                            int N, int cap) {
  static_assert(M == 1 || M == 2 || M == 4, "M: 1, 2 or 4 batch rows");
  static_assert(R == 1 || R == 2 || R == 4 || R == 8 || R == 16 || R == 32, "R: a power of two up to 32");
  static_assert(M * R <= 32, "M · R partials per thread at most (one per lane after the butterfly)");
  static_assert(C == 1 || C == 2 || C == 4, "C: 1, 2 or 4 words");
  static_assert(KW % 8 == 0, "K: whole groups of 128 inputs");
  constexpr int W = Warps<KW, C>::value, groups = KW / 8, MR = M * R;
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
#pragma unroll
  for (int m = 0; m < M; ++m) {
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
