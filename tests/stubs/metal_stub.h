// Just enough of the Metal Shading Language for `g++ -fsyntax-only` to check our kernels: the
// emulator's header (tests/emulator/metal.h), the one list of Metal builtins on the CPU.
// Address spaces vanish, attributes are ignored (-Wno-attributes).
#include "../emulator/metal.h"
