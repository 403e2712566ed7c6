// The signed block Hadamard rotation of decode rows and the dp4a prep of the result, one CUDA C kernel (issue 19):
// Dp4aActivations of H(s ⊙ x) per block, what hadamard.rotate_dp4a gives through Triton, for the kernels after it
// (stream_gemv.cu, mma.cu, dp4a.py's GEMV). `norm_rotate_prep`, at the end of the file, runs the residual add and
// RMSNorm of the layer's input ahead of the same rotation + prep.
//
// Compiled at run time by NVRTC (rotate_prep.py), like mma.cu. Why not Triton: there the rotation is two
// tensor-core products per block with the layout conversions between them and the prep's reductions going
// through shared memory behind barriers; on the H200 that kernel took 3.0 µs a call where dp4a.prepare (no
// rotation) takes 1.9, on five of the six layers at every decode step. Here the butterflies run in registers and
// warp shuffles.
//
// Layout. A CTA takes R rows of one block of BLOCK inputs (blockIdx.x the block, blockIdx.y the group of rows),
// TPB = BLOCK / 8 threads per row: thread t holds inputs 8t .. 8t + 7 of the block. Sylvester's H_BLOCK is one
// butterfly per index bit, in any order (H_2 ⊗ ... ⊗ H_2), and leaves its output in natural order: bits 0-2 are
// butterflies inside the thread, bits 3-7 between lanes (shfl.xor), bits 8 and up between the row's warps through
// shared memory. Thread t then holds rotated inputs 8t .. 8t + 7, times 1/sqrt(BLOCK).
//
// The prep (dp4a.prepare_reference): per group of 128 inputs x ≈ s1·x8 + s2·r8, x8 the int8 of x, r8 the int8 of
// what x8 missed. A group is 16 threads (half a warp): its max |x| and its sums reduce over shfl.xor 1, 2, 4, 8.
// Each float operation is rounded on its own (PTX .rn, never fused into an FMA) in the reference's order, so the
// bytes equal the reference's of the same rotated values.
//
// Planar bytes: word w holds inputs 16w .. 16w + 15 as four lanes, byte b of lane j = input 16w + 4b + j. A word is
// two threads (h = t % 2 holds its bytes b = 2h, 2h + 1 of every lane); the pair swaps halves in one shuffle and
// each stores two whole lanes.

#include "common.cuh"  // u32, u16, half_to_float

// a op b rounded to nearest on its own: PTX .rn, which ptxas never fuses into an FMA (the reference rounds each step)
#define ROUNDED_OP(name, op)                                                 \
  __device__ __forceinline__ float name(float a, float b) {                  \
    float d;                                                                 \
    asm(op ".rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));                \
    return d;                                                                \
  }
ROUNDED_OP(mul_rn, "mul")
ROUNDED_OP(add_rn, "add")
ROUNDED_OP(sub_rn, "sub")
ROUNDED_OP(div_rn, "div")

// dp4a.py's _round_int8: half away from zero, clamped to [-127, 127].
__device__ __forceinline__ float round_int8(float v) {
  const float r = v < 0.f ? -floorf(add_rn(-v, 0.5f)) : floorf(add_rn(v, 0.5f));
  return fminf(fmaxf(r, -127.f), 127.f);
}

// Eight consecutive inputs of x as float32: IN 0 float32, 1 bfloat16, 2 float16 (16-byte aligned).
template <int IN>
__device__ __forceinline__ void load8(const void* x, long i, float (&v)[8]) {
  if (IN == 0) {
    const float4 a = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(x) + i)[0];
    const float4 b = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(x) + i)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 p = *reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(x) + i);
    const u32 w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (IN == 1) {  // bf16: the high half of a float32
        v[2 * k] = __int_as_float(w[k] << 16);
        v[2 * k + 1] = __int_as_float(w[k] & 0xffff0000u);
      } else {
        v[2 * k] = half_to_float((u16)(w[k] & 0xffffu));
        v[2 * k + 1] = half_to_float((u16)(w[k] >> 16));
      }
    }
  }
}

// The max over a group of 128 inputs: 16 threads, eight values each.
__device__ __forceinline__ float group_absmax(const float (&v)[8]) {
  float a = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) a = fmaxf(a, fabsf(v[i]));
#pragma unroll
  for (int d = 1; d < 16; d *= 2) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, d));
  return a;
}

__device__ __forceinline__ int group_sum(int s) {
#pragma unroll
  for (int d = 1; d < 16; d *= 2) s += __shfl_xor_sync(0xffffffffu, s, d);
  return s;
}

// Lanes 2h and 2h + 1 of this thread's word (h = t % 2), from its own bytes (q: its eight int8 values) and its
// pair thread's: returned as {lane 2h, lane 2h + 1}.
__device__ __forceinline__ uint2 planar_lanes(const int (&q)[8], int h) {
  u32 half[4];  // lane j: bytes 2h, 2h + 1 (inputs 8h + j and 8h + 4 + j of the word) as 16 bits
#pragma unroll
  for (int j = 0; j < 4; ++j) half[j] = (u32)(q[j] & 0xff) | ((u32)(q[4 + j] & 0xff) << 8);
  const u32 send = h ? (half[0] | half[1] << 16) : (half[2] | half[3] << 16);  // the pair's two lanes
  const u32 got = __shfl_xor_sync(0xffffffffu, send, 1);
  const u32 m0 = h ? half[2] : half[0], m1 = h ? half[3] : half[1];
  // thread h = 0 holds the low 16 bits of each lane, h = 1 the high
  return h ? make_uint2((got & 0xffffu) | (m0 << 16), (got >> 16) | (m1 << 16))
           : make_uint2(m0 | (got << 16), m1 | (got & 0xffff0000u));
}

// H(s ⊙ x) / sqrt(BLOCK) of one block in place: v holds inputs 8t .. 8t + 7 of the block (already times their
// signs), r the block's slot among the R blocks of the CTA (each slot TPB = BLOCK / 8 consecutive threads). Every
// thread of the CTA calls it (the shared-memory steps hold barriers).
template <int BLOCK, int R>
__device__ __forceinline__ void rotate_block(float (&v)[8], int r, int t, int lane, float norm) {
  constexpr int TPB = BLOCK / 8;  // threads per block
  static_assert(TPB % 32 == 0 && (TPB & (TPB - 1)) == 0, "a block is whole warps, a power of two");
  // index bits 0-2: inside the thread
#pragma unroll
  for (int d = 1; d < 8; d *= 2)
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (!(i & d)) {
        const float a = v[i], b = v[i + d];
        v[i] = add_rn(a, b);
        v[i + d] = sub_rn(a, b);
      }
  // bits 3-7: between lanes (the upper lane of a pair keeps the difference)
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const bool upper = lane & d;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float o = __shfl_xor_sync(0xffffffffu, v[i], d);
      v[i] = upper ? sub_rn(o, v[i]) : add_rn(v[i], o);
    }
  }
  // bits 8 and up: between the block's warps
  if (TPB > 32) {
    __shared__ __align__(16) float buf[R * BLOCK];
    float4* mine = reinterpret_cast<float4*>(buf + r * BLOCK + 8 * t);
#pragma unroll
    for (int d = 32; d < TPB; d *= 2) {
      mine[0] = make_float4(v[0], v[1], v[2], v[3]);
      mine[1] = make_float4(v[4], v[5], v[6], v[7]);
      __syncthreads();
      const float4* theirs = reinterpret_cast<const float4*>(buf + r * BLOCK + 8 * (t ^ d));
      const float4 a = theirs[0], b = theirs[1];
      const float o[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      __syncthreads();  // everyone has read before the next bit's stores
      const bool upper = t & d;
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = upper ? sub_rn(o[i], v[i]) : add_rn(v[i], o[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = mul_rn(v[i], norm);
}

// dp4a's prep of rotated inputs col .. col + 7 of row m (v), per group of 128 (16 threads), and its stores. Every
// thread of the warp calls it (shuffles); rows that are not `live` store nothing.
__device__ __forceinline__ void prep_store(const float (&v)[8], bool live, int m, int K, int col, int t, int lane,
                                           u32* __restrict__ xa, u32* __restrict__ xr, int* __restrict__ gx,
                                           int* __restrict__ gr, float* __restrict__ sc) {
  constexpr float INV127 = (float)(1.0 / 127);  // dp4a.INV127 as float32
  const float s1 = mul_rn(fmaxf(group_absmax(v), 1e-30f), INV127), inv1 = div_rn(1.f, s1);
  float res[8];
  int q1[8], q2[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float x8 = round_int8(mul_rn(v[i], inv1));
    res[i] = sub_rn(v[i], mul_rn(x8, s1));
    q1[i] = (int)x8;
  }
  const float s2 = mul_rn(fmaxf(group_absmax(res), 1e-30f), INV127), inv2 = div_rn(1.f, s2);
#pragma unroll
  for (int i = 0; i < 8; ++i) q2[i] = (int)round_int8(mul_rn(res[i], inv2));
  int sum1 = 0, sum2 = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum1 += q1[i], sum2 += q2[i];
  sum1 = group_sum(sum1);
  sum2 = group_sum(sum2);
  const int h = t & 1;
  const uint2 la = planar_lanes(q1, h), lr = planar_lanes(q2, h);
  if (!live) return;
  const int G = K / 128, KW = K / 16;
  if ((lane & 15) == 0) {
    const int grp = (unsigned)col / 128;  // col >= 0: a shift
    gx[(long)m * G + grp] = sum1;
    gr[(long)m * G + grp] = sum2;
    sc[(long)m * 2 * G + grp] = s1;
    sc[(long)m * 2 * G + G + grp] = s2;
  }
  const long w = (long)m * 4 * KW + (col >> 4);  // lane 0's word of this thread's pair
  xa[w + (2 * h) * KW] = la.x;
  xa[w + (2 * h + 1) * KW] = la.y;
  xr[w + (2 * h) * KW] = lr.x;
  xr[w + (2 * h + 1) * KW] = lr.y;
}

// The eight signs at col (16-byte aligned).
__device__ __forceinline__ void load_signs(const float* __restrict__ signs, int col, float (&s)[8]) {
  const float4 a = reinterpret_cast<const float4*>(signs + col)[0];
  const float4 b = reinterpret_cast<const float4*>(signs + col)[1];
  s[0] = a.x, s[1] = a.y, s[2] = a.z, s[3] = a.w, s[4] = b.x, s[5] = b.y, s[6] = b.z, s[7] = b.w;
}

// Eight inputs times their signs (signs 16-byte aligned at col).
__device__ __forceinline__ void apply_signs(float (&v)[8], const float* __restrict__ signs, int col) {
  float s[8];
  load_signs(signs, col, s);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = mul_rn(v[i], s[i]);  // exact
}

template <int BLOCK, int R, int IN>
__global__ void __launch_bounds__(R * BLOCK / 8)
rotate_prep(const void* __restrict__ x,       // [M, stride_x] of IN's type, rows of K inputs
            const float* __restrict__ signs,  // [K] ±1
            u32* __restrict__ xa,             // [M, 4, K/16] planar int8 of x
            u32* __restrict__ xr,             // [M, 4, K/16] planar int8 of the residual
            int* __restrict__ gx,             // [M, G] Σ x8 per group
            int* __restrict__ gr,             // [M, G] Σ r8 per group
            float* __restrict__ sc,           // [M, 2, G] s1, s2 per group
            int M, int K, int stride_x,
            int norm_bits) {  // the float32 bits of 1 / sqrt(BLOCK) (a launch argument is an int or a pointer)
  // The kernel after this one (launched as its programmatic dependent) may start now: it issues its weights'
  // loads, then waits for this grid's end before it reads the activations. (Releasing it only as this grid's CTAs
  // exit was 2-19 % slower served on the H200.)
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  constexpr int TPB = BLOCK / 8;  // threads per row
  const int r = threadIdx.x / TPB, t = threadIdx.x % TPB, lane = threadIdx.x & 31;
  const int m = blockIdx.y * R + r;
  const bool live = m < M;  // rows past M compute on zeros (they take part in the shuffles and barriers)
  const int col = blockIdx.x * BLOCK + 8 * t;

  float v[8];
  if (live) {
    load8<IN>(x, (long)m * stride_x + col, v);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.f;
  }
  apply_signs(v, signs, col);
  rotate_block<BLOCK, R>(v, r, t, lane, __int_as_float(norm_bits));
  prep_store(v, live, m, K, col, t, lane, xa, xr, gx, gr, sc);
}

// x rounded to IN's type (1 bfloat16, 2 float16; 0 float32 as it is), as float32, and its bits for a store.
template <int IN>
__device__ __forceinline__ float round_to(float v, u16& bits) {
  if (IN == 1) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(v));
    return __int_as_float((u32)bits << 16);
  } else if (IN == 2) {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(v));
    return half_to_float(bits);
  }
  return v;
}

// Eight values of IN's type (their bits from round_to, or float32 as they are) stored at y + i (16-byte aligned).
template <int IN>
__device__ __forceinline__ void store8(void* y, long i, const float (&v)[8], const u16 (&bits)[8]) {
  if (IN == 0) {
    reinterpret_cast<float4*>(reinterpret_cast<float*>(y) + i)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(reinterpret_cast<float*>(y) + i)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint4 p;
    p.x = bits[0] | (u32)bits[1] << 16, p.y = bits[2] | (u32)bits[3] << 16;
    p.z = bits[4] | (u32)bits[5] << 16, p.w = bits[6] | (u32)bits[7] << 16;
    *reinterpret_cast<uint4*>(reinterpret_cast<u16*>(y) + i) = p;
  }
}

// z = x + residual (ADD; else x) at inputs c .. c + 7 of a row (x's at x_row, the residual's at r_row), float32.
template <int IN, int ADD>
__device__ __forceinline__ void load_sum(const void* x, const void* residual, long x_row, long r_row, int c,
                                         float (&z)[8]) {
  load8<IN>(x, x_row + c, z);
  if (ADD) {
    float q[8];
    load8<IN>(residual, r_row + c, q);
#pragma unroll
    for (int i = 0; i < 8; ++i) z[i] = add_rn(z[i], q[i]);
  }
}

// The residual add and RMSNorm ahead of a layer, fused with the rotation + prep of its output (issue 19: one
// kernel boundary less per normed layer input: the boundary cost ~1.1 µs on the H200, nineteenth session).
//   z = x + residual (float32; ADD = 0: z = x), residual_out = z in IN's type,
//   normed = (z · 1 / sqrt(mean(z²) + eps)) · (weight + offset) in IN's type (offset 1 for Qwen3.5's Gemma-style
//   norm, whose checkpoint stores weight - 1; the sum in float32, as vLLM's `self.weight.float() + 1.0`),
//   then what rotate_prep gives of `normed`.
// vLLM's fused_add_rms_norm computes the same formula; the sum of squares here goes in a fixed order (eight per
// "row thread" in turn, shfl.xor 1 .. 16, the row's warps in turn: rotate_prep.norm_reference) with 1 / sqrt rounded
// twice, where torch takes rsqrt, so `normed` may differ from vLLM's by one unit in the last place. Row thread i
// holds inputs 8i .. 8i + 7 of the row, K / 8 of them, in K / 256 "row warps".
// Layout:
// - PREP = 1: a CTA per block of a row (blockIdx.x the block, blockIdx.y the row), BLOCK / 8 threads, as rotate_prep
//   with R = 1. Each CTA sums the squares of the whole row itself (its thread t plays row threads t, t + TPB, ...,
//   reading the row from L2) and normalises, rotates and prepares its own block. (The first build ran a row in one
//   CTA of K / 8 threads: 4.8 µs alone at one row on the H200, its 20 warps issuing on one SM's four schedulers,
//   where the norm and the rotation + prep apart took 2.3 + 2.2.) So residual_out must not overlap residual or x:
//   another CTA may still read what this one writes.
// - PREP = 0: the add and norm only (rows a layer takes on another route, e.g. a prefill chunk): a CTA per row of
//   K / 8 threads, the row read once, normed rows stored; residual_out may be residual itself.
template <int BLOCK, int NB, int IN, int ADD, int PREP>
__global__ void __launch_bounds__(PREP ? BLOCK / 8 : NB * BLOCK / 8)
norm_rotate_prep(const void* __restrict__ x,    // [M, stride_x] of IN's type
                 const void* residual,          // [M, stride_r] (ADD; else unread); PREP = 0: may be residual_out
                 void* residual_out,            // [M, K] (ADD; else unwritten)
                 void* __restrict__ normed,     // [M, K] (store_normed; else unwritten)
                 const void* __restrict__ w,    // [K] of IN's type: the norm's weight
                 const float* __restrict__ signs,  // [K] ±1
                 u32* __restrict__ xa, u32* __restrict__ xr, int* __restrict__ gx, int* __restrict__ gr,
                 float* __restrict__ sc,        // the Dp4aActivations, as rotate_prep
                 int stride_x, int stride_r,
                 int store_normed,  // 0: the normed rows are not stored (only the activations are needed; PREP)
                 int offset_bits,  // the float32 bits of what the weight is offset by (1 for a Gemma-style norm)
                 int eps_bits,    // the float32 bits of eps
                 int norm_bits) { // the float32 bits of 1 / sqrt(BLOCK)
#if __CUDA_ARCH__ >= 900
  if (PREP) asm volatile("griddepcontrol.launch_dependents;");
#endif
  constexpr int TPB = BLOCK / 8, K = NB * BLOCK, ROW_THREADS = K / 8, ROW_WARPS = ROW_THREADS / 32;
  constexpr int THREADS = PREP ? TPB : ROW_THREADS, VT = ROW_THREADS / THREADS;  // row threads per thread
  static_assert(ROW_THREADS <= 1024 && THREADS % 32 == 0, "a row in one CTA, whole warps");
  const int m = PREP ? blockIdx.y : blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int col = 8 * ((PREP ? blockIdx.x * TPB : 0) + threadIdx.x);  // this thread's own inputs (its block's)
  // Everything is loaded up front: the row for the sum of squares, then this thread's own inputs, the norm's
  // weight and the signs beside them (loaded where they are used, each would add a memory latency after the barrier).
  float part[VT];  // the sum of squares of each of this thread's row threads
  float v[8], f[8], s[8];
  u16 bits[8];
#pragma unroll
  for (int j = 0; j < VT; ++j) {
    float z[8];
    load_sum<IN, ADD>(x, residual, (long)m * stride_x, (long)m * stride_r, 8 * (j * THREADS + threadIdx.x), z);
    part[j] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) part[j] = add_rn(part[j], mul_rn(z[i], z[i]));
    if (VT == 1) {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = z[i];
    }
  }
  if (VT > 1) load_sum<IN, ADD>(x, residual, (long)m * stride_x, (long)m * stride_r, col, v);  // own block (L1)
  load8<IN>(w, col, f);
  if (PREP) load_signs(signs, col, s);
  if (ADD) {
    float z[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) z[i] = round_to<IN>(v[i], bits[i]);
    store8<IN>(residual_out, (long)m * K + col, z, bits);
  }
  __shared__ float warp_sums[ROW_WARPS];
#pragma unroll
  for (int j = 0; j < VT; ++j) {
#pragma unroll
    for (int d = 1; d < 32; d *= 2) part[j] = add_rn(part[j], __shfl_xor_sync(0xffffffffu, part[j], d));
    if (lane == 0) warp_sums[j * (THREADS / 32) + warp] = part[j];  // row warp (j · THREADS + threadIdx.x) / 32
  }
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < ROW_WARPS; ++i) total = add_rn(total, warp_sums[i]);
  const float rstd = div_rn(1.f, __fsqrt_rn(add_rn(div_rn(total, (float)K), __int_as_float(eps_bits))));
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float factor = add_rn(f[i], __int_as_float(offset_bits));  // vLLM: weight.float() + 1.0
    v[i] = round_to<IN>(mul_rn(mul_rn(v[i], rstd), factor), bits[i]);
  }
  if (store_normed || !PREP) store8<IN>(normed, (long)m * K + col, v, bits);
  if (!PREP) return;
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = mul_rn(v[i], s[i]);  // exact
  rotate_block<BLOCK, 1>(v, 0, threadIdx.x, lane, __int_as_float(norm_bits));
  prep_store(v, true, m, K, col, threadIdx.x, lane, xa, xr, gx, gr, sc);
}
