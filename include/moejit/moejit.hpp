// libmoejit: everything an engine needs, in one include.
#pragma once

#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/moe.hpp"
#include "moejit/ops.hpp"
#include "moejit/runtime.hpp"
#include "moejit/shape.hpp"
#include "moejit/version.hpp"
