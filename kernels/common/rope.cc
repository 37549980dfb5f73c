// PENDING IMPLEMENTATION (scaffold).
#include "kvshade/kernels/rope.h"
