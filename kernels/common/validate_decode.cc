// PENDING IMPLEMENTATION (scaffold).
#include "common/validate.h"
