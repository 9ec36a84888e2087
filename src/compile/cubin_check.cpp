#include "compile/cubin_check.hpp"

#include <cstdint>
#include <cstring>

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
constexpr std::size_t kShoff = 0x28;      // e_shoff: section table offset
constexpr std::size_t kShentsize = 0x3A;  // e_shentsize
constexpr std::size_t kShnum = 0x3C;      // e_shnum
constexpr std::size_t kSectionBytes = 64;
constexpr std::size_t kShType = 4, kShFlags = 8, kShOffset = 24, kShSize = 32;
constexpr uint32_t kProgbits = 1;     // SHT_PROGBITS
constexpr uint64_t kExecInstr = 0x4;  // SHF_EXECINSTR
constexpr std::size_t kInstructionBytes = 16;
// The low 12 bits of an instruction's first 64-bit word are its opcode; 0xdae is LDGSTS with a
// uniform-register shared-memory offset.
constexpr uint64_t kOpcodeMask = 0xfff;
constexpr uint64_t kFaultingLdgsts = 0xdae;

}  // namespace

int count_faulting_hinted_copies(std::string_view cubin) {
  MOEJIT_CHECK(cubin.size() >= kHeaderBytes && std::memcmp(cubin.data(), kElfMagic, 4) == 0 &&
                   cubin[4] == kClass64 && cubin[5] == kLittleEndian,
               ErrorCode::kInternal,
               "cubin check: not a little-endian ELF64 image (" << cubin.size() << " bytes)");
  const uint64_t table = read<uint64_t>(cubin, kShoff);
  const uint16_t entry = read<uint16_t>(cubin, kShentsize);
  const uint16_t sections = read<uint16_t>(cubin, kShnum);
  MOEJIT_CHECK(sections == 0 || (entry == kSectionBytes && table <= cubin.size() &&
                                 sections <= (cubin.size() - table) / kSectionBytes),
               ErrorCode::kInternal,
               "cubin check: section table (offset " << table << ", " << sections << " entries of "
                                                     << entry << " bytes) lies outside the "
                                                     << cubin.size() << "-byte image");
  int found = 0;
  for (uint16_t s = 0; s < sections; ++s) {
    const std::size_t header = table + static_cast<std::size_t>(s) * kSectionBytes;
    if (read<uint32_t>(cubin, header + kShType) != kProgbits ||
        (read<uint64_t>(cubin, header + kShFlags) & kExecInstr) == 0) {
      continue;
    }
    const uint64_t offset = read<uint64_t>(cubin, header + kShOffset);
    const uint64_t size = read<uint64_t>(cubin, header + kShSize);
    MOEJIT_CHECK(
        offset <= cubin.size() && size <= cubin.size() - offset && size % kInstructionBytes == 0,
        ErrorCode::kInternal,
        "cubin check: executable section " << s << " (offset " << offset << ", " << size
                                           << " bytes) is not whole 16-byte "
                                              "instructions inside the image");
    for (uint64_t at = offset; at < offset + size; at += kInstructionBytes) {
      if ((read<uint64_t>(cubin, at) & kOpcodeMask) == kFaultingLdgsts) ++found;
    }
  }
  return found;
}

}  // namespace moejit::detail
