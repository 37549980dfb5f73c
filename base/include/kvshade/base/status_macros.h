// Status propagation macros for kvshade. Debian's Abseil ships absl::Status but not the
// RETURN_IF_ERROR / ASSIGN_OR_RETURN macros; they are defined once, here, for every layer.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVSHADE_CONCAT_INNER_(a, b) a##b
#define KVSHADE_CONCAT_(a, b) KVSHADE_CONCAT_INNER_(a, b)

// Returns the status of `expr` from the enclosing function when it is not OK.
#define KVSHADE_RETURN_IF_ERROR(expr)                      \
  do {                                                     \
    ::absl::Status kvshade_status_ = (expr);               \
    if (!kvshade_status_.ok()) return kvshade_status_;     \
  } while (0)

// `KVSHADE_ASSIGN_OR_RETURN(auto x, Foo());` declares x from an OK StatusOr or returns
// its status.
#define KVSHADE_ASSIGN_OR_RETURN(lhs, expr) \
  KVSHADE_ASSIGN_OR_RETURN_IMPL_(KVSHADE_CONCAT_(kvshade_statusor_, __LINE__), lhs, expr)
#define KVSHADE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()
