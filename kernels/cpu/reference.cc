// PENDING IMPLEMENTATION (scaffold).
#include "kvshade/kernels/reference.h"
