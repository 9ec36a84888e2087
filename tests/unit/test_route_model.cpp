// The CPU models the MoE GPU tests compare against: the route model checked against brute-force
// properties (random and adversarial ids), the sizes route_params.cuh gives the workspace, the
// bf16 / MXFP4 helpers, the activations, and the fp64 layer on hand-built cases.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../../kernels/moe/route_params.cuh"
#include "moejit/error.hpp"
#include "ops/moe_reference.hpp"

namespace {

using moejit::Activation;
using moejit::ActivationKind;
using moejit::detail::MoeLayerOptions;
using moejit::detail::MoeWeightsF64;
using moejit::detail::route_reference;
using moejit::detail::RouteReference;

struct RouteCase {
  std::string name;
  int tokens;
  int top_k;
  int experts;
  int offset;
  int block_m;
  std::vector<int32_t> ids;
  int group_rows = 0;  // the warpgroup GEMM's groups (0: none)
};

// Every property the route contract promises, checked by brute force against the ids.
void check_route(const RouteCase& c, const RouteReference& r) {
  INFO("case " << c.name << ": T = " << c.tokens << ", K = " << c.top_k << ", E = " << c.experts
               << ", offset = " << c.offset << ", B = " << c.block_m << ", G = " << c.group_rows);
  const int64_t n = static_cast<int64_t>(c.tokens) * c.top_k;
  const int B = c.block_m;
  auto is_local = [&](int32_t id) {
    return static_cast<int64_t>(id) >= c.offset &&
           static_cast<int64_t>(id) < static_cast<int64_t>(c.offset) + c.experts;
  };

  // Sizes and the block bound.
  REQUIRE(r.expert_counts.size() == static_cast<size_t>(c.experts));
  REQUIRE(r.expert_block_offset.size() == static_cast<size_t>(c.experts) + 1);
  REQUIRE(r.slot_row.size() == static_cast<size_t>(n));
  const int64_t expected_max = n == 0 ? 0 : (n + std::min<int64_t>(c.experts, n) * (B - 1)) / B;
  REQUIRE(r.max_blocks == expected_max);
  REQUIRE(r.max_blocks <= n);
  REQUIRE(r.total_blocks <= r.max_blocks);
  REQUIRE(r.block_expert.size() == static_cast<size_t>(r.max_blocks));
  REQUIRE(r.sorted_rows.size() == static_cast<size_t>(r.total_blocks) * static_cast<size_t>(B));
  // The header the ops size buffers with agrees.
  REQUIRE(moejit::kern::moe::route_max_blocks(n, c.experts, B) == r.max_blocks);
  REQUIRE(moejit::kern::moe::route_max_padded_rows(n, c.experts, B) == r.max_blocks * B);

  // Counts and block offsets.
  std::vector<int32_t> brute_count(static_cast<size_t>(c.experts), 0);
  for (int32_t id : c.ids) {
    if (is_local(id)) ++brute_count[static_cast<size_t>(id - c.offset)];
  }
  REQUIRE(r.expert_counts == brute_count);
  REQUIRE(r.expert_block_offset[0] == 0);
  for (int e = 0; e < c.experts; ++e) {
    const size_t i = static_cast<size_t>(e);
    REQUIRE(r.expert_block_offset[i + 1] - r.expert_block_offset[i] ==
            (brute_count[i] + B - 1) / B);
  }
  REQUIRE(r.expert_block_offset.back() == r.total_blocks);

  // Each expert's rows: its entries in increasing (token, slot) order, then -1 to the boundary.
  for (int e = 0; e < c.experts; ++e) {
    const size_t i = static_cast<size_t>(e);
    const int32_t first = r.expert_block_offset[i] * B;
    const int32_t end = r.expert_block_offset[i + 1] * B;
    int32_t previous = -1;
    for (int32_t row = first; row < first + brute_count[i]; ++row) {
      const int32_t entry = r.sorted_rows[static_cast<size_t>(row)];
      REQUIRE(entry > previous);
      REQUIRE(entry < n);
      REQUIRE(c.ids[static_cast<size_t>(entry)] == c.offset + e);
      previous = entry;
    }
    for (int32_t row = first + brute_count[i]; row < end; ++row) {
      REQUIRE(r.sorted_rows[static_cast<size_t>(row)] == -1);
    }
    for (int32_t b = r.expert_block_offset[i]; b < r.expert_block_offset[i + 1]; ++b) {
      REQUIRE(r.block_expert[static_cast<size_t>(b)] == e);
    }
  }
  for (int64_t b = r.total_blocks; b < r.max_blocks; ++b) {
    REQUIRE(r.block_expert[static_cast<size_t>(b)] == -1);
  }

  // slot_row inverts sorted_rows; every local entry appears exactly once.
  std::vector<int> seen(static_cast<size_t>(n), 0);
  for (int32_t entry : r.sorted_rows) {
    if (entry >= 0) ++seen[static_cast<size_t>(entry)];
  }
  for (int64_t i = 0; i < n; ++i) {
    const size_t k = static_cast<size_t>(i);
    if (is_local(c.ids[k])) {
      REQUIRE(seen[k] == 1);
      const int32_t row = r.slot_row[k];
      REQUIRE(row >= 0);
      REQUIRE(row < r.total_blocks * B);
      REQUIRE(r.sorted_rows[static_cast<size_t>(row)] == i);
    } else {
      REQUIRE(seen[k] == 0);
      REQUIRE(r.slot_row[k] == -1);
    }
  }

  // Groups: expert e's ceil(count / G) groups, consecutive from its group offset, tile its real
  // rows in order, G at a time, each starting on one of its blocks; -1 past the groups used.
  const int G = c.group_rows;
  REQUIRE(moejit::kern::moe::route_max_groups(n, c.experts, G) == r.max_groups);
  if (G == 0) {
    REQUIRE(r.max_groups == 0);
    REQUIRE(r.group_tiles.empty());
    REQUIRE(r.expert_group_offset.empty());
    return;
  }
  REQUIRE(r.max_groups == (n == 0 ? 0 : (n + std::min<int64_t>(c.experts, n) * (G - 1)) / G));
  REQUIRE(r.group_tiles.size() == static_cast<size_t>(r.max_groups) * 2);
  REQUIRE(r.expert_group_offset.size() == static_cast<size_t>(c.experts) + 1);
  REQUIRE(r.expert_group_offset[0] == 0);
  for (int e = 0; e < c.experts; ++e) {
    const size_t i = static_cast<size_t>(e);
    const int32_t groups = r.expert_group_offset[i + 1] - r.expert_group_offset[i];
    REQUIRE(groups == (brute_count[i] + G - 1) / G);
    int32_t covered = 0;  // real rows of e in the groups so far
    for (int32_t g = r.expert_group_offset[i]; g < r.expert_group_offset[i + 1]; ++g) {
      const int32_t block = r.group_tiles[2 * static_cast<size_t>(g)];
      const int32_t packed = r.group_tiles[2 * static_cast<size_t>(g) + 1];
      const int32_t rows = packed >> 16;
      REQUIRE((packed & 0xffff) == e);
      REQUIRE(block * B == r.expert_block_offset[i] * B + covered);
      REQUIRE(rows == std::min(G, brute_count[i] - covered));
      REQUIRE(block + (rows + B - 1) / B <= r.expert_block_offset[i + 1]);
      for (int32_t row = block * B; row < block * B + rows; ++row) {
        REQUIRE(r.sorted_rows[static_cast<size_t>(row)] >= 0);
      }
      covered += rows;
    }
    REQUIRE(covered == brute_count[i]);
  }
  REQUIRE(r.expert_group_offset.back() <= r.max_groups);
  for (int64_t g = r.expert_group_offset.back(); g < r.max_groups; ++g) {
    REQUIRE(r.group_tiles[2 * static_cast<size_t>(g)] == -1);
    REQUIRE(r.group_tiles[2 * static_cast<size_t>(g) + 1] == -1);
  }
}

RouteReference run_case(const RouteCase& c) {
  return route_reference(c.ids, c.tokens, c.top_k, c.experts, c.offset, c.block_m, c.group_rows);
}

std::vector<int32_t> random_ids(std::mt19937_64& rng, int tokens, int top_k, int global_experts,
                                double none_fraction) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens) * static_cast<size_t>(top_k));
  std::uniform_int_distribution<int32_t> expert(0, global_experts - 1);
  std::bernoulli_distribution none(none_fraction);
  for (int t = 0; t < tokens; ++t) {
    // Distinct experts per token, like a real top-k, with some slots dropped to -1.
    std::vector<int32_t> row;
    while (static_cast<int>(row.size()) < top_k) {
      const int32_t id = expert(rng);
      if (global_experts < top_k || std::find(row.begin(), row.end(), id) == row.end()) {
        row.push_back(id);
      }
    }
    for (int k = 0; k < top_k; ++k) {
      ids[static_cast<size_t>(t * top_k + k)] = none(rng) ? -1 : row[static_cast<size_t>(k)];
    }
  }
  return ids;
}

}  // namespace

TEST_CASE("route model: a small case worked by hand", "[route]") {
  // T = 3, K = 2, E = 4, B = 2: ids (1, 0), (2, 1), (1, -1).
  const RouteCase c{"hand", 3, 2, 4, 0, 2, {1, 0, 2, 1, 1, -1}};
  const RouteReference r = run_case(c);
  check_route(c, r);
  CHECK(r.expert_counts == std::vector<int32_t>{1, 3, 1, 0});
  CHECK(r.expert_block_offset == std::vector<int32_t>{0, 1, 3, 4, 4});
  CHECK(r.total_blocks == 4);
  CHECK(r.max_blocks == 5);  // (6 + 4 * 1) / 2
  CHECK(r.sorted_rows == std::vector<int32_t>{1, -1, 0, 3, 4, -1, 2, -1});
  CHECK(r.slot_row == std::vector<int32_t>{2, 0, 6, 3, 4, -1});
  CHECK(r.block_expert == std::vector<int32_t>{0, 1, 1, 2, -1});
  CHECK(r.max_groups == 0);

  // Groups of 4 rows (two blocks): expert 1's three rows in one group from block 1; max_groups
  // (6 + 4 * 3) / 4 = 4.
  RouteCase grouped = c;
  grouped.group_rows = 4;
  const RouteReference g = run_case(grouped);
  check_route(grouped, g);
  CHECK(g.expert_group_offset == std::vector<int32_t>{0, 1, 2, 3, 3});
  CHECK(g.group_tiles ==
        std::vector<int32_t>{0, 1 << 16 | 0, 1, 3 << 16 | 1, 3, 1 << 16 | 2, -1, -1});
}

TEST_CASE("route model: random ids on real and odd shapes", "[route]") {
  std::mt19937_64 rng(20261130);
  struct Shape {
    int experts, top_k, ep_ranks;
  };
  const Shape shapes[] = {{896, 16, 1}, {128, 4, 1}, {448, 16, 2}, {256, 6, 1},
                          {64, 8, 4},   {3, 2, 1},   {1, 1, 1},    {5, 8, 3}};
  const int token_counts[] = {1, 2, 6, 31, 96, 257, 1024};
  const int blocks[] = {8, 16, 32, 64, 128, 1, 3};
  for (const Shape& s : shapes) {
    for (int tokens : token_counts) {
      for (int block_m : blocks) {
        for (int rank = 0; rank < s.ep_ranks; ++rank) {
          RouteCase c{"random", tokens, s.top_k, s.experts, rank * s.experts, block_m,
                      random_ids(rng, tokens, s.top_k, s.experts * s.ep_ranks, 0.1),
                      // Groups of 1, 2, 4 or 8 blocks, and none.
                      (tokens + rank) % 5 == 4 ? 0 : block_m << ((tokens + rank) % 5)};
          check_route(c, run_case(c));
        }
      }
    }
  }
}

TEST_CASE("route model: adversarial ids", "[route]") {
  const int tokens = 300;
  const int top_k = 6;
  const int experts = 40;
  const size_t n = static_cast<size_t>(tokens * top_k);
  std::vector<RouteCase> cases;
  cases.push_back({"all -1", tokens, top_k, experts, 0, 16, std::vector<int32_t>(n, -1)});
  cases.push_back({"all one expert", tokens, top_k, experts, 0, 16, std::vector<int32_t>(n, 7)});
  cases.push_back(
      {"all last local expert", tokens, top_k, experts, 80, 16, std::vector<int32_t>(n, 119)});
  cases.push_back(
      {"all other rank (below)", tokens, top_k, experts, 40, 16, std::vector<int32_t>(n, 39)});
  cases.push_back(
      {"all other rank (above)", tokens, top_k, experts, 40, 16, std::vector<int32_t>(n, 80)});
  std::vector<int32_t> extremes(n);
  for (size_t i = 0; i < n; ++i) {
    const int32_t pool[] = {std::numeric_limits<int32_t>::min(),
                            std::numeric_limits<int32_t>::max(),
                            -2,
                            -1,
                            39,
                            40,
                            79,
                            80};
    extremes[i] = pool[i % 8];
  }
  cases.push_back({"int32 extremes and rank edges", tokens, top_k, experts, 40, 8, extremes});
  // Every expert nonempty, none a multiple of the block: expert e gets e + 1 entries (mod 16).
  std::vector<int32_t> ragged;
  for (int e = 0; static_cast<int>(ragged.size()) < static_cast<int>(n); e = (e + 1) % experts) {
    for (int j = 0; j <= e % 16 && ragged.size() < n; ++j) ragged.push_back(e);
  }
  cases.push_back({"ragged counts", tokens, top_k, experts, 0, 16, ragged});
  // Most experts empty: only experts 0 and 39 used.
  std::vector<int32_t> two(n);
  for (size_t i = 0; i < n; ++i) two[i] = (i % 3 == 0) ? 39 : 0;
  cases.push_back({"two experts, rest empty", tokens, top_k, experts, 0, 64, two});
  // The bound is tight: min(E, N) - 1 experts with one entry, the rest on one expert.
  std::vector<int32_t> tight(n, 0);
  for (int e = 1; e < experts; ++e) tight[static_cast<size_t>(e) * 11] = e;
  cases.push_back({"max blocks reached", tokens, top_k, experts, 0, 16, tight});
  cases.push_back({"T = 0", 0, top_k, experts, 0, 16, {}});
  cases.push_back({"T = 1, one slot on a local expert", 1, 1, experts, 0, 128, {3}});
  cases.push_back({"T = 1, K = 16, one expert", 1, 16, 896, 0, 8, std::vector<int32_t>(16, 5)});
  cases.push_back({"T = 1, not local", 1, 4, experts, 0, 8, {-1, 40, 41, 1000}});
  cases.push_back({"E = 1", 50, 2, 1, 3, 8, std::vector<int32_t>(100, 3)});

  for (RouteCase& c : cases) {
    // Groups of four blocks, as the warpgroup GEMM's 64-row tile over 16-row blocks.
    c.group_rows = 4 * c.block_m;
    const RouteReference r = run_case(c);
    check_route(c, r);
    INFO("case " << c.name);
    if (c.name == "all -1" || c.name.rfind("all other rank", 0) == 0) {
      CHECK(r.total_blocks == 0);
      CHECK(std::all_of(r.slot_row.begin(), r.slot_row.end(), [](int32_t v) { return v == -1; }));
      CHECK(std::all_of(r.block_expert.begin(), r.block_expert.end(),
                        [](int32_t v) { return v == -1; }));
    }
    if (c.name == "all one expert") {
      CHECK(r.expert_counts[7] == static_cast<int32_t>(n));
      CHECK(r.total_blocks == static_cast<int32_t>((n + 15) / 16));
      // Rows are the entries in order.
      for (size_t i = 0; i < n; ++i) CHECK(r.slot_row[i] == static_cast<int32_t>(i));
    }
    if (c.name == "max blocks reached") CHECK(r.total_blocks == r.max_blocks);
    if (c.name == "T = 0") {
      CHECK(r.max_blocks == 0);
      CHECK(r.total_blocks == 0);
      CHECK(r.sorted_rows.empty());
    }
  }
}

TEST_CASE("route model: bad arguments are refused", "[route]") {
  using moejit::Error;
  using moejit::ErrorCode;
  auto code_of = [](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::kInternal;
  };
  CHECK(code_of([] { route_reference({1, 2, 3}, 2, 2, 4, 0, 8); }) == ErrorCode::kInvalidArgument);
  CHECK(code_of([] { route_reference({1, 2}, 1, 2, 0, 0, 8); }) == ErrorCode::kInvalidArgument);
  CHECK(code_of([] { route_reference({1, 2}, 1, 2, 4, -1, 8); }) == ErrorCode::kInvalidArgument);
  CHECK(code_of([] { route_reference({1, 2}, 1, 2, 4, 0, 0); }) == ErrorCode::kInvalidArgument);
  CHECK(code_of([] { route_reference({1, 2}, 1, 2, 4, 0, 8, 12); }) == ErrorCode::kInvalidArgument);
}

TEST_CASE("route workspace layout: aligned, disjoint, large enough", "[route]") {
  using moejit::kern::moe::kRouteAlign;
  using moejit::kern::moe::route_workspace_layout;
  struct Sizes {
    long long rows, experts, block_m, chunk, group_rows;
  };
  const Sizes cases[] = {{0, 896, 8, 4096, 0},        {16, 896, 8, 4096, 0},
                         {4096, 896, 16, 4096, 0},    {262144, 896, 128, 4096, 0},
                         {65536, 128, 64, 4096, 128}, {4097, 3, 8, 4096, 0},
                         {2048, 128, 16, 2048, 64},   {0, 128, 16, 2048, 64}};
  for (const Sizes& s : cases) {
    const auto l = route_workspace_layout(s.rows, s.experts, s.block_m, s.chunk, s.group_rows);
    const unsigned long long offsets[] = {
        l.expert_counts, l.expert_block_offset, l.sorted_rows, l.block_expert,
        l.slot_row,      l.total_blocks,        l.chunk_base,  l.expert_group_offset,
        l.group_tiles,   l.tile_done,           l.bytes};
    const unsigned long long rows = static_cast<unsigned long long>(s.rows);
    const unsigned long long experts = static_cast<unsigned long long>(s.experts);
    const unsigned long long blocks = static_cast<unsigned long long>(
        moejit::kern::moe::route_max_blocks(s.rows, s.experts, s.block_m));
    const unsigned long long chunks = s.rows <= s.chunk
                                          ? 1ull
                                          : (rows + static_cast<unsigned long long>(s.chunk) - 1) /
                                                static_cast<unsigned long long>(s.chunk);
    const unsigned long long need[] = {
        4 * experts,
        4 * (experts + 1),
        4 * blocks * static_cast<unsigned long long>(s.block_m),
        4 * blocks,
        4 * rows,
        4,
        4 * chunks * experts,
        s.group_rows > 0 ? 4 * (experts + 1) : 0,
        8 * static_cast<unsigned long long>(
                moejit::kern::moe::route_max_groups(s.rows, s.experts, s.group_rows)),
        4 * blocks};
    for (size_t i = 0; i + 1 < std::size(offsets); ++i) {
      CHECK(offsets[i] % kRouteAlign == 0);
      CHECK(offsets[i + 1] >= offsets[i] + need[i]);
    }
  }
  CHECK(moejit::kern::moe::route_is_single_cta(4096, 4096));
  CHECK_FALSE(moejit::kern::moe::route_is_single_cta(4097, 4096));
  CHECK(moejit::kern::moe::route_num_chunks(4097, 4096) == 2);
  // The scatter takes the chunks, or a warp per expert where that is more CTAs: kimi-k3.1-tp8
  // (896 experts, 512 threads) at T = 96 has 2 chunks and 56 CTAs of 16 warps; gpt-oss-120b
  // (128, 1024) at T = 257 2 chunks and 4 CTAs of 32 warps; N = 40000 over 4096-entry chunks
  // 10 chunks, so 10 CTAs with 128 experts.
  using moejit::kern::moe::route_scatter_ctas;
  CHECK(route_scatter_ctas(96 * 16, 1024, 896, 512) == 56);
  CHECK(route_scatter_ctas(257 * 4, 1024, 128, 1024) == 4);
  CHECK(route_scatter_ctas(40000, 4096, 128, 1024) == 10);
  CHECK(route_scatter_ctas(40000, 4096, 896, 512) == 56);
}

// ---- bf16, MXFP4, activations --------------------------------------------------------------

TEST_CASE("bf16 rounding: nearest even, once", "[route][moe_reference]") {
  using moejit::detail::round_to_bf16;
  CHECK(round_to_bf16(1.0f + 0x1p-8f) == 1.0f);                // tie, to even
  CHECK(round_to_bf16(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);  // tie, to even (up)
  CHECK(round_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 1.0f + 0x1p-7f);
  CHECK(round_to_bf16(-3.0f) == -3.0f);
  CHECK(std::isinf(round_to_bf16(3.4e38f)));
  CHECK(std::isnan(round_to_bf16(std::numeric_limits<float>::quiet_NaN())));
  // Straight from fp64: 1 + 2^-8 + 2^-30 lies above the tie, though its fp32 value is the tie.
  CHECK(round_to_bf16(1.0 + 0x1p-8 + 0x1p-30) == 1.0 + 0x1p-7);
  CHECK(round_to_bf16(static_cast<double>(static_cast<float>(1.0 + 0x1p-8 + 0x1p-30))) == 1.0);
  CHECK(round_to_bf16(0x1p-133) == 0x1p-133);  // smallest bf16 subnormal
  CHECK(round_to_bf16(0x1p-135) == 0.0);
  // The fp64 and fp32 paths agree on every fp32 input.
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 100000; ++i) {
    uint32_t u = bits(rng);
    float x = 0;
    std::memcpy(&x, &u, sizeof(x));
    if (std::isnan(x)) continue;
    CHECK(round_to_bf16(static_cast<double>(x)) == static_cast<double>(round_to_bf16(x)));
  }
}

TEST_CASE("MXFP4: code table, scales, quantize and dequantize", "[route][moe_reference]") {
  using namespace moejit::detail;
  const float expected[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.f, -.5f, -1, -1.5f, -2, -3, -4, -6};
  for (uint8_t c = 0; c < 16; ++c) CHECK(e2m1_value(c) == expected[c]);
  CHECK(e8m0_value(127) == 1.0);
  CHECK(e8m0_value(0) == std::ldexp(1.0, -127));
  CHECK(e8m0_value(254) == std::ldexp(1.0, 127));
  CHECK(std::isnan(e8m0_value(0xff)));

  // Exactly representable groups survive a round trip.
  std::vector<float> exact(64);
  for (size_t i = 0; i < 32; ++i) exact[i] = expected[i % 16] * 0.25f;  // max 6 * 2^-2
  for (size_t i = 32; i < 64; ++i) exact[i] = expected[(i * 5) % 16] * 1024.f;
  const Mxfp4Matrix q = mxfp4_quantize(exact, 2, 32);
  CHECK(q.scales == std::vector<uint8_t>{125, 137});
  const std::vector<double> back = mxfp4_dequantize(q);
  for (size_t i = 0; i < 64; ++i) CHECK(back[i] == static_cast<double>(exact[i]));
  // Low nibble holds the even element.
  CHECK((q.blocks[0] & 0x0f) == 0);  // element 0 is 0
  CHECK((q.blocks[0] >> 4) == 1);    // element 1 is 0.5 * scale

  // Random values: within half a step of the code grid (the step is at most 2 * scale).
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::vector<float> values(32 * 40);
  for (float& v : values) v = normal(rng);
  const Mxfp4Matrix r = mxfp4_quantize(values, 40, 32);
  const std::vector<double> approx = mxfp4_dequantize(r);
  for (size_t i = 0; i < values.size(); ++i) {
    const double scale = e8m0_value(r.scales[i / 32]);
    CHECK(std::fabs(approx[i] - values[i]) <= scale + 1e-12);
  }

  const Mxfp4Matrix m = mxfp4_random(8, 64, -3, 2, rng);
  CHECK(m.blocks.size() == 8 * 64 / 2);
  for (uint8_t s : m.scales) CHECK((s >= 124 && s <= 129));
  CHECK_THROWS_AS(mxfp4_random(2, 33, 0, 0, rng), moejit::Error);
}

TEST_CASE("activations in fp64 by hand", "[route][moe_reference]") {
  using moejit::detail::activation_reference;
  auto sig = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  Activation swiglu{ActivationKind::kSwiGLU, 0, 0, 0, 0};
  CHECK(activation_reference(swiglu, 0.0, 5.0) == 0.0);
  CHECK(activation_reference(swiglu, 1.5, -2.0) == Approx(1.5 * sig(1.5) * -2.0).epsilon(1e-15));
  CHECK(activation_reference(swiglu, 40.0, 3.0) == 120.0);  // sigmoid(40) rounds to 1

  Activation clamped{ActivationKind::kClampedSwiGLU, 10.f, 0, 0, 0};
  CHECK(activation_reference(clamped, 25.0, 30.0) == activation_reference(clamped, 10.0, 10.0));
  CHECK(activation_reference(clamped, -25.0, -30.0) ==
        Approx(-25.0 * sig(-25.0) * -10.0).epsilon(1e-14));

  Activation gptoss{ActivationKind::kGptOss, 7.f, 1.702f, 0, 0};
  const double alpha = static_cast<double>(1.702f);
  CHECK(activation_reference(gptoss, 0.0, 3.0) == 0.0);
  CHECK(activation_reference(gptoss, 9.0, 1.0) == Approx(7.0 * sig(alpha * 7.0) * 2.0));
  CHECK(activation_reference(gptoss, 2.0, -9.0) == Approx(2.0 * sig(alpha * 2.0) * -6.0));
  CHECK(activation_reference(gptoss, -3.0, 0.5) == Approx(-3.0 * sig(-alpha * 3.0) * 1.5));

  Activation situ{ActivationKind::kSiTU, 0, 0, 4.f, 25.f};
  CHECK(activation_reference(situ, 0.0, 9.0) == 0.0);
  CHECK(activation_reference(situ, 1.0, 2.0) ==
        Approx(4.0 * std::tanh(0.25) * sig(1.0) * 25.0 * std::tanh(2.0 / 25.0)).epsilon(1e-15));
  // Saturation: |result| < beta * linear_beta.
  CHECK(std::fabs(activation_reference(situ, 1e6, -1e6)) <= 100.0);

  Activation bad{ActivationKind::kSiTU, 0, 0, 0.f, 25.f};
  CHECK_THROWS_AS(activation_reference(bad, 1.0, 1.0), moejit::Error);
}

// ---- the layer ------------------------------------------------------------------------------

namespace {

// One expert, H = I = 2, values chosen so every step is exact in fp64: gate = 40 (FC1 bias;
// silu(40) is 40 in fp64), up = x (identity rows), act = 40 x, FC2 = diag(1/8, 2) plus bias.
MoeWeightsF64 identity_like(bool interleaved) {
  MoeWeightsF64 w;
  w.num_experts = 1;
  w.hidden = 2;
  w.intermediate = 2;
  w.gate_up_interleaved = interleaved;
  // Logical rows: gate0, gate1, up0, up1.
  const std::vector<std::vector<double>> rows = {{0, 0}, {0, 0}, {1, 0}, {0, 1}};
  const std::vector<double> bias = {40, 40, 0, 0};
  const int order_sep[4] = {0, 1, 2, 3};
  const int order_int[4] = {0, 2, 1, 3};  // gate0, up0, gate1, up1
  for (int r = 0; r < 4; ++r) {
    const int logical = interleaved ? order_int[r] : order_sep[r];
    w.w13.insert(w.w13.end(), rows[static_cast<size_t>(logical)].begin(),
                 rows[static_cast<size_t>(logical)].end());
    w.b13.push_back(bias[static_cast<size_t>(logical)]);
  }
  w.w2 = {0.125, 0, 0, 2};
  w.b2 = {1, -1};
  return w;
}

}  // namespace

TEST_CASE("MoE layer reference: a one-expert case by hand", "[route][moe_reference]") {
  using moejit::detail::moe_layer_reference;
  MoeLayerOptions opt;
  opt.activation = Activation{ActivationKind::kSwiGLU, 0, 0, 0, 0};
  // T = 2, K = 2: token 0 uses expert 0 in both slots (weights .5 and .25); token 1 uses it in
  // slot 1 only (slot 0 is -1).
  const std::vector<float> hidden = {1.0f + 0x1p-9f, 0.5f, -2.0f, 4.0f};
  const std::vector<int32_t> ids = {0, 0, -1, 0};
  const std::vector<float> weights = {0.5f, 0.25f, 3.0f, 2.0f};
  // act = 40 x; y = (act0 / 8 + 1, 2 act1 - 1).
  const double a00 = 40.0 * (1.0 + 0x1p-9);  // 40.078125
  const std::vector<double> expected = {0.75 * (a00 / 8 + 1), 0.75 * (2 * 20.0 - 1),
                                        2.0 * (-80.0 / 8 + 1), 2.0 * (2 * 160.0 - 1)};
  for (bool interleaved : {false, true}) {
    INFO("interleaved " << interleaved);
    const auto out =
        moe_layer_reference(identity_like(interleaved), hidden, ids, weights, 2, 2, opt);
    CHECK(out == expected);
  }
  // FC1 output rounded to bf16 before FC2: 40.078125 -> 40 (bf16 step 0.25 in [32, 64)).
  opt.round_intermediate_bf16 = true;
  auto rounded = moe_layer_reference(identity_like(true), hidden, ids, weights, 2, 2, opt);
  CHECK(rounded[0] == 0.75 * (40.0 / 8 + 1));
  CHECK(rounded[1] == expected[1]);
  // The weighted output of each slot rounded: 0.5 * 39 = 19.5 and 0.25 * 39 = 9.75 are bf16
  // values; 2 * 319 = 638 is not (step 4 in [512, 1024)): a tie, to even, 640.
  opt.round_intermediate_bf16 = false;
  opt.round_weighted_output_bf16 = true;
  rounded = moe_layer_reference(identity_like(false), hidden, ids, weights, 2, 2, opt);
  CHECK(rounded[1] == 19.5 + 9.75);
  CHECK(rounded[3] == 640.0);
  // An expert offset moves the local range: id 0 is then another rank's, and contributes nothing.
  opt.round_weighted_output_bf16 = false;
  opt.expert_offset = 1;
  const auto none = moe_layer_reference(identity_like(false), hidden, ids, weights, 2, 2, opt);
  CHECK(none == std::vector<double>(4, 0.0));
}

TEST_CASE("MoE layer reference: EP halves sum to the whole", "[route][moe_reference]") {
  using namespace moejit::detail;
  std::mt19937_64 rng(11);
  const int experts = 6, hidden_size = 64, inter = 32, tokens = 9, top_k = 3;
  // Random MXFP4 weights for all 6 experts, gpt-oss layout with biases.
  const Mxfp4Matrix w13q = mxfp4_random(experts * 2 * inter, hidden_size, -4, -1, rng);
  const Mxfp4Matrix w2q = mxfp4_random(experts * hidden_size, inter, -4, -1, rng);
  MoeWeightsF64 all;
  all.num_experts = experts;
  all.hidden = hidden_size;
  all.intermediate = inter;
  all.gate_up_interleaved = true;
  all.w13 = mxfp4_dequantize(w13q);
  all.w2 = mxfp4_dequantize(w2q);
  std::normal_distribution<double> normal(0.0, 0.5);
  for (int i = 0; i < experts * 2 * inter; ++i) all.b13.push_back(normal(rng));
  for (int i = 0; i < experts * hidden_size; ++i) all.b2.push_back(normal(rng));
  std::vector<float> hidden(static_cast<size_t>(tokens * hidden_size));
  for (float& v : hidden) v = round_to_bf16(static_cast<float>(normal(rng)));
  const std::vector<int32_t> ids = random_ids(rng, tokens, top_k, experts, 0.1);
  std::vector<float> weights(ids.size());
  for (float& v : weights) v = static_cast<float>(std::fabs(normal(rng)));

  auto half = [&](int first) {
    MoeWeightsF64 h = all;
    h.num_experts = experts / 2;
    auto slice = [&](const std::vector<double>& v, size_t per_expert) {
      return std::vector<double>(
          v.begin() + static_cast<std::ptrdiff_t>(first * per_expert),
          v.begin() + static_cast<std::ptrdiff_t>((first + experts / 2) * per_expert));
    };
    h.w13 = slice(all.w13, static_cast<size_t>(2 * inter * hidden_size));
    h.b13 = slice(all.b13, static_cast<size_t>(2 * inter));
    h.w2 = slice(all.w2, static_cast<size_t>(hidden_size * inter));
    h.b2 = slice(all.b2, static_cast<size_t>(hidden_size));
    return h;
  };
  MoeLayerOptions opt;
  opt.activation = Activation{ActivationKind::kGptOss, 7.f, 1.702f, 0, 0};
  const auto whole = moe_layer_reference(all, hidden, ids, weights, tokens, top_k, opt);
  const auto low = moe_layer_reference(half(0), hidden, ids, weights, tokens, top_k, opt);
  opt.expert_offset = experts / 2;
  const auto high =
      moe_layer_reference(half(experts / 2), hidden, ids, weights, tokens, top_k, opt);
  double scale = 0;
  for (double v : whole) scale = std::max(scale, std::fabs(v));
  REQUIRE(scale > 0);
  for (size_t i = 0; i < whole.size(); ++i) {
    // Only the order of the fp64 sum over experts differs.
    CHECK(std::fabs(low[i] + high[i] - whole[i]) <= 1e-13 * scale);
  }

  // Every token's own rows: a direct per-slot evaluation agrees.
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < hidden_size; ++h) {
      double expected = 0;
      for (int k = 0; k < top_k; ++k) {
        const int32_t e = ids[static_cast<size_t>(t * top_k + k)];
        if (e < 0) continue;
        double y = all.b2[static_cast<size_t>(e * hidden_size + h)];
        for (int j = 0; j < inter; ++j) {
          double g = all.b13[static_cast<size_t>(e * 2 * inter + 2 * j)];
          double u = all.b13[static_cast<size_t>(e * 2 * inter + 2 * j + 1)];
          for (int c = 0; c < hidden_size; ++c) {
            const double x = hidden[static_cast<size_t>(t * hidden_size + c)];
            g += all.w13[static_cast<size_t>(((e * 2 * inter) + 2 * j) * hidden_size + c)] * x;
            u += all.w13[static_cast<size_t>(((e * 2 * inter) + 2 * j + 1) * hidden_size + c)] * x;
          }
          y += all.w2[static_cast<size_t>((e * hidden_size + h) * inter + j)] *
               activation_reference(opt.activation, g, u);
        }
        expected += static_cast<double>(weights[static_cast<size_t>(t * top_k + k)]) * y;
      }
      CHECK(std::fabs(whole[static_cast<size_t>(t * hidden_size + h)] - expected) <= 1e-13 * scale);
    }
  }
}
