#include "compile/cubin_check.hpp"

#include <cstdint>
#include <cstring>
#include <string>

#include "common/check.hpp"

namespace moejit::detail {

namespace {

// Little-endian fields of the image; `at` is checked by the caller.
template <class T>
T read(std::string_view image, std::size_t at) {
  T value{};
  std::memcpy(&value, image.data() + at, sizeof(T));
  return value;
}

// ELF64 offsets and constants (the System V gABI).
constexpr char kElfMagic[4] = {'\x7f', 'E', 'L', 'F'};
constexpr char kClass64 = 2;       // EI_CLASS: ELFCLASS64
constexpr char kLittleEndian = 1;  // EI_DATA: ELFDATA2LSB
constexpr std::size_t kHeaderBytes = 64;
constexpr std::size_t kPhoff = 0x20;      // e_phoff: program header table offset
constexpr std::size_t kShoff = 0x28;      // e_shoff: section table offset
constexpr std::size_t kPhentsize = 0x36;  // e_phentsize
constexpr std::size_t kPhnum = 0x38;      // e_phnum
constexpr std::size_t kShentsize = 0x3A;  // e_shentsize
constexpr std::size_t kShnum = 0x3C;      // e_shnum
constexpr uint16_t kSegmentBytes = 56;
constexpr std::size_t kPOffset = 8, kPFilesz = 32;
constexpr uint16_t kSectionBytes = 64;
constexpr std::size_t kShType = 4, kShFlags = 8, kShOffset = 24, kShSize = 32;
constexpr uint32_t kProgbits = 1;     // SHT_PROGBITS
constexpr uint32_t kNobits = 8;       // SHT_NOBITS: no bytes in the file
constexpr uint64_t kExecInstr = 0x4;  // SHF_EXECINSTR
constexpr std::size_t kInstructionBytes = 16;
// The low 12 bits of an instruction's first 64-bit word are its opcode; 0xdae is LDGSTS with a
// uniform-register shared-memory offset.
constexpr uint64_t kOpcodeMask = 0xfff;
constexpr uint64_t kFaultingLdgsts = 0xdae;

// "" when `bytes` bytes at `offset` lie inside an image of `image_size` bytes (no overflow),
// else the problem, naming `what`.
std::string extent_problem(const std::string& what, uint64_t offset, uint64_t bytes,
                           std::size_t image_size) {
  if (offset <= image_size && bytes <= image_size - offset) return "";
  return what + " (offset " + std::to_string(offset) + ", " + std::to_string(bytes) +
         " bytes) lies outside the " + std::to_string(image_size) + "-byte image";
}

// "" when a table of `count` entries of `entry_bytes` (which must be `wanted_bytes`) at `offset`
// lies inside the image, else the problem.
std::string table_problem(const std::string& what, uint64_t offset, uint16_t count,
                          uint16_t entry_bytes, uint16_t wanted_bytes, std::size_t image_size) {
  if (count == 0) return "";
  if (entry_bytes != wanted_bytes) {
    return what + ": entries of " + std::to_string(entry_bytes) + " bytes, not " +
           std::to_string(wanted_bytes);
  }
  return extent_problem(what + " of " + std::to_string(count) + " entries", offset,
                        uint64_t{count} * wanted_bytes, image_size);
}

}  // namespace

std::string elf_image_problem(std::string_view image) {
  if (image.size() < kHeaderBytes || std::memcmp(image.data(), kElfMagic, 4) != 0 ||
      image[4] != kClass64 || image[5] != kLittleEndian) {
    return "not a little-endian ELF64 image (" + std::to_string(image.size()) + " bytes)";
  }
  const uint64_t segments_at = read<uint64_t>(image, kPhoff);
  const uint16_t segments = read<uint16_t>(image, kPhnum);
  const uint64_t sections_at = read<uint64_t>(image, kShoff);
  const uint16_t sections = read<uint16_t>(image, kShnum);
  // Why refused: with e_phnum 0xffff or e_shnum 0 beside a table, ELF keeps the real count in
  // section 0 ("extended numbering", for 0xff00 or more entries), which no cubin needs and this
  // check would not bound.
  if (segments == 0xffff || (sections == 0 && sections_at != 0)) {
    return "extended section or segment numbering (e_phnum " + std::to_string(segments) +
           ", e_shnum " + std::to_string(sections) + " with a section table at offset " +
           std::to_string(sections_at) + "), which no cubin has";
  }
  std::string why = table_problem("program header table", segments_at, segments,
                                  read<uint16_t>(image, kPhentsize), kSegmentBytes, image.size());
  for (uint16_t s = 0; why.empty() && s < segments; ++s) {
    const std::size_t header = segments_at + std::size_t{s} * kSegmentBytes;
    why = extent_problem("segment " + std::to_string(s), read<uint64_t>(image, header + kPOffset),
                         read<uint64_t>(image, header + kPFilesz), image.size());
  }
  if (why.empty()) {
    why = table_problem("section table", sections_at, sections, read<uint16_t>(image, kShentsize),
                        kSectionBytes, image.size());
  }
  for (uint16_t s = 0; why.empty() && s < sections; ++s) {
    const std::size_t header = sections_at + std::size_t{s} * kSectionBytes;
    if (read<uint32_t>(image, header + kShType) == kNobits) continue;
    why = extent_problem("section " + std::to_string(s), read<uint64_t>(image, header + kShOffset),
                         read<uint64_t>(image, header + kShSize), image.size());
  }
  return why;
}

int count_faulting_hinted_copies(std::string_view cubin) {
  const std::string problem = elf_image_problem(cubin);
  MOEJIT_CHECK(problem.empty(), ErrorCode::kInternal, "cubin check: " << problem);
  const uint64_t table = read<uint64_t>(cubin, kShoff);
  const uint16_t sections = read<uint16_t>(cubin, kShnum);
  int found = 0;
  for (uint16_t s = 0; s < sections; ++s) {
    const std::size_t header = table + static_cast<std::size_t>(s) * kSectionBytes;
    if (read<uint32_t>(cubin, header + kShType) != kProgbits ||
        (read<uint64_t>(cubin, header + kShFlags) & kExecInstr) == 0) {
      continue;
    }
    const uint64_t offset = read<uint64_t>(cubin, header + kShOffset);
    const uint64_t size = read<uint64_t>(cubin, header + kShSize);
    MOEJIT_CHECK(size % kInstructionBytes == 0, ErrorCode::kInternal,
                 "cubin check: executable section " << s << " (offset " << offset << ", " << size
                                                    << " bytes) is not whole 16-byte "
                                                       "instructions");
    for (uint64_t at = offset; at < offset + size; at += kInstructionBytes) {
      if ((read<uint64_t>(cubin, at) & kOpcodeMask) == kFaultingLdgsts) ++found;
    }
  }
  return found;
}

}  // namespace moejit::detail
