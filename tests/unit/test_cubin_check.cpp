// The scan compile() runs over every cubin for the cp.async form that faults
// (src/compile/cubin_check.hpp), on hand-built ELF64 images.
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "compile/cubin_check.hpp"
#include "moejit/error.hpp"

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

struct Section {
  uint32_t type;                // SHT_*
  uint64_t flags;               // SHF_*
  std::vector<uint64_t> words;  // 64-bit words of the section's contents
};

// An ELF64 little-endian image: header, then each section's contents, then the section table
// (entry 0 the null section, as ELF has it).
std::string elf_image(const std::vector<Section>& sections) {
  std::string image(64, '\0');
  image.replace(0, 4,
                "\x7f"
                "ELF");
  image[4] = 2;                                       // ELFCLASS64
  image[5] = 1;                                       // ELFDATA2LSB
  image[6] = 1;                                       // EV_CURRENT
  std::vector<std::pair<uint64_t, uint64_t>> placed;  // offset, size
  for (const Section& s : sections) {
    placed.emplace_back(image.size(), s.words.size() * 8);
    for (uint64_t w : s.words) image.append(reinterpret_cast<const char*>(&w), 8);
  }
  const uint64_t table = image.size();
  image.append(64 * (sections.size() + 1), '\0');
  for (std::size_t i = 0; i < sections.size(); ++i) {
    const std::size_t header = table + 64 * (i + 1);
    put<uint32_t>(image, header + 4, sections[i].type);
    put<uint64_t>(image, header + 8, sections[i].flags);
    put<uint64_t>(image, header + 24, placed[i].first);
    put<uint64_t>(image, header + 32, placed[i].second);
  }
  put<uint64_t>(image, 0x28, table);
  put<uint16_t>(image, 0x3A, 64);
  put<uint16_t>(image, 0x3C, static_cast<uint16_t>(sections.size() + 1));
  return image;
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
  CHECK(contains(message_of(outside), "whole 16-byte instructions"));
}
