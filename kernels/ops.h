// The op table's machinery. kernels/ops.def lists every op once, as
//   KILN_OP(name, (type, parameter), (type, parameter), ...)
// and each place that needs the list includes the table with KILN_OP defined to what it makes:
// Backend's checked entry points and pure virtuals (backend.h), each backend's declarations
// (KILN_OP_OVERRIDE below), OpTimer's timed forwarding (cuda/op_timer.h), the Op enum and names.
// A parameter list is written once as (type, name) pairs, so forwarding code made from it
// (KILN_OP_ARGS) cannot pass arguments in another order than the signature (KILN_OP_PARAMS).
#pragma once

// KILN_PP_MAP(f, a, b, ...) -> f a, f b, ...: up to 12 arguments.
#define KILN_PP_CAT(a, b) KILN_PP_CAT_(a, b)
#define KILN_PP_CAT_(a, b) a##b
#define KILN_PP_COUNT(...) KILN_PP_COUNT_(__VA_ARGS__, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, )
#define KILN_PP_COUNT_(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, n, ...) n
#define KILN_PP_MAP(f, ...) KILN_PP_CAT(KILN_PP_MAP_, KILN_PP_COUNT(__VA_ARGS__))(f, __VA_ARGS__)
#define KILN_PP_MAP_1(f, x) f x
#define KILN_PP_MAP_2(f, x, ...) f x, KILN_PP_MAP_1(f, __VA_ARGS__)
#define KILN_PP_MAP_3(f, x, ...) f x, KILN_PP_MAP_2(f, __VA_ARGS__)
#define KILN_PP_MAP_4(f, x, ...) f x, KILN_PP_MAP_3(f, __VA_ARGS__)
#define KILN_PP_MAP_5(f, x, ...) f x, KILN_PP_MAP_4(f, __VA_ARGS__)
#define KILN_PP_MAP_6(f, x, ...) f x, KILN_PP_MAP_5(f, __VA_ARGS__)
#define KILN_PP_MAP_7(f, x, ...) f x, KILN_PP_MAP_6(f, __VA_ARGS__)
#define KILN_PP_MAP_8(f, x, ...) f x, KILN_PP_MAP_7(f, __VA_ARGS__)
#define KILN_PP_MAP_9(f, x, ...) f x, KILN_PP_MAP_8(f, __VA_ARGS__)
#define KILN_PP_MAP_10(f, x, ...) f x, KILN_PP_MAP_9(f, __VA_ARGS__)
#define KILN_PP_MAP_11(f, x, ...) f x, KILN_PP_MAP_10(f, __VA_ARGS__)
#define KILN_PP_MAP_12(f, x, ...) f x, KILN_PP_MAP_11(f, __VA_ARGS__)

#define KILN_OP_PARAM(type, name) type name
#define KILN_OP_ARG(type, name) name
// (Tensor, out), (Tensor, inp) -> Tensor out, Tensor inp
#define KILN_OP_PARAMS(...) KILN_PP_MAP(KILN_OP_PARAM, __VA_ARGS__)
// (Tensor, out), (Tensor, inp) -> out, inp
#define KILN_OP_ARGS(...) KILN_PP_MAP(KILN_OP_ARG, __VA_ARGS__)

// A backend declares its implementation of every op with
//   #define KILN_OP KILN_OP_OVERRIDE
//   #include "kernels/ops.def"
// inside its class, and defines run_<op> in the op's file.
#define KILN_OP_OVERRIDE(name, ...) void run_##name(KILN_OP_PARAMS(__VA_ARGS__)) override;

namespace kiln {

// One value per op, in table order (OpTimer dispatches on it).
enum class Op : int {
#define KILN_OP(name, ...) name,
#include "kernels/ops.def"
};

// The ops' names, indexed by Op.
inline constexpr const char* kOpNames[] = {
#define KILN_OP(name, ...) #name,
#include "kernels/ops.def"
};

inline const char* op_name(Op op) {
  return kOpNames[static_cast<int>(op)];
}

}  // namespace kiln
