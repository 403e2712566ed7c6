// The ternary layer for 3 to 64 rows on int8 tensor cores (issue 19): y[M, N] = x · W'^T.
//
// Compiled at run time by NVRTC for the GPU it runs on (mma.py; no headers, no nvcc in the image). The codes
// are read in the checkpoint's own layout (int32 [N, K/16], code i of a word at bits 2i, u = code in {0,1,2},
// weight = u - 1) and decoded in registers straight into the operand of `mma.sync.m16n8k32.s8`; the
// activations come as dp4a.prepare leaves them (per group of 128 inputs: x ≈ s1·x8 + s2·r8, int8 bytes stored
// "planar": word w of lane j holds inputs 16w + 4b + j, b = 0..3), so one prep serves this kernel and the dp4a
// GEMV. The weights are the A operand (16 output rows per mma), the activation rows the B operand (8 per
// mma): "swap AB", so a batch of 3 rows pads to 8, not to 64.
//
// Why the operands line up with no shuffle: in m16n8k32 the A register a0 of a thread (group g = lane/4,
// t = lane%4) holds row g, k = 4t..4t+3, and b0 holds k = 4t..4t+3 of column g. Let one mma cover two code
// words (32 inputs). (word >> 2t) & 0x03030303 is lane t of a word: byte b = the code of input 16w + 4b + t,
// which is byte b of the activation word xa[row, t, w]. So with
//     a0 = lane t of word w of row g      a1 = the same for row g + 8
//     a2 = lane t of word w+1 of row g    a3 = the same for row g + 8
//     b0 = xa[col g, t, w]                b1 = xa[col g, t, w + 1]
// the mma's k index 4t + b means input 16w + 4b + t on both sides (and 16 + 4t + b the word after). Two
// instructions decode four weights; the four threads of a quad load the same words (one request).
//
// Per group of 128 inputs (four mma k-steps) the int32 sum is Σ u·x8 = Σ (w + 1)·x8, so
//     y[m, n] += scale[n, g] · (s1[m, g] · (Σ u·x8 − Σ x8) + s2[m, g] · (Σ u·r8 − Σ r8))       (float32)
// the same integer maths as dp4a.gemv_reference; RES = false drops the r8 term (x to int8 per group only).
//
// Work split: a CTA of WARPS warps, each warp R tiles of 16 output rows and all T·8 batch rows (M <= 64), over
// the groups of its K slice (blockIdx.y). With several slices each CTA writes its float32 partial tile and
// the last CTA of a row tile (a counter per tile) adds the partials in slice order, writes y and resets the
// counter: deterministic, one launch, CUDA-graph safe.

typedef unsigned int u32;
typedef unsigned short u16;

#define LANES 0x03030303u

__device__ __forceinline__ void load4(const u32* p, u32& a, u32& b, u32& c, u32& d) {
  // 16 bytes through the non-coherent path, not kept in L1: the codes are read once per call.
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
}

__device__ __forceinline__ void load4_cached(const u32* p, u32& a, u32& b, u32& c, u32& d) {
  // 16 bytes of activations: every warp of the CTA reads them, so they stay in L1.
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
}

__device__ __forceinline__ float half_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ void mma_s8(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
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

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// PF > 0: PF groups ahead, ask for the codes (into L2) and this thread's activation words (into L1), so the
// loads of a later iteration find them near; registers stay as they are.
template <int T, int R, int WARPS, bool RES, int OUT, int PF>
__global__ void __launch_bounds__(WARPS * 32)
ternary_mma(const u32* __restrict__ codes,   // [N, KW]
            const u16* __restrict__ scales,  // fp16 [N, G]
            const u32* __restrict__ xa,      // [M, 4, KW] planar int8 of x
            const u32* __restrict__ xr,      // [M, 4, KW] planar int8 of the residual (RES)
            const int* __restrict__ gx,      // [M, G] Σ x8 per group
            const int* __restrict__ gr,      // [M, G] Σ r8 per group (RES)
            const float* __restrict__ sx,    // [M, 2, G] s1, s2 per group
            void* __restrict__ y,            // [M, ldy] of OUT's type
            float* __restrict__ partials,    // [splits, M, N] (splits > 1)
            int* __restrict__ counters,      // [N / (16 R WARPS)] zeros between calls (splits > 1)
            int M, int N, int KW, int groups_per_split, int ldy) {
  const int G = KW / 8;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3, shift = 2 * t;
  const int row0 = (blockIdx.x * WARPS + warp) * 16 * R;  // this warp's first output row
  const int splits = gridDim.y;
  const int g0 = blockIdx.y * groups_per_split;
  const int g1 = min(G, g0 + groups_per_split);

  float acc[R][T][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < T; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][j][e] = 0.f;

  if (row0 < N) {
    // Double buffer: the next group's code words are in flight while this group's products run.
    u32 wa[R][8], wb[R][8], na[R][8], nb[R][8];
    const u32* rowa[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      rowa[r] = codes + (long)(row0 + 16 * r + g) * KW;
      if (g0 < g1) {
        load4(rowa[r] + 8 * g0, wa[r][0], wa[r][1], wa[r][2], wa[r][3]);
        load4(rowa[r] + 8 * g0 + 4, wa[r][4], wa[r][5], wa[r][6], wa[r][7]);
        load4(rowa[r] + 8L * KW + 8 * g0, wb[r][0], wb[r][1], wb[r][2], wb[r][3]);
        load4(rowa[r] + 8L * KW + 8 * g0 + 4, wb[r][4], wb[r][5], wb[r][6], wb[r][7]);
      }
    }
    for (int grp = g0; grp < g1; ++grp) {
      if (PF > 0 && grp + PF < g1) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          prefetch_l2(rowa[r] + 8 * (grp + PF));
          prefetch_l2(rowa[r] + 8L * KW + 8 * (grp + PF));
        }
#pragma unroll
        for (int j = 0; j < T; ++j) {
          const int m = 8 * j + g;
          if (m < M) {
            prefetch_l1(xa + ((long)m * 4 + t) * KW + 8 * (grp + PF));
            if (RES) prefetch_l1(xr + ((long)m * 4 + t) * KW + 8 * (grp + PF));
          }
        }
      }
      if (grp + 1 < g1) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int w = 8 * (grp + 1);
          load4(rowa[r] + w, na[r][0], na[r][1], na[r][2], na[r][3]);
          load4(rowa[r] + w + 4, na[r][4], na[r][5], na[r][6], na[r][7]);
          load4(rowa[r] + 8L * KW + w, nb[r][0], nb[r][1], nb[r][2], nb[r][3]);
          load4(rowa[r] + 8L * KW + w + 4, nb[r][4], nb[r][5], nb[r][6], nb[r][7]);
        }
      }
      // Lane t of this group's words, per k-step s (words 2s, 2s+1): the A operands, made once for all batch rows.
      u32 a[R][4][4];
      float sa[R], sb[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          a[r][s][0] = (wa[r][2 * s] >> shift) & LANES;
          a[r][s][1] = (wb[r][2 * s] >> shift) & LANES;
          a[r][s][2] = (wa[r][2 * s + 1] >> shift) & LANES;
          a[r][s][3] = (wb[r][2 * s + 1] >> shift) & LANES;
        }
        sa[r] = half_to_float(scales[(long)(row0 + 16 * r + g) * G + grp]);
        sb[r] = half_to_float(scales[(long)(row0 + 16 * r + g + 8) * G + grp]);
      }
#pragma unroll
      for (int j = 0; j < T; ++j) {
        // B operands: batch row 8j + g, lane t, this group's eight words (zeros past M).
        const int m = 8 * j + g;
        u32 b[8], br[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) b[i] = br[i] = 0u;
        if (m < M) {
          const u32* p = xa + ((long)m * 4 + t) * KW + 8 * grp;
          load4_cached(p, b[0], b[1], b[2], b[3]);
          load4_cached(p + 4, b[4], b[5], b[6], b[7]);
          if (RES) {
            const u32* q = xr + ((long)m * 4 + t) * KW + 8 * grp;
            load4_cached(q, br[0], br[1], br[2], br[3]);
            load4_cached(q + 4, br[4], br[5], br[6], br[7]);
          }
        }
        // The accumulator's columns are batch rows 8j + 2t and 8j + 2t + 1.
        const int m0 = 8 * j + 2 * t, m1 = m0 + 1;
        const float s10 = m0 < M ? sx[(long)m0 * 2 * G + grp] : 0.f;
        const float s11 = m1 < M ? sx[(long)m1 * 2 * G + grp] : 0.f;
        const float x10 = m0 < M ? (float)gx[(long)m0 * G + grp] : 0.f;
        const float x11 = m1 < M ? (float)gx[(long)m1 * G + grp] : 0.f;
        float s20 = 0.f, s21 = 0.f, x20 = 0.f, x21 = 0.f;
        if (RES) {
          s20 = m0 < M ? sx[(long)m0 * 2 * G + G + grp] : 0.f;
          s21 = m1 < M ? sx[(long)m1 * 2 * G + G + grp] : 0.f;
          x20 = m0 < M ? (float)gr[(long)m0 * G + grp] : 0.f;
          x21 = m1 < M ? (float)gr[(long)m1 * G + grp] : 0.f;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          int c[4] = {0, 0, 0, 0}, cr[4] = {0, 0, 0, 0};
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            mma_s8(c, a[r][s][0], a[r][s][1], a[r][s][2], a[r][s][3], b[2 * s], b[2 * s + 1]);
            if (RES) mma_s8(cr, a[r][s][0], a[r][s][1], a[r][s][2], a[r][s][3], br[2 * s], br[2 * s + 1]);
          }
          float v0 = s10 * ((float)c[0] - x10), v1 = s11 * ((float)c[1] - x11);
          float v2 = s10 * ((float)c[2] - x10), v3 = s11 * ((float)c[3] - x11);
          if (RES) {
            v0 += s20 * ((float)cr[0] - x20);
            v1 += s21 * ((float)cr[1] - x21);
            v2 += s20 * ((float)cr[2] - x20);
            v3 += s21 * ((float)cr[3] - x21);
          }
          acc[r][j][0] += sa[r] * v0;
          acc[r][j][1] += sa[r] * v1;
          acc[r][j][2] += sb[r] * v2;
          acc[r][j][3] += sb[r] * v3;
        }
      }
      if (grp + 1 < g1) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            wa[r][i] = na[r][i];
            wb[r][i] = nb[r][i];
          }
      }
    }
  }

  // The accumulator of (r, j) holds rows row0 + 16r + g (e = 0, 1) and + 8 (e = 2, 3), batch rows 8j + 2t + e%2.
  if (splits == 1) {
    if (row0 >= N) return;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < T; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = 8 * j + 2 * t + (e & 1), n = row0 + 16 * r + g + 8 * (e >> 1);
          if (m < M) store_y<OUT>(y, (long)m * ldy + n, acc[r][j][e]);
        }
    return;
  }
  if (row0 < N) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < T; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = 8 * j + 2 * t + (e & 1), n = row0 + 16 * r + g + 8 * (e >> 1);
          if (m < M) partials[((long)blockIdx.y * M + m) * N + n] = acc[r][j][e];
        }
  }
  __threadfence();  // this CTA's partials are visible to whichever CTA comes last
  __syncthreads();
  __shared__ int last;
  if (threadIdx.x == 0) last = atomicAdd(counters + blockIdx.x, 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (row0 < N) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < T; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = 8 * j + 2 * t + (e & 1), n = row0 + 16 * r + g + 8 * (e >> 1);
          if (m < M) {
            float sum = 0.f;
            for (int s = 0; s < splits; ++s) sum += __ldcg(partials + ((long)s * M + m) * N + n);
            store_y<OUT>(y, (long)m * ldy + n, sum);
          }
        }
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next call (and CUDA-graph replays)
}
