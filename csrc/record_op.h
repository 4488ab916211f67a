// A profiler range around one of the package's host calls, named lightning_cafin::<op>, so
// that torch.profiler (and a user's trace) shows the host time each one takes, and which
// of the package's kernels and torch's operations it ran: without it, a C++ tap's or
// statistics op's own host time fell between the recorded operations, unattributed.
// When no profiler records, the range costs a thread-local check (a few nanoseconds).
// (ATen's RECORD_FUNCTION names its range `guard`, which the ops' device guards are named.)
#pragma once

#include <ATen/record_function.h>

#define LIGHTNING_CAFIN_RECORD_OP(op)                                     \
  at::RecordFunction lightning_cafin_record_op_(at::RecordScope::FUNCTION); \
  if (lightning_cafin_record_op_.isActive())                                \
  lightning_cafin_record_op_.before("lightning_cafin::" op, c10::ArrayRef<const c10::IValue>{})
