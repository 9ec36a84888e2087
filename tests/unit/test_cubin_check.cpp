// The scan compile() runs over every cubin for the cp.async form that faults
// (src/compile/cubin_check.hpp), on hand-built ELF64 images.
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "compile/cubin_check.hpp"
#include "moejit/error.hpp"
#include "support/support.hpp"

namespace {

using moejit::Error;
using moejit::ErrorCode;
using moejit::detail::count_faulting_hinted_copies;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

template <class T>
void put(std::string& image, std::size_t at, T value) {
  std::memcpy(image.data() + at, &value, sizeof(T));
}

// A section of 64-bit words.
struct Section {
  uint32_t type;                // SHT_*
  uint64_t flags;               // SHF_*
  std::vector<uint64_t> words;  // 64-bit words of the section's contents
};

std::string elf_image(const std::vector<Section>& sections) {
  std::vector<moejit::test::ElfSection> byte_sections;
  for (const Section& s : sections) {
    byte_sections.push_back(
        {s.type, s.flags,
         std::string(reinterpret_cast<const char*>(s.words.data()), s.words.size() * 8)});
  }
  return moejit::test::elf_image(byte_sections);
}

constexpr uint32_t kProgbits = 1;
constexpr uint64_t kAlloc = 0x2, kExec = 0x4;
// First words of LDGSTS instructions as ptxas 13.0 writes them for sm_90a: the [R+UR] form (low
// 12 bits 0xdae, predicate PT) and the plain form (0xfae), both seen in nvdisasm output.
constexpr uint64_t kUniformOffsetCopy = 0x000000000c2d7daeull;
constexpr uint64_t kPlainCopy = 0x020000000c21bfaeull;

}  // namespace

TEST_CASE("cubin check: counts the [R+UR] LDGSTS form in executable sections only", "[unit]") {
  const std::string image = elf_image({
      // Code: two faulting copies (one predicated: the predicate bits lie above the opcode), a
      // plain copy, and a second word that happens to end in 0xdae (not an instruction start).
      {kProgbits,
       kAlloc | kExec,
       {kUniformOffsetCopy, 0, kPlainCopy, 0xdaeull, (kUniformOffsetCopy & ~0xf000ull) | 0x3000,
        0}},
      // Data that holds the same bits: not code, not counted.
      {kProgbits, kAlloc, {kUniformOffsetCopy, kUniformOffsetCopy}},
  });
  CHECK(count_faulting_hinted_copies(image) == 2);
  CHECK(count_faulting_hinted_copies(elf_image({{kProgbits, kAlloc | kExec, {kPlainCopy, 0}}})) ==
        0);
  CHECK(count_faulting_hinted_copies(elf_image({})) == 0);
  std::string no_table(64, '\0');                      // a header with no section table at all
  no_table.replace(0, 8, elf_image({}).substr(0, 8));  // its ident bytes only
  CHECK(count_faulting_hinted_copies(no_table) == 0);
}

TEST_CASE("cubin check: an image that is not a whole ELF64 is an error naming the problem",
          "[unit]") {
  const auto message_of = [](const std::string& image) -> std::string {
    try {
      count_faulting_hinted_copies(image);
    } catch (const Error& error) {
      CHECK(error.code() == ErrorCode::kInternal);
      return error.what();
    }
    FAIL("no error for a malformed image of " << image.size() << " bytes");
    return {};
  };
  CHECK(contains(message_of(std::string(64, 'x')), "not a little-endian ELF64"));  // no magic
  std::string big_endian = elf_image({});
  big_endian[5] = 2;
  CHECK(contains(message_of(big_endian), "not a little-endian ELF64"));
  CHECK(contains(message_of(elf_image({}).substr(0, 40)), "not a little-endian ELF64"));

  std::string table_past_end = elf_image({{kProgbits, kExec, {kPlainCopy, 0}}});
  put<uint64_t>(table_past_end, 0x28, table_past_end.size() - 64);  // 2 entries, room for 1
  CHECK(contains(message_of(table_past_end), "section table"));

  std::string ragged = elf_image({{kProgbits, kExec, {kPlainCopy, 0, kPlainCopy}}});  // 24 bytes
  CHECK(contains(message_of(ragged), "whole 16-byte instructions"));
  std::string outside = elf_image({{kProgbits, kExec, {kPlainCopy, 0}}});
  uint64_t table = 0;
  std::memcpy(&table, outside.data() + 0x28, 8);
  put<uint64_t>(outside, table + 64 + 32, uint64_t{1} << 20);  // section 1's size: past the end
  CHECK(contains(message_of(outside), "section 1 (offset 64, 1048576 bytes) lies outside"));
}

TEST_CASE("cubin check: a whole image is one whose every table, segment and section is inside it",
          "[unit]") {
  using moejit::detail::elf_image_problem;
  constexpr uint32_t kNobits = 8;
  const std::string whole = elf_image({{kProgbits, kExec, {kPlainCopy, 0}}});
  CHECK(elf_image_problem(whole).empty());
  CHECK(elf_image_problem(moejit::test::cubin_image("any payload, any length")).empty());
  CHECK(contains(elf_image_problem(""), "not a little-endian ELF64 image (0 bytes)"));
  uint64_t table = 0;
  std::memcpy(&table, whole.data() + 0x28, 8);

  // A section with no file bytes (.nv.shared) may claim any size; one with bytes may not.
  std::string nobits = elf_image({{kNobits, 0, {}}});
  put<uint64_t>(nobits, table - 16 + 64 + 32, uint64_t{1} << 40);  // its table is 16 bytes lower
  CHECK(elf_image_problem(nobits).empty());
  std::string wrapped = whole;  // offset + size wraps past 2^64 to a small number
  put<uint64_t>(wrapped, table + 64 + 24, ~uint64_t{0} - 7);
  put<uint64_t>(wrapped, table + 64 + 32, 16);
  CHECK(contains(elf_image_problem(wrapped), "section 1 (offset 18446744073709551608"));

  std::string entry_size = whole;
  put<uint16_t>(entry_size, 0x3A, 40);
  CHECK(contains(elf_image_problem(entry_size), "section table: entries of 40 bytes, not 64"));
  // Counts kept in section 0 (ELF's extended numbering): not bounded by this check, refused.
  std::string hidden_count = whole;
  put<uint16_t>(hidden_count, 0x3C, 0);
  CHECK(contains(elf_image_problem(hidden_count), "extended section or segment numbering"));
  std::string hidden_segments = whole;
  put<uint16_t>(hidden_segments, 0x38, 0xffff);
  CHECK(contains(elf_image_problem(hidden_segments), "e_phnum 65535"));

  // Program headers: the table, then each segment's file bytes.
  std::string segments = whole;
  put<uint64_t>(segments, 0x20, segments.size() - 56);
  put<uint16_t>(segments, 0x36, 56);
  put<uint16_t>(segments, 0x38, 2);
  CHECK(contains(elf_image_problem(segments), "program header table of 2 entries"));
  put<uint16_t>(segments, 0x38, 1);  // its one entry is the section table's last 56 bytes
  CHECK(elf_image_problem(segments).empty());
  put<uint64_t>(segments, segments.size() - 56 + 32, segments.size());  // p_filesz: past the end
  put<uint64_t>(segments, segments.size() - 56 + 8, 1);                 // p_offset
  CHECK(contains(elf_image_problem(segments), "segment 0 (offset 1, "));
}
