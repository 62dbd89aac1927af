// What every instruction set's path runs its kernels in: rows of x quantized (with the path's
// group_sum, quantize_group and quantize_rest), the path's kernel for the weights' bits and group
// (its run_tile), and every tile against the rows over the threads. Included after the path's
// header.
#pragma once

#include <algorithm>
#include <vector>

#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>

#include "lowbit_layout.hpp"

namespace vinoserve {
namespace {

// One row's k values at x, as row r of `a` (the path's group_sum, quantize_group, quantize_rest).
void quantize_row(const float* x, size_t r, size_t k, size_t group, int planes, int factor, Activations& a) {
    const size_t groups = k / group;
    float rest[32];
    for (size_t g = 0; g < groups; g++) {
        const float* v = x + g * group;
        const size_t at = r * groups + g;
        a.sum[at] = group_sum(v, group);
        int8_t* q = a.q.get() + r * planes * k + g * group;
        int32_t s;
        quantize_group(v, group, q, a.d[at], s, planes == 2 ? rest : nullptr);
        if (planes == 2) {
            s = FINE * s + quantize_rest(rest, group, a.d[at], q + k);
            a.d[at] /= FINE;
        }
        a.c[at] = factor * s;
    }
}

// Each row of x as `planes` int8 rows per group: the first its values', a second (planes 2) what
// the first's rounding left, at a scale 256 times finer (x = d1 q1 + d1 / 256 q2 to ~2^-16 of the
// group's largest value: closer to f32 than bf16's 2^-9, for twice the dot products). Buffers of
// its own per call (a few KiB a decode step): a thread waiting in parallel_for may run another
// node's call, so a thread's buffer could be rewritten under its readers. `pick`: which row of x
// each of the `rows` is (nullptr: the first `rows`).
Activations quantize(const float* x, size_t rows, const Weights& w, int planes, const size_t* pick) {
    const size_t k = w.k, group = w.group, groups = k / group;
    const int factor = bias_factor(w);
    Activations a{std::unique_ptr<int8_t[]>(new int8_t[rows * planes * k]),
                  std::unique_ptr<float[]>(new float[rows * groups]),
                  std::unique_ptr<int32_t[]>(new int32_t[rows * groups]),
                  std::unique_ptr<float[]>(new float[rows * groups])};
    if (rows < PAIR_ROWS) {
        for (size_t r = 0; r < rows; r++) quantize_row(x + (pick ? pick[r] : r) * k, r, k, group, planes, factor, a);
        return a;
    }
    tbb::parallel_for(tbb::blocked_range<size_t>(0, rows), [&](const tbb::blocked_range<size_t>& range) {
        for (size_t r = range.begin(); r != range.end(); r++) quantize_row(x + (pick ? pick[r] : r) * k, r, k, group, planes, factor, a);
    }, tbb::static_partitioner());
    return a;
}

template <int P>
TileFn pick_planes(int bits, int group, bool e2m1) {
    if (e2m1) return bits == 4 && group == 32 ? run_tile<E2M1, 8, P> : nullptr;
    if (bits == 4 && group == 32) return run_tile<4, 8, P>;
    if (bits == 4 && group == 16) return run_tile<4, 4, P>;
    if (bits == 5 && group == 32) return run_tile<5, 8, P>;
    if (bits == 6 && group == 32) return run_tile<6, 8, P>;
    if (bits == 6 && group == 16) return run_tile<6, 4, P>;
    if (bits == 8 && group == 32) return run_tile<8, 8, P>;
    if (bits == 8 && group == 16) return run_tile<8, 4, P>;
    return nullptr;
}

TileFn pick(int bits, int group, int planes, bool e2m1 = false) {
    return planes == 1 ? pick_planes<1>(bits, group, e2m1) : planes == 2 ? pick_planes<2>(bits, group, e2m1) : nullptr;
}

// Rows of x taken in one count of planes: their activations, and where their outputs go.
struct RowSet {
    Activations a;
    size_t rows;
    TileFn fn;
    Outputs y;
    std::vector<size_t> picked;  // the rows of x (empty: all of them, in order)
};

RowSet row_set(const float* x, const Weights& w, size_t rows, int planes, std::vector<size_t> picked, const Outputs& y) {
    const size_t count = picked.empty() ? rows : picked.size();
    RowSet set{quantize(x, count, w, planes, picked.empty() ? nullptr : picked.data()), count,
               pick(w.bits, w.group, planes, w.e2m1), y, std::move(picked)};
    set.y.rows = set.picked.empty() ? nullptr : set.picked.data();
    return set;
}

// Every set against every tile: one contiguous share of the tiles a thread (the rows are equal
// work, and a step's ~200 calls each pay the split), each tile (or pair, from PAIR_ROWS rows)
// against each set in turn while its weights are in cache.
void multiply(const Weights& w, const std::vector<RowSet>& sets) {
    const size_t tiles = (w.n + 15) / 16;
    const bool paired = std::any_of(sets.begin(), sets.end(), [](const RowSet& s) { return s.rows >= PAIR_ROWS; });
    const size_t step = paired ? 2 : 1, units = (tiles + step - 1) / step;
    tbb::parallel_for(tbb::blocked_range<size_t>(0, units), [&](const tbb::blocked_range<size_t>& r) {
        for (size_t i = r.begin(); i != r.end(); i++) {
            const size_t t = i * step, end = std::min(t + step, tiles);
            for (const RowSet& s : sets) {
                if (s.rows >= PAIR_ROWS) {
                    s.fn(w, s.a, s.rows, t, end - t == 2, s.y);
                } else {
                    for (size_t u = t; u < end; u++) s.fn(w, s.a, s.rows, u, false, s.y);
                }
            }
        }
    }, tbb::static_partitioner());
}

}  // namespace
}  // namespace vinoserve
