// dicts[i].get(keys[i]) is values[i] for every i, with the memory it reads asked for ahead: the decode stack's check,
// each step, that every module it stands in for is still in place with the forward it had (decode_stack._in_place).
//
// Why here: a decode step streams the weights through the caches, so the next step's Python starts with its
// objects evicted, and ~600 dict lookups in a row (all(map(...)) in C) waited on one cache miss after another:
// ~0.23-0.28 ms of a ~6 ms one-row step on Zen 4, 0.02 ms with the caches warm. Here each dict's object is asked for
// 2 * kAhead lookups ahead and its keys and values kAhead ahead, so the misses overlap: ~0.06-0.08 ms
// (session 43: the same lookups in C++ without asking ahead took 0.10-0.16 ms; warm, 5-8 us).
#include "ops.h"

#include <xmmintrin.h>

namespace {
constexpr Py_ssize_t kAhead = 12;
constexpr int kKeyLines = 4;  // of a dict's keys object: its index and first entries (a module's dicts are small)

inline void ask(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
}  // namespace

bool objects_in_place(py::list dicts, py::list keys, py::list values) {
  const Py_ssize_t n = PyList_GET_SIZE(dicts.ptr());
  TORCH_CHECK(PyList_GET_SIZE(keys.ptr()) == n && PyList_GET_SIZE(values.ptr()) == n, "dicts, keys, values: one length");
  PyObject **d = PySequence_Fast_ITEMS(dicts.ptr()), **k = PySequence_Fast_ITEMS(keys.ptr());
  PyObject** v = PySequence_Fast_ITEMS(values.ptr());
  for (Py_ssize_t i = 0; i < n + 2 * kAhead; ++i) {
    if (i < n) ask(d[i]);
    if (const Py_ssize_t j = i - kAhead; j >= 0 && j < n && PyDict_CheckExact(d[j])) {
      const auto* o = reinterpret_cast<const PyDictObject*>(d[j]);
      for (int l = 0; l < kKeyLines; ++l) ask(reinterpret_cast<const char*>(o->ma_keys) + 64 * l);
      if (o->ma_values != nullptr) ask(o->ma_values);  // a split table's values (an instance's __dict__)
    }
    if (const Py_ssize_t j = i - 2 * kAhead; j >= 0) {
      if (!PyDict_CheckExact(d[j])) return false;  // replaced by something else: not in place
      PyObject* got = PyDict_GetItemWithError(d[j], k[j]);  // borrowed
      if (got == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();  // a key whose hash raised
        got = Py_None;  // dict.get's default
      }
      if (got != v[j]) return false;
    }
  }
  return true;
}
