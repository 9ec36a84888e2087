// Private side of the descriptor unit: the limits and rules a ModelShape must satisfy, the
// fields a shape file may hold, and parsing that keeps where each shape came from.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moejit/shape.hpp"

namespace moejit::detail {

// Beyond these a size is a typo, not a model.
inline constexpr int kMaxLocalExperts = 4096;
// The most local experts the route kernel serves: its rank phase keeps per-expert tables in 48 KB
// of static shared memory, which at its fewest threads (one warp) hold 3509 experts
// (src/plan/moe_plan.cpp static_asserts it against route_rank_shared_bytes). A rank with more
// takes fewer of the model's experts (expert_offset, global_experts).
inline constexpr int kMaxRoutedLocalExperts = 3509;
inline constexpr int kMaxGlobalExperts = 65536;
inline constexpr int kMaxTopK = 64;
inline constexpr int kMaxDim = 65536;           // hidden, intermediate
inline constexpr int kMaxSharedExperts = 8;
inline constexpr int kMaxTokensLimit = 1 << 20;
inline constexpr int kDefaultMaxTokens = 16384;
inline constexpr int kMaxNameLength = 128;
// MXFP4 keeps one E8M0 scale per 32 weights along K, so every K is whole blocks.
inline constexpr int kMxfp4BlockK = 32;
// The largest shape file read: thousands of shapes (a few hundred bytes each) fit many times over.
inline constexpr long long kMaxShapeFileBytes = 16LL << 20;
// A shape file needs 3 levels below the root ({"shapes": [{"activation": {...}}]}).
inline constexpr int kMaxJsonDepth = 16;
// The most JSON values a shape file holds: a shape is 10-30 of them, so tens of thousands of
// shapes fit, while 16 MB of "{}," (5M values) would take the position scan and the JSON tree
// about a GB before the first rule was checked.
inline constexpr std::size_t kMaxJsonValues = std::size_t{1} << 20;

// One broken rule of a ModelShape, before it is given a place in a file.
struct ShapeViolation {
  std::string field;     // JSON pointer relative to the shape object, e.g. "/shared_experts/scale"
  std::string what;      // what is wrong
  std::string expected;  // what would be right
  std::string found;     // what was there
  std::string hint;      // how to fix it; may be empty
  bool found_is_value = true;  // `found` is the field's value (a file may show its own spelling)
};

// A float constant as an exact ratio of ints: float(num) / float(den) == value (a correctly
// rounded division, as kernels/moe/activation.cuh evaluates it). Tries decimal denominators
// first (1.702 -> 1702 / 1000, readable in the source), then the continued fraction's
// convergents and semiconvergents, then the float's own binary fraction. Every value that some
// num / den with |num|, den < 2^24 (exact as floats) rounds to is found; beyond 2^24, where
// float(den) itself rounds, such a ratio may exist and not be found. Empty when none is found
// (|value| beyond 2^31, or magnitudes far under 1e-9). An activation constant without one is
// refused by the shape rules: the kernels take constants in this form.
struct FloatRatio {
  int num = 0;
  int den = 1;
};
std::optional<FloatRatio> float_ratio(float value);

// The first rule an activation's constants break, or nothing: each constant the kind takes is
// finite, positive and has a float_ratio; each it does not take is 0. One of find_shape_violation's
// rules, which the planner applies to kernel params too (detail::activation_problem).
std::optional<ShapeViolation> activation_violation(const Activation& activation);

// The first rule `shape` breaks, in field order, or nothing. The same rules parse_shapes applies
// after decoding; shapes built in code can be checked with them too.
std::optional<ShapeViolation> find_shape_violation(const ModelShape& shape);

// Throws DescriptorError for the first rule `shape` breaks, naming shape.source.
void check_shape(const ModelShape& shape);

// A parsed shape and where it is in its file.
struct LocatedShape {
  ModelShape shape;
  std::string pointer;       // of the shape object ("" when the file is that one object)
  std::string name_pointer;  // of its "name" value
  int name_line = 0;
  int name_column = 0;
};

// parse_shapes, keeping locations (the registry names them when a name is taken).
std::vector<LocatedShape> parse_shapes_located(const std::string& text,
                                               const std::string& source_name);

// The whole file, or Error{kIo} saying why it can't be read.
std::string read_shapes_text(const std::string& path);

// The fields each object of a shape file accepts, in schema order (tests keep
// tools/shapes/schema.json in step with these).
const std::vector<std::string>& file_fields();
const std::vector<std::string>& shape_fields();
const std::vector<std::string>& activation_fields();
const std::vector<std::string>& shared_experts_fields();

// `text` as a message shows it: control characters escaped as JSON writes them (\n, \u001b,
// \u0000: a key may hold any of them), and at most `max_bytes` of it, cut at a character's
// start, with "..." after a cut.
std::string printable(std::string_view text, std::size_t max_bytes);

// Shape names for a message that names the ones there are: the first 20, comma-separated, then
// ", ... (N in all)" where there are more (a file or a registry may hold thousands).
std::string listed_names(const std::vector<std::string>& names);

// "<file>:<line>:<column>: <pointer>: <what>; expected <expected>, found <found>[; <hint>]".
// The pointer (at most 200 bytes of it), what, found and hint are shown through printable().
// line 0 leaves out line and column, column 0 the column; an empty pointer reads "(root)".
std::string descriptor_message(const std::string& file, int line, int column,
                               const std::string& pointer, const std::string& what,
                               const std::string& expected, const std::string& found,
                               const std::string& hint);

}  // namespace moejit::detail
