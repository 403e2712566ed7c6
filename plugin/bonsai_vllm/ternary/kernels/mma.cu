// The ternary layer for 2 to 64 rows on int8 tensor cores (issue 19): y[M, N] = x · W'^T.
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
// instructions decode four weights; the four threads of a quad read the same words (a broadcast).
//
// Per group of 128 inputs (four mma k-steps) the int32 sum is Σ u·x8 = Σ (w + 1)·x8, so
//     y[m, n] += scale[n, g] · (s1[m, g] · (Σ u·x8 − Σ x8) + s2[m, g] · (Σ u·r8 − Σ r8))       (float32)
// the same integer maths as dp4a.gemv_reference; RES = false drops the r8 term (x to int8 per group only).
//
// Work split: a CTA of WARPS · WM · KS warps covers 16 · R · WARPS output rows and all T·8 batch rows (M <= 64)
// over the groups of its K slice (blockIdx.y); warp (wr, wm, ks) takes R row tiles, T / WM of the batch's column
// tiles and every KS-th group of each stage (KS > 1: more warps per SM on the same tile, their sums added through
// shared memory at the end; no more CTAs, partials or counters). The CTA's codes, activations and per-row
// scalars for the next STAGES - 1 stages (GPS groups each) are in flight through cp.async (or, with TMA, the codes
// and activations through one tensor copy each per stage) into shared memory
// while this stage's products run: the bytes in flight grow
// with STAGES and cost no registers, and each CTA fetches the activations once for all its warps. (The first
// version kept one group ahead per warp in registers and ran 1.3-2x slower at 8-64 rows: docs/benchmarks.md.)
// With several K slices each CTA writes its float32 partial tile and the last CTA of a row tile (a counter per
// tile) adds the partials in slice order, writes y and resets the counter: deterministic, one launch,
// CUDA-graph safe.

#include "common.cuh"  // u32, u16, LANES, half_to_float, store_y

__device__ __forceinline__ void mma_s8(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d = a · b + {c0, c1, c0, c1}: the first k-step of a group starts from its column pair's initial values
// without copying them into d first (two moves per mma saved).
__device__ __forceinline__ void mma_s8_from(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, int c0,
                                            int c1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %10, %11};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c0), "r"(c1));
}

// Calls f(acc, m, n) for each accumulator element of the thread whose batch row m is below M. The element
// (r, j, e) holds output row n = row0 + 16r + g (e = 0, 1) or + 8 (e = 2, 3), batch row m = 8 (j0 + j) + 2t + e%2.
template <int T, int R, class F>
__device__ __forceinline__ void for_each_output(const float (&acc)[R][T][4], int M, int row0, int g, int t, int j0,
                                                F f) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < T; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = 8 * (j0 + j) + 2 * t + (e & 1), n = row0 + 16 * r + g + 8 * (e >> 1);
        if (m < M) f(acc[r][j][e], m, n);
      }
}

// y (splits == 1), or this CTA's partial tile and, from the tile's last CTA, the slices' sum in slice order.
// Called by every thread of the CTA (it holds barriers).
template <int T, int R, int OUT>
__device__ __forceinline__ void write_tile(const float (&acc)[R][T][4], void* y, float* partials, int* counters,
                                           int M, int N, int ldy, int row0, int g, int t, int j0) {
  const int splits = gridDim.y;
  if (splits == 1) {
    if (row0 >= N) return;
    for_each_output(acc, M, row0, g, t, j0, [&](float v, int m, int n) { store_y<OUT>(y, (long)m * ldy + n, v); });
    return;
  }
  if (row0 < N)
    for_each_output(acc, M, row0, g, t, j0,
                    [&](float v, int m, int n) { partials[((long)blockIdx.y * M + m) * N + n] = v; });
  __threadfence();  // this CTA's partials are visible to whichever CTA comes last
  __syncthreads();
  __shared__ int last;
  if (threadIdx.x == 0) last = atomicAdd(counters + blockIdx.x, 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (row0 < N)
    for_each_output(acc, M, row0, g, t, j0, [&](float, int m, int n) {
      float sum = 0.f;
      for (int s = 0; s < splits; ++s) sum += __ldcg(partials + ((long)s * M + m) * N + n);
      store_y<OUT>(y, (long)m * ldy + n, sum);
    });
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next call (and CUDA-graph replays)
}

// Shared memory per stage (words): codes [ROWS][8 GPS], one row per output row of the CTA, as in global; x8
// (and r8) [8T · 4 lanes][2 GPS chunks of 16 bytes], the chunk order swizzled so that the eight threads of a
// 16-byte phase (two batch rows, four lanes) hit eight different bank quads; scalars [GPS][4T pairs of batch
// rows][s1, Σx8, s2, Σr8][2]: a thread's two columns' scalars are one 16-byte load (two with the residual).
// Batch rows past M and groups past the slice are not copied (their columns are never stored, their groups
// never read).

#define MAGIC 0x4B400000  // the bits of 1.5 · 2^23: MAGIC + i, for |i| < 2^22, are the float 1.5 · 2^23 + i
#define MAGIC_F 12582912.f

struct alignas(16) u32x4 {
  u32 x, y, z, w;
};

// The dynamic shared memory this launch was given (%dynamic_smem_size).
__device__ __forceinline__ u32 dynamic_shared_bytes() {
  u32 n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}

__device__ __forceinline__ u32 shared_address(const void* p) {
  u32 a;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// The copies take 32-bit shared addresses worked out before the main loop and their predicate as an operand:
// a generic pointer converted per copy (cvta) and an `if` around each cost ~20 instructions per copy
// (two special-register reads, 64-bit address arithmetic, a convergence barrier), most of the loop at 16-64 rows.
__device__ __forceinline__ void copy16(u32 dst, const void* src, bool pred) {
  // .cg: into L2 only, not L1 (codes are read once; activations are re-read by other CTAs from L2).
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %2, 0; @p cp.async.cg.shared.global [%0], [%1], 16; }"
               ::"r"(dst), "l"(src), "r"((int)pred));
}

__device__ __forceinline__ void copy4(u32 dst, const void* src, bool pred) {
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %2, 0; @p cp.async.ca.shared.global [%0], [%1], 4; }"
               ::"r"(dst), "l"(src), "r"((int)pred));
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// The tensor-map route (ternary_mma's TMA): a stage's codes and activations each come in one bulk tensor copy
// (cp.async.bulk.tensor, "TMA") that one thread issues and that completes on the stage's mbarrier, in place of 13
// or so 16-byte cp.async per thread (their address arithmetic was a fifth of the stage loop's instructions at
// 64 rows: docs/benchmarks.md, twenty-third session). The maps are encoded on the host (mma.py, nvrtc.tensor_map)
// and passed by value; the hardware writes each box row's 16-byte chunks swizzled (the 32-, 64- or 128-byte
// pattern for rows of 32, 64 or 128 bytes: chunk c of row r at c ^ ((r / (8 / C)) % C), C chunks per row), which
// is the activations' own swizzle (PipeStage::swizzle), so only the codes' reads change.
struct alignas(64) TensorMap {  // CUtensorMap: 128 opaque bytes
  unsigned long long opaque[16];
};

__device__ __forceinline__ void barrier_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

// One arrival that also expects `bytes` of bulk copies to complete on the barrier's current phase.
__device__ __forceinline__ void barrier_expect(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void barrier_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// The box of `map` at (column c0, row c1), in elements, into shared memory at `dst`, completing on `bar`. The
// destination is the CTA's own shared memory (.shared::cta, PTX 8.6): with .shared::cluster ptxas stored 8 zero
// bytes to the stack before every copy on sm_120 (not on sm_90).
__device__ __forceinline__ void tensor_copy(u32 dst, const TensorMap* map, int c0, int c1, u32 bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

// TMA: the tensor copies' layout: stages 1024-byte aligned (the 128-byte swizzle's period), the codes' rows unpadded
// (the hardware's swizzle, not a pad, keeps rows g and g + 1 on different bank quads).
template <int T, int R, int WARPS, bool RES, int STAGES, int GPS, bool TMA = false>
struct alignas(TMA ? 1024 : 16) PipeStage {  // 16-byte aligned: cp.async and the 16-byte loads
  static constexpr int ROWS = 16 * R * WARPS;  // output rows of the CTA
  static constexpr int CW = 8 * GPS;           // code words per row per stage
  static constexpr int CWP = GPS == 4 && !TMA ? CW + 4 : CW;  // row pitch: rows g and g + 1 on different bank quads
  static constexpr int MP = 8 * T;             // batch rows, padded to the mma's 8
  static constexpr int C = 2 * GPS;            // 16-byte chunks per (batch row, lane) per stage
  static constexpr int NX = RES ? 2 : 1;       // x8 (and r8)
  static constexpr int NS = RES ? 4 : 2;       // per batch row and group: s1, Σx8 (, s2, Σr8)
  static constexpr int WS = GPS / 2 + 1;       // 4-byte words of fp16 weight scales per row per stage
  u32 codes[ROWS * CWP];
  u32 x[NX][MP * 4 * CW];
  u32 scalars[GPS][MP / 2][NS][2];
  u32 wscales[ROWS * WS];  // the words holding the stage's groups' scales (from an even group: G is even)
  // What a row's 16-byte chunk indices are XORed with: the hardware tensor copies' 32/64/128-byte swizzle for
  // rows of C chunks, and the activations' own layout.
  static __device__ __forceinline__ int swizzle(int row) { return (row / (8 / C)) % C; }
  // The swizzled chunk of (batch row, lane) index ml = 4 m + lane: eight consecutive ml, same chunk q, land on
  // eight different 16-byte bank quads.
  static __device__ __forceinline__ int chunk(int ml, int q) { return ml * C + (q ^ swizzle(ml)); }
};

// Code-shape options, off by default, that the rule turns on per instance (mma.py's _CONST_START and _TMA; the rule
// takes ROW_OFFSETS nowhere now): each cuts instructions per stage but moves ptxas' register allocation, so each is
// faster on some instances and slower on others (docs/benchmarks.md, twenty-third and twenty-fourth sessions).
// Off, each compiles to the kernel from before it (the same SASS).
// - ROW_OFFSETS: each copy's source is a byte offset (u · row_bytes) from one pointer per stage, and the activation
//   copies are predicated on a per-thread count of batch-row chunks rather than a comparison per copy.
// - CONST_START: every mma starts from the constant MAGIC, and the float tail subtracts MAGIC + Σx8's float.
// - TMA: the tensor-map route: a stage's codes and activations come in tensor copies (above), and the launch
//   passes three maps by value after the other arguments (Maps: TensorMap three times; none without TMA, so the
//   kernel's signature is the one from before): the codes' ([N rows][KW words], a box of the CTA's rows × a stage's
//   words), x8's and r8's ([4 M rows (batch row, lane)][KW words], a box of 32 T rows × a stage's words; rows past
//   4 M arrive as zeros), each box row swizzled by its length.
template <int T, int R, int WARPS, int WM, bool RES, int OUT, int STAGES, int GPS, int KS = 1, bool FLAT = false,
          bool ROW_OFFSETS = false, bool CONST_START = false, bool TMA = false, class... Maps>
__global__ void __launch_bounds__(WARPS * WM * KS * 32)
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
            int M, int N, int KW, int groups_per_split, int ldy,
            const __grid_constant__ Maps... maps) {  // TMA: the codes', x8's and r8's TensorMap
  using S = PipeStage<T, R, WARPS, RES, STAGES, GPS, TMA>;
  static_assert(TMA == (sizeof...(Maps) == 3), "three tensor maps with TMA, none without");
  const TensorMap *code_map = nullptr, *x_map = nullptr, *r_map = nullptr;
  if constexpr (TMA) {
    const TensorMap* m[] = {&maps...};
    code_map = m[0], x_map = m[1], r_map = m[2];
  }
  static_assert(GPS == 1 || GPS == 2 || GPS == 4, "a stage is one, two or four groups");
  static_assert(STAGES >= 2, "at least double buffering");
  static_assert(T % WM == 0, "the batch's column tiles split evenly over WM warps");
  static_assert(GPS % KS == 0, "a stage's groups split evenly over the KS warps along K");
  constexpr int TJ = T / WM;            // column tiles of one warp
  constexpr int NT1 = WARPS * WM * 32;  // threads of one K slice of the CTA's warps
  constexpr int NT = NT1 * KS;          // threads of the CTA
  // With KS > 1 the CTA's warps split each stage's groups KS ways and add their sums through shared memory at
  // the end, over the stages' bytes: the slices' partial tiles, slice s > 0 at [s - 1][element][thread].
  constexpr int RED_BYTES = (KS - 1) * R * TJ * 4 * NT1 * 4;
  static_assert(RED_BYTES <= 99 * 1024 - 16, "shared memory: 99 KB per block at most (sm_120)");
  // The stages live in dynamic shared memory (mma.py sizes the launch from MmaConfig.shared_bytes and opts the
  // kernel in above 48 KB): two stages of four groups at 25-64 rows do not fit the 48 KB of static shared
  // memory. 99 KB is sm_120's limit per block (the H200 allows 227 KB); write_tile's flag is the 16 bytes kept.
  // TMA: the stages start at the first 1024-byte boundary of the dynamic shared memory (the launch adds 1 KB)
  constexpr u32 ALIGN_PAD = TMA ? 1024 : 0;
  static_assert(sizeof(S) * STAGES + ALIGN_PAD <= 99 * 1024 - 16 - (TMA ? 8 * STAGES : 0),
                "shared memory: 99 KB per block at most (sm_120)");
  extern __shared__ __align__(16) unsigned char dynamic_shared[];
  S* stage = reinterpret_cast<S*>(dynamic_shared);
  if constexpr (TMA)
    stage = reinterpret_cast<S*>(dynamic_shared + ((1024 - shared_address(dynamic_shared) % 1024) % 1024));
  if (threadIdx.x == 0 && dynamic_shared_bytes() < (sizeof(S) * STAGES > RED_BYTES ? sizeof(S) * STAGES : RED_BYTES) + ALIGN_PAD)
    __trap();  // launched with too little
  // TMA: one barrier per stage buffer; its phase k completes when the k-th use's tensor copies have landed
  u32 full0 = 0;
  if constexpr (TMA) {
    __shared__ __align__(8) unsigned long long full[STAGES];
    full0 = shared_address(full);
    if (threadIdx.x == 0) {
#pragma unroll
      for (int b = 0; b < STAGES; ++b) barrier_init(full0 + 8 * b, 1);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
  }

  const int G = KW / 8;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3, shift = 2 * t;
  // This warp's row tiles, column tiles and share of each stage's groups. Written so that KS = 1 compiles to the
  // code from before warps along K: any change here moved ptxas' register allocation (a 40-row instance went
  // from 145 registers to 109 and ran 1.12-1.18x slower on the H200).
  const int wr = warp % WARPS, wm = KS > 1 ? (warp / WARPS) % WM : warp / WARPS;
  const int ks = KS > 1 ? warp / (WARPS * WM) : 0;
  const int cta_row0 = blockIdx.x * S::ROWS;
  const int row0 = cta_row0 + wr * 16 * R;  // this warp's first output row
  const int g0 = blockIdx.y * groups_per_split;
  const int g1 = min(G, g0 + groups_per_split);
  const int nstages = (g1 - g0 + GPS - 1) / GPS;

  // The copy plan. Chunk c = threadIdx.x + u·NT of a stage's codes is row c / C, 16-byte chunk q = c % C of
  // that row; NT is a multiple of C, so q (and the chunk's group, q / 2) is the thread's own for every u and
  // its rows step by NT / C: one source pointer and one shared address per thread, compile-time steps per
  // copy. The activations go the same way over (batch row, lane) index ml = 4 m + lane, and their swizzle
  // ((ml / (8 / C)) % C) is the same for every step of NT / C (a multiple of 8 / C · C). A chunk whose group
  // lies past the slice, or whose row past the CTA or batch row past M, is not copied: the products only read
  // groups inside the slice, and a column past M is never stored. (Worked out per stage and copy, the address
  // arithmetic was most of the loop's instructions at 16-64 rows: docs/dev-notes.md.)
  constexpr int STEP = NT / S::C;  // rows (or ml) between one thread's chunks
  static_assert(NT % S::C == 0 && (NT / 8) % S::C == 0, "a thread's chunks keep their column and swizzle");
  constexpr int N_CODE = (S::ROWS + STEP - 1) / STEP, N_X = (S::MP * 4 + STEP - 1) / STEP;
  constexpr int N_SC = (GPS * S::NS * S::MP + NT - 1) / NT, N_WS = (S::ROWS * S::WS + NT - 1) / NT;
  const int q = threadIdx.x % S::C, first = threadIdx.x / S::C;  // chunk column; first row (or ml)
  const long step_words = (long)STEP * KW;
  const int row_bytes = STEP * KW * 4;  // ROW_OFFSETS: bytes between one thread's chunks
  const u32* code_src = codes + (long)(cta_row0 + first) * KW + 8 * g0 + 4 * q;
  const u32 code_dst = shared_address(stage[0].codes + first * S::CWP + 4 * q);
  const u32* x_src[S::NX];
#pragma unroll
  for (int v = 0; v < S::NX; ++v) x_src[v] = (v ? xr : xa) + (long)first * KW + 8 * g0 + 4 * q;
  const u32 x_dst = shared_address(stage[0].x[0] + 4 * S::chunk(first, q));
  const int x_rows = 4 * M;  // ml below this are batch rows of the call
  // ROW_OFFSETS: this thread's activation chunks that are batch rows of the call (u < x_chunks)
  const int x_chunks = x_rows > first ? (x_rows - first + STEP - 1) / STEP : 0;
  const u32* sc_src[N_SC];
  u32 sc_dst[N_SC];
  int sc_grp[N_SC];
#pragma unroll
  for (int u = 0; u < N_SC; ++u) {
    const int c = threadIdx.x + u * NT, gi = c / (S::NS * S::MP), k = (c / S::MP) % S::NS, m = c % S::MP;
    const int grp = g0 + gi;
    const void* src = k == 0 ? (const void*)(sx + (long)m * 2 * G + grp)
                    : k == 1 ? (const void*)(gx + (long)m * G + grp)
                    : k == 2 ? (const void*)(sx + (long)m * 2 * G + G + grp)
                             : (const void*)(gr + (long)m * G + grp);
    sc_src[u] = reinterpret_cast<const u32*>(src);
    sc_dst[u] = shared_address(&stage[0].scalars[gi][m / 2][k][m % 2]);
    sc_grp[u] = c < GPS * S::NS * S::MP && m < M ? gi : GPS;
  }
  // The weight scales: words of two fp16 groups from an even group (G is even), so a stage's first word
  // moves by GPS / 2 words per stage, or every other stage at GPS = 1.
  const u16* ws_src[N_WS];
  u32 ws_dst[N_WS];
  int ws_word[N_WS];  // word within the stage's WS; WS: never copied
#pragma unroll
  for (int u = 0; u < N_WS; ++u) {
    const int c = threadIdx.x + u * NT;
    ws_src[u] = scales + (long)(cta_row0 + c / S::WS) * G;
    ws_dst[u] = shared_address(stage[0].wscales + c);
    ws_word[u] = c < S::ROWS * S::WS ? c % S::WS : S::WS;
  }
  // A stage's copies in two parts: the weights' (codes and scales), which no earlier kernel writes, and the
  // activations' (the prep kernel's output).
  auto issue_weights = [&](int i) {
    const u32 at = (i % STAGES) * (u32)sizeof(S);                // the stage's buffer, from stage 0
    const int grp0 = g0 + GPS * i, ngrp = min(GPS, g1 - grp0);  // the stage's groups inside the slice
    const long k_words = 8L * GPS * i;
    const bool in_slice = q / 2 < ngrp;
    if constexpr (TMA) {
      // one thread: the stage's barrier expects the codes' and activations' boxes (full boxes: rows past the
      // tensor and columns past K arrive as zeros and count), then the codes' box
      if (threadIdx.x == 0) {
        const u32 bar = full0 + 8 * (i % STAGES);
        barrier_expect(bar, (u32)(sizeof(stage[0].codes) + sizeof(stage[0].x)));
        tensor_copy(shared_address(stage[0].codes) + at, code_map, 8 * (g0 + GPS * i), cta_row0, bar);
      }
    } else if constexpr (ROW_OFFSETS) {
      const char* src = reinterpret_cast<const char*>(code_src) + 32 * GPS * i;
#pragma unroll
      for (int u = 0; u < N_CODE; ++u)
        copy16(code_dst + at + u * STEP * S::CWP * 4, src + u * row_bytes,
               in_slice && ((u + 1) * STEP <= S::ROWS || first + u * STEP < S::ROWS));
    } else {
#pragma unroll
      for (int u = 0; u < N_CODE; ++u)
        copy16(code_dst + at + u * STEP * S::CWP * 4, code_src + u * step_words + k_words,
               in_slice && ((u + 1) * STEP <= S::ROWS || first + u * STEP < S::ROWS));
    }
#pragma unroll
    for (int u = 0; u < N_WS; ++u) {
      const int word = (grp0 >> 1) + ws_word[u];  // holds groups 2 word and 2 word + 1
      copy4(ws_dst[u] + at, ws_src[u] + 2 * word, ws_word[u] < S::WS && 2 * word < grp0 + ngrp);
    }
  };
  auto issue_activations = [&](int i) {
    const u32 at = (i % STAGES) * (u32)sizeof(S);
    const int grp0 = g0 + GPS * i, ngrp = min(GPS, g1 - grp0);
    const long k_words = 8L * GPS * i;
    const bool in_slice = q / 2 < ngrp;
    if constexpr (TMA) {
      if (threadIdx.x == 0) {
        const u32 bar = full0 + 8 * (i % STAGES);
        tensor_copy(shared_address(stage[0].x[0]) + at, x_map, 8 * (g0 + GPS * i), 0, bar);
        if (RES) tensor_copy(shared_address(stage[0].x[S::NX - 1]) + at, r_map, 8 * (g0 + GPS * i), 0, bar);
      }
    } else if constexpr (ROW_OFFSETS) {
#pragma unroll
      for (int v = 0; v < S::NX; ++v) {
        const char* src = reinterpret_cast<const char*>(x_src[v]) + 32 * GPS * i;
#pragma unroll
        for (int u = 0; u < N_X; ++u)
          copy16(x_dst + at + u * STEP * S::C * 16 + v * (u32)sizeof(stage[0].x[0]), src + u * row_bytes,
                 in_slice && u < x_chunks);
      }
    } else {
#pragma unroll
      for (int u = 0; u < N_X; ++u)
#pragma unroll
        for (int v = 0; v < S::NX; ++v)
          copy16(x_dst + at + u * STEP * S::C * 16 + v * (u32)sizeof(stage[0].x[0]),
                 x_src[v] + u * step_words + k_words, in_slice && first + u * STEP < x_rows);
    }
#pragma unroll
    for (int u = 0; u < N_SC; ++u) copy4(sc_dst[u] + at, sc_src[u] + GPS * i, sc_grp[u] < ngrp);
  };

  // Where this thread's activation words lie in a stage, per chunk column: its first column tile's ml =
  // 4 (8 j + g) + t, and the next tiles 32 ml (128 · C words) further, with the same swizzle.
  int x_word[S::C];
  {
    const int ml = 4 * (8 * wm * TJ + g) + t;
#pragma unroll
    for (int qq = 0; qq < S::C; ++qq) x_word[qq] = 4 * S::chunk(ml, qq);
  }
  // TMA: where chunk qq of this thread's code rows lies (rows g + 8 k: one swizzle for all), in words
  int code_chunk[S::C];
#pragma unroll
  for (int qq = 0; qq < S::C; ++qq) code_chunk[qq] = 4 * (qq ^ S::swizzle(g));

  float acc[R][TJ][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < TJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][j][e] = 0.f;

  // The first stages' weights go out before anything else. Launched as a programmatic dependent of the
  // activation prep (mma.py), the kernel gets here while the prep still runs; griddepcontrol.wait then waits for
  // the prep's end and its stores (a no-op on an ordinary launch). The weights of all the first stages join the
  // first commit group, which the first wait covers anyway.
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i)
    if (i < nstages) issue_weights(i);
  asm volatile("griddepcontrol.wait;" ::: "memory");
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < nstages) issue_activations(i);
    copy_commit();
  }
  for (int i = 0; i < nstages; ++i) {
    copy_wait<STAGES - 2>();  // stage i has landed (for this thread's copies) ...
    if constexpr (TMA) barrier_wait(full0 + 8 * (i % STAGES), (i / STAGES) & 1);  // (and its tensor copies)
    __syncthreads();          // ... and for everyone's; and buffer (i - 1) % STAGES is free again
    if (TMA && threadIdx.x == 0)  // the generic proxy's reads of that buffer before the tensor copies' writes
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (i + STAGES - 1 < nstages) {
      issue_weights(i + STAGES - 1);
      issue_activations(i + STAGES - 1);
    }
    copy_commit();
    const S& s = stage[i % STAGES];
    // This stage's weight scales: row (local) lr, group grp at half grp - 2 (grp0 / 2) of the row's words.
    const u16* ws = reinterpret_cast<const u16*>(s.wscales);
    const int half0 = 2 * ((g0 + GPS * i) >> 1);
    float sa[GPS][R], sb[GPS][R];
#pragma unroll
    for (int gi = 0; gi < GPS; ++gi)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int lr = wr * 16 * R + 16 * r + g, h = g0 + GPS * i + gi - half0;
        sa[gi][r] = half_to_float(ws[lr * 2 * S::WS + h]);
        sb[gi][r] = half_to_float(ws[(lr + 8) * 2 * S::WS + h]);
      }
    // One group of the stage (gi a compile-time constant wherever it is called).
    auto group = [&](const int gi) {
      u32 a[R][4][4];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        // TMA: the group's two 16-byte chunks of row g (and g + 8), swizzled by the row (code_chunk)
        const u32* ca = s.codes + (wr * 16 * R + 16 * r + g) * S::CWP + (TMA ? 0 : 8 * gi);
        const u32* cb = ca + 8 * S::CWP;
        const int lo = TMA ? code_chunk[2 * gi] : 0, hi = TMA ? code_chunk[2 * gi + 1] : 4;
        const u32x4 wa0 = *reinterpret_cast<const u32x4*>(ca + lo), wa1 = *reinterpret_cast<const u32x4*>(ca + hi);
        const u32x4 wb0 = *reinterpret_cast<const u32x4*>(cb + lo), wb1 = *reinterpret_cast<const u32x4*>(cb + hi);
        const u32 wa[8] = {wa0.x, wa0.y, wa0.z, wa0.w, wa1.x, wa1.y, wa1.z, wa1.w};
        const u32 wb[8] = {wb0.x, wb0.y, wb0.z, wb0.w, wb1.x, wb1.y, wb1.z, wb1.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          a[r][q][0] = (wa[2 * q] >> shift) & LANES;
          a[r][q][1] = (wb[2 * q] >> shift) & LANES;
          a[r][q][2] = (wa[2 * q + 1] >> shift) & LANES;
          a[r][q][3] = (wb[2 * q + 1] >> shift) & LANES;
        }
      }
#pragma unroll
      for (int jj = 0; jj < TJ; ++jj) {
        const int j = wm * TJ + jj;
        u32 b[8], br[8];
        const int lo_at = x_word[2 * gi] + jj * 128 * S::C, hi_at = x_word[2 * gi + 1] + jj * 128 * S::C;
        {
          const u32x4 lo = *reinterpret_cast<const u32x4*>(s.x[0] + lo_at);
          const u32x4 hi = *reinterpret_cast<const u32x4*>(s.x[0] + hi_at);
          b[0] = lo.x, b[1] = lo.y, b[2] = lo.z, b[3] = lo.w, b[4] = hi.x, b[5] = hi.y, b[6] = hi.z, b[7] = hi.w;
        }
        if (RES) {
          const u32x4 lo = *reinterpret_cast<const u32x4*>(s.x[S::NX - 1] + lo_at);
          const u32x4 hi = *reinterpret_cast<const u32x4*>(s.x[S::NX - 1] + hi_at);
          br[0] = lo.x, br[1] = lo.y, br[2] = lo.z, br[3] = lo.w, br[4] = hi.x, br[5] = hi.y, br[6] = hi.z,
          br[7] = hi.w;
        }
        // Columns 8j + 2t and 8j + 2t + 1 of the accumulator; their scalars are zeros past M. The int32
        // accumulator starts at MAGIC - Σx8, so after the mma its bits are the float 1.5 · 2^23 + (Σ u·x8 - Σx8)
        // exactly (|Σ u·x8 - Σx8| < 2^16): one float subtraction instead of an int-to-float conversion, which
        // runs at a quarter of the rate and bound this loop at 16-64 rows. CONST_START: the accumulator starts at
        // MAGIC, so its bits are the float 1.5 · 2^23 + Σ u·x8 (|Σ u·x8| < 2^15), and the subtraction of the float
        // 1.5 · 2^23 + Σx8 (MAGIC + Σx8's bits, exact too) leaves the same value: two moves per column pair and
        // group fewer, and the first mma no longer waits for the scalars' load.
        const int m0 = 8 * j + 2 * t;
        const u32x4 p1 = *reinterpret_cast<const u32x4*>(&s.scalars[gi][m0 / 2][0][0]);  // s1 (2), Σx8 (2)
        const float2 s1 = make_float2(__int_as_float(p1.x), __int_as_float(p1.y));
        const int2 x1 = make_int2(p1.z, p1.w);
        float2 s2 = make_float2(0.f, 0.f);
        int2 x2 = make_int2(0, 0);
        if (RES) {
          const u32x4 p2 = *reinterpret_cast<const u32x4*>(&s.scalars[gi][m0 / 2][2][0]);  // s2 (2), Σr8 (2)
          s2 = make_float2(__int_as_float(p2.x), __int_as_float(p2.y));
          x2 = make_int2(p2.z, p2.w);
        }
        // the mma's start (c1, c2) and what the float tail subtracts (f1, f2), per column of the pair
        const int2 c1 = CONST_START ? make_int2(MAGIC, MAGIC) : make_int2(MAGIC - x1.x, MAGIC - x1.y);
        const int2 c2 = CONST_START ? make_int2(MAGIC, MAGIC) : make_int2(MAGIC - x2.x, MAGIC - x2.y);
        const float2 f1 = CONST_START ? make_float2(__int_as_float(MAGIC + x1.x), __int_as_float(MAGIC + x1.y))
                                      : make_float2(MAGIC_F, MAGIC_F);
        const float2 f2 = CONST_START ? make_float2(__int_as_float(MAGIC + x2.x), __int_as_float(MAGIC + x2.y))
                                      : make_float2(MAGIC_F, MAGIC_F);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          int c[4], cr[4];
          mma_s8_from(c, a[r][0][0], a[r][0][1], a[r][0][2], a[r][0][3], b[0], b[1], c1.x, c1.y);
          if (RES) mma_s8_from(cr, a[r][0][0], a[r][0][1], a[r][0][2], a[r][0][3], br[0], br[1], c2.x, c2.y);
#pragma unroll
          for (int q = 1; q < 4; ++q) {
            mma_s8(c, a[r][q][0], a[r][q][1], a[r][q][2], a[r][q][3], b[2 * q], b[2 * q + 1]);
            if (RES) mma_s8(cr, a[r][q][0], a[r][q][1], a[r][q][2], a[r][q][3], br[2 * q], br[2 * q + 1]);
          }
          float v0 = s1.x * (__int_as_float(c[0]) - f1.x), v1 = s1.y * (__int_as_float(c[1]) - f1.y);
          float v2 = s1.x * (__int_as_float(c[2]) - f1.x), v3 = s1.y * (__int_as_float(c[3]) - f1.y);
          if (RES) {
            v0 += s2.x * (__int_as_float(cr[0]) - f2.x);
            v1 += s2.y * (__int_as_float(cr[1]) - f2.y);
            v2 += s2.x * (__int_as_float(cr[2]) - f2.x);
            v3 += s2.y * (__int_as_float(cr[3]) - f2.y);
          }
          acc[r][jj][0] += sa[gi][r] * v0;
          acc[r][jj][1] += sa[gi][r] * v1;
          acc[r][jj][2] += sb[gi][r] * v2;
          acc[r][jj][3] += sb[gi][r] * v3;
        }
      }
    };
    // The stage's groups, each warp's share (every KS-th of them). A test per group (another warp's group? past
    // the slice?) ends a basic block per group, so no group's fragment loads start under the previous group's
    // products and float tail. FLAT runs a whole stage (all but a slice's last may be short) with no branch
    // between its groups: ptxas then interleaves them, at the price of more registers (1.03-1.10x faster or
    // 0.8x slower by instance on an H100; the rule picks, mma.py's _FLAT).
    if constexpr (FLAT) {
      const int ngrp = min(GPS, g1 - (g0 + GPS * i));  // the stage's groups inside the slice (warp-uniform)
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        if (KS > 1 && kk != ks) continue;  // another warp's groups (warp-uniform)
        if (ngrp == GPS) {
#pragma unroll
          for (int gi = kk; gi < GPS; gi += KS) group(gi);
        } else {
#pragma unroll
          for (int gi = kk; gi < GPS; gi += KS)
            if (gi < ngrp) group(gi);
        }
      }
    } else {
#pragma unroll
      for (int gi = 0; gi < GPS; ++gi) {
        if (KS > 1 && gi % KS != ks) continue;  // another warp's group (warp-uniform)
        if (GPS > 1 && g0 + GPS * i + gi >= g1) continue;  // the slice's last stage may be short (warp-uniform)
        group(gi);
      }
    }
  }
  copy_wait<0>();
  if (KS > 1) {
    __syncthreads();  // every warp is past its last stage: the stages' memory takes the partial tiles
    float* red = reinterpret_cast<float*>(dynamic_shared);
    const int lt = threadIdx.x % NT1;
    if (ks > 0) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < TJ; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) red[(((ks - 1) * R + r) * TJ * 4 + j * 4 + e) * NT1 + lt] = acc[r][j][e];
    }
    __syncthreads();
    if (ks == 0) {
#pragma unroll
      for (int k = 1; k < KS; ++k)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < TJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[r][j][e] += red[(((k - 1) * R + r) * TJ * 4 + j * 4 + e) * NT1 + lt];
    }
  }
  // the other K slices' warps store nothing (row0 = N), but take part in write_tile's barriers
  write_tile<TJ, R, OUT>(acc, y, partials, counters, M, N, ldy, ks == 0 ? row0 : N, g, t, wm * TJ);
}
