// Text forms that messages and kernel names share.
#pragma once

#include <string>

namespace moejit::detail {

// The shortest decimal text that reads back as the same float: "1.702", not "1.70200002", so a
// message quotes a constant as the shape file wrote it and a kernel name stays short.
std::string float_text(float value);

}  // namespace moejit::detail
