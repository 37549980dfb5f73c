// PENDING IMPLEMENTATION (scaffold).
#include "kvshade/kernels/codec.h"
