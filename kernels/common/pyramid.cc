// PENDING IMPLEMENTATION (scaffold).
#include "kvshade/kernels/pyramid.h"
