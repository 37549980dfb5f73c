// PENDING IMPLEMENTATION (scaffold).
#include "kvshade/kernels/types.h"
