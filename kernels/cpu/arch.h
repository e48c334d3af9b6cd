// The helpers whose best code depends on the instruction set, picked for the build's -march:
// arch/x86.h's on x86 (each falling back to the portable version where the build lacks its
// instructions), arch/generic.h's elsewhere. The kernels call them by name and hold no
// instruction-set conditions of their own; they choose a strategy by the constants below.
//   INSTRUCTION_SET   "avx512", "avx2", "neon" or "scalar"
//   REGISTER_FLOATS   16 or 8: the float vector one register holds (the tiles' accumulators)
//   BYTE_OPS_WIDTH    64 or 32: the widest byte operation (the K-quant codes' layout)
//   DOT4_SIGNED       whether dot4 takes signed weight codes
//   PAIRED_DOT4       whether dot4x2 serves
#pragma once

#include "vectors.h"

#if defined(__x86_64__) || defined(_M_X64)
#include "arch/x86.h"
#else
#include "arch/generic.h"

namespace muser::cpu {
using namespace generic;
}  // namespace muser::cpu
#endif

namespace muser::cpu {

// load8 or load16 (floats, or halves widened), by the vector type V.
template <class V, class T>
inline V load_values(const T* p) {
  if constexpr (sizeof(V) == 32) {
    return load8(p);
  } else {
    return load16(p);
  }
}

}  // namespace muser::cpu
