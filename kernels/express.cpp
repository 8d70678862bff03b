// The eager ops' per-call path below Python (kernels/express.py builds and explains it): a
// table of committed launches, each matched on the op, its group, its scalar and the exact
// layout of its tensors, then launched with cuLaunchKernelEx on the current stream. Python only
// builds the records; a call that matches none returns None and takes the Python path.
//
// It includes no torch header: torch's types and the few callables it needs (torch.empty, the
// grad mode, the current device and stream) are handed over once (express.build calls bind),
// and tensors are read through their Python attributes. Compiling against ATen's and
// pybind11's headers took 11-14 s, the window in which a fresh machine's eager calls paid the
// Python path's host cost; this compiles in about 2 s, and a tensor's attributes cost
// well under a microsecond each.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using ParamInfoFn = int (*)(void*, size_t, size_t*, size_t*);

void* driver_symbol(const char* name) {
  static void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  return library == nullptr ? nullptr : dlsym(library, name);
}

// cuLaunchKernelEx's config and attribute as cuda.h (CUDA 12) lays them out, with the driver's
// handle types as void*; the one attribute used: programmatic stream serialization (6), for
// kernels Triton compiled with launch_pdl.
struct LaunchAttribute {
  int id;
  char pad[4];
  union { char bytes[64]; int value; };  // cuda.h's union is 64 bytes, at offset 8
};
struct LaunchConfig {
  unsigned grid[3], block[3], shared;
  void* stream;
  LaunchAttribute* attributes;
  unsigned count;
};
static_assert(sizeof(LaunchAttribute) == 72 && sizeof(LaunchConfig) == 56, "cuda.h's layout");
using LaunchFn = int (*)(const LaunchConfig*, void*, void**, void**);
LaunchFn launcher = nullptr;  // cuLaunchKernelEx unless a test set another

// A new reference, released when it goes out of scope.
struct Decref {
  void operator()(PyObject* p) const { Py_XDECREF(p); }
};
using Ref = std::unique_ptr<PyObject, Decref>;

struct Torch {
  // From bind, held for the module's life: torch.Tensor, nn.Parameter, torch.empty,
  // torch.empty_like (half torch.empty's cost per call), torch.is_grad_enabled, and the
  // current device () -> int and raw stream (device) -> int, both None without CUDA.
  PyObject *tensor_type, *parameter_type, *empty, *empty_like, *grad_enabled, *current_device,
      *current_stream;
  PyObject* empty_kwnames;  // ("dtype", "device")
  PyObject *shape, *dtype, *stride, *data_ptr, *get_device, *requires_grad, *is_cuda;  // interned
} torch_{};

struct Layout {  // what a tensor argument must be like
  std::vector<int64_t> sizes, strides;
  Ref dtype;     // a torch.dtype (one object per dtype)
  bool aligned;  // its address is a kernel argument: 16-byte aligned, like Triton's
};

struct Output {  // what each call allocates: torch.empty(sizes, dtype=, device=)
  Ref sizes, dtype, device;
  bool like_first;  // the same as torch.empty_like(the first input), which is contiguous
};

// Its references are dropped with it, with the GIL held: by clear(), or by the call that
// launched it last (a call holds its record while torch.empty lets go of the GIL, and another
// thread's clear() may drop the table's hold then; `keep` keeps its buffers and kernel alive).
struct Record {
  int op;
  Ref group;  // matched by identity
  Ref keep;   // what owns the launch's buffers and kernel
  double scalar;
  int device;  // -1: any (CPU tests)
  std::vector<Layout> inputs;
  std::vector<Output> outputs;
  std::vector<int> returned;  // indices into outputs, in the op's order
  uint64_t function;
  unsigned grid[3], threads, shared;
  bool pdl;  // with programmatic dependent launch
  std::vector<uint64_t> cells;              // one 8-byte cell per kernel parameter
  std::vector<std::pair<int, int>> slots;   // (cell, tensor: inputs, then outputs)
};

size_t recorded = 0;
// Records by the hash of what a call is matched on first (op, group, scalar, input sizes), so
// that a serving job's hundreds of token counts cost one lookup, not a scan. Never destroyed:
// at exit the interpreter is gone before static destructors run, and dropping a reference
// then aborts the process.
auto& index = *new std::unordered_map<uint64_t, std::vector<std::shared_ptr<Record>>>();
int64_t hits = 0;  // calls launched from here: what tests and benchmarks check

uint64_t mix(uint64_t seed, uint64_t value) {
  return seed ^ (value + 0x9e3779b97f4a7c15ULL + (seed << 6) + (seed >> 2));
}

uint64_t key_of(int op, const void* group, double scalar,
                const std::vector<std::vector<int64_t>>& shapes) {
  uint64_t bits;
  std::memcpy(&bits, &scalar, sizeof bits);
  uint64_t key = mix(mix(mix(static_cast<uint64_t>(op), reinterpret_cast<uintptr_t>(group)),
                         bits), shapes.size());
  for (const auto& shape : shapes)
    for (int64_t size : shape) key = mix(key, static_cast<uint64_t>(size));
  return key;
}

// A tuple of ints (a torch.Size, a stride) as a vector; false if it is not one.
bool ints_of(PyObject* sequence, std::vector<int64_t>& out) {
  if (sequence == nullptr || !PyTuple_Check(sequence)) return false;
  out.resize(static_cast<size_t>(PyTuple_GET_SIZE(sequence)));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(sequence, static_cast<Py_ssize_t>(i)));
  return !PyErr_Occurred();
}

bool is_plain_tensor(PyObject* item) {  // Tensor or Parameter: no subclass, fake or wrapper
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(item));
  return type == torch_.tensor_type || type == torch_.parameter_type;
}

// An int result of `self.name()`, or -1 where it failed (an error then set).
int64_t int_method(PyObject* self, PyObject* name) {
  Ref result(PyObject_CallMethodObjArgs(self, name, nullptr));
  return result.get() == nullptr ? -1 : PyLong_AsLongLong(result.get());
}

// What a call must be like to take `record`, given its tensors (sizes already matched):
// dtype, strides, alignment where launched by address, device, no autograd.
bool matches(const Record& record, PyObject* const* items, bool grad) {
  std::vector<int64_t> strides;
  for (size_t i = 0; i < record.inputs.size(); ++i) {
    const Layout& layout = record.inputs[i];
    Ref dtype(PyObject_GetAttr(items[i], torch_.dtype));
    if (dtype.get() != layout.dtype.get()) return false;
    Ref stride(PyObject_CallMethodObjArgs(items[i], torch_.stride, nullptr));
    if (!ints_of(stride.get(), strides) || strides != layout.strides) return false;
    if (layout.aligned) {
      int64_t address = int_method(items[i], torch_.data_ptr);
      if (address <= 0 || address % 16) return false;
    }
    if (record.device >= 0) {
      Ref cuda(PyObject_GetAttr(items[i], torch_.is_cuda));
      if (cuda.get() != Py_True || int_method(items[i], torch_.get_device) != record.device)
        return false;
    }
    if (grad && Ref(PyObject_GetAttr(items[i], torch_.requires_grad)).get() != Py_False)
      return false;
  }
  return true;
}

// The outputs of `record`'s kernel launched on `items` and fresh outputs, as a tuple.
PyObject* launch(const Record& record, PyObject* const* items, Py_ssize_t count, void* stream,
                 bool& failed) {
  std::vector<Ref> outputs;
  outputs.reserve(record.outputs.size());
  for (const Output& spec : record.outputs) {
    PyObject* empty_args[] = {spec.sizes.get(), spec.dtype.get(), spec.device.get()};
    outputs.emplace_back(spec.like_first
                             ? PyObject_Vectorcall(torch_.empty_like, items, 1, nullptr)
                             : PyObject_Vectorcall(torch_.empty, empty_args, 1,
                                                   torch_.empty_kwnames));
    if (outputs.back().get() == nullptr) return nullptr;  // out of memory: Python raises it
  }
  std::vector<uint64_t> cells = record.cells;
  for (const auto& [cell, tensor] : record.slots) {
    PyObject* t = tensor < count ? items[tensor] : outputs[tensor - count].get();
    int64_t address = int_method(t, torch_.data_ptr);
    if (address < 0) return nullptr;
    cells[cell] = static_cast<uint64_t>(address);
  }
  std::vector<void*> params(cells.size());
  for (size_t i = 0; i < cells.size(); ++i) params[i] = &cells[i];
  LaunchAttribute attribute{6, {}, {}};
  attribute.value = 1;
  LaunchConfig config{{record.grid[0], record.grid[1], record.grid[2]}, {record.threads, 1, 1},
                      record.shared, stream, &attribute, record.pdl ? 1u : 0u};
  int status = launcher(&config, reinterpret_cast<void*>(record.function), params.data(), nullptr);
  if (status != 0) {
    failed = true;
    PyErr_SetString(PyExc_RuntimeError, ("infini_dist express launch: the driver returned "
                                         + std::to_string(status)).c_str());
    return nullptr;
  }
  ++hits;
  PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(record.returned.size()));
  for (size_t i = 0; result != nullptr && i < record.returned.size(); ++i)
    PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i),
                     Py_NewRef(outputs[static_cast<size_t>(record.returned[i])].get()));
  failed = result == nullptr;
  return result;
}

// The launch of the first record `args` match, its outputs as a tuple; nullptr where none
// matches (a Python error may be left: the caller clears it) or, with `failed` set, where
// the driver refused the launch.
PyObject* launch_matching(PyObject* const* args, bool& failed) {
  int op = static_cast<int>(PyLong_AsLong(args[0]));
  PyObject* group = args[1];
  double scalar = PyFloat_AsDouble(args[2]);
  if (PyErr_Occurred()) return nullptr;
  Ref fast(PySequence_Fast(args[3], "tensors"));
  if (fast.get() == nullptr) return nullptr;
  Py_ssize_t count = PySequence_Fast_GET_SIZE(fast.get());
  PyObject* const* items = PySequence_Fast_ITEMS(fast.get());
  std::vector<std::vector<int64_t>> shapes(static_cast<size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (!is_plain_tensor(items[i])) return nullptr;
    Ref shape(PyObject_GetAttr(items[i], torch_.shape));
    if (!ints_of(shape.get(), shapes[static_cast<size_t>(i)])) return nullptr;
  }
  auto found = index.find(key_of(op, group, scalar, shapes));
  if (found == index.end()) return nullptr;
  Ref grad(PyObject_CallNoArgs(torch_.grad_enabled));
  if (grad.get() == nullptr) return nullptr;
  for (std::shared_ptr<Record> record : found->second) {  // held through the launch
    bool same = record->op == op && record->group.get() == group && record->scalar == scalar
                && record->inputs.size() == shapes.size();
    for (size_t i = 0; same && i < shapes.size(); ++i) same = shapes[i] == record->inputs[i].sizes;
    same = same && matches(*record, items, grad.get() == Py_True);
    if (PyErr_Occurred()) return nullptr;
    if (!same) continue;
    void* stream = nullptr;
    if (record->device >= 0) {
      if (torch_.current_stream == Py_None) return nullptr;
      Ref current(PyObject_CallNoArgs(torch_.current_device));
      if (current.get() == nullptr || PyLong_AsLong(current.get()) != record->device)
        return nullptr;
      PyObject* device[] = {current.get()};
      Ref raw(PyObject_Vectorcall(torch_.current_stream, device, 1, nullptr));
      if (raw.get() == nullptr) return nullptr;
      stream = PyLong_AsVoidPtr(raw.get());
      if (PyErr_Occurred()) return nullptr;
    }
    return launch(*record, items, count, stream, failed);
  }
  return nullptr;
}

// call(op, group, scalar, tensors): the recorded launch's outputs as a tuple, or None where no
// record matches (anything but plain tensors leaves the call to Python, whose checks say what
// is wrong).
PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  bool failed = false;
  PyObject* result = nargs == 4 && torch_.empty != nullptr ? launch_matching(args, failed)
                                                           : nullptr;
  if (result != nullptr || failed) return result;
  PyErr_Clear();
  Py_RETURN_NONE;
}

// Sizes of the kernel's parameters as the driver reports them (cuFuncGetParamInfo), or an
// empty list where the driver cannot tell.
PyObject* param_sizes(PyObject*, PyObject* function) {
  uint64_t handle = PyLong_AsUnsignedLongLong(function);
  if (PyErr_Occurred()) return nullptr;
  auto info = reinterpret_cast<ParamInfoFn>(driver_symbol("cuFuncGetParamInfo"));
  PyObject* sizes = PyList_New(0);
  if (sizes == nullptr || info == nullptr) return sizes;
  for (size_t i = 0;; ++i) {
    size_t offset = 0, size = 0;
    if (info(reinterpret_cast<void*>(handle), i, &offset, &size) != 0) break;
    Ref value(PyLong_FromSize_t(size));
    if (value.get() == nullptr || PyList_Append(sizes, value.get()) != 0) {
      Py_DECREF(sizes);
      return nullptr;
    }
  }
  return sizes;
}

// Parses one (sizes, strides, dtype, aligned) input or (sizes, dtype, device, like_first)
// output into `record`, taking references.
bool add_tensor(Record& record, PyObject* item, bool input) {
  PyObject *sizes, *second, *third;
  int flag;
  if (!PyArg_ParseTuple(item, "O!OOp", &PyTuple_Type, &sizes, &second, &third, &flag))
    return false;
  if (!input) {
    record.outputs.push_back(
        {Ref(Py_NewRef(sizes)), Ref(Py_NewRef(second)), Ref(Py_NewRef(third)), flag != 0});
    return true;
  }
  Layout layout{{}, {}, Ref(Py_NewRef(third)), flag != 0};
  if (!ints_of(sizes, layout.sizes) || !ints_of(second, layout.strides)) {
    PyErr_SetString(PyExc_ValueError, "an input's sizes and strides must be tuples of ints");
    return false;
  }
  record.inputs.push_back(std::move(layout));
  return true;
}

template <typename T>
std::vector<T> vector_of(const char* bytes, Py_ssize_t length) {
  std::vector<T> values(static_cast<size_t>(length) / sizeof(T));
  if (!values.empty()) std::memcpy(values.data(), bytes, values.size() * sizeof(T));
  return values;
}

// add(op, group, keep, scalar, device, inputs, outputs, returned, function, grid, threads,
//     shared, cells, slots, pdl), from express.add: inputs as (sizes, strides, dtype, aligned),
// outputs as (sizes, dtype, device, like the first input), grid as 3 ints; returned (int32),
// cells (uint64) and slots ((cell, tensor) int32 pairs) as packed native-order bytes.
PyObject* add(PyObject*, PyObject* args) {
  auto record = std::make_shared<Record>();
  PyObject *group, *keep, *inputs, *outputs;
  const char *returned, *cells, *slots;
  Py_ssize_t returned_n, cells_n, slots_n;
  unsigned long long function;
  int pdl = 0;
  if (!PyArg_ParseTuple(args, "iOOdiO!O!y#K(III)IIy#y#|p", &record->op, &group, &keep,
                        &record->scalar, &record->device, &PyList_Type, &inputs, &PyList_Type,
                        &outputs, &returned, &returned_n, &function, &record->grid[0],
                        &record->grid[1], &record->grid[2], &record->threads, &record->shared,
                        &cells, &cells_n, &slots, &slots_n, &pdl))
    return nullptr;
  record->pdl = pdl != 0;
  if (launcher == nullptr) launcher = reinterpret_cast<LaunchFn>(driver_symbol("cuLaunchKernelEx"));
  if (launcher == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "infini_dist express: no cuLaunchKernelEx");
    return nullptr;
  }
  record->group.reset(Py_NewRef(group));
  record->keep.reset(Py_NewRef(keep));
  record->function = function;
  record->returned = vector_of<int>(returned, returned_n);
  record->cells = vector_of<uint64_t>(cells, cells_n);
  auto flat = vector_of<int>(slots, slots_n);
  for (size_t i = 0; i + 1 < flat.size(); i += 2) record->slots.emplace_back(flat[i], flat[i + 1]);
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(inputs); ++i)
    ok = add_tensor(*record, PyList_GET_ITEM(inputs, i), true);
  for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(outputs); ++i)
    ok = add_tensor(*record, PyList_GET_ITEM(outputs, i), false);
  size_t tensors = record->inputs.size() + record->outputs.size();
  for (const auto& [cell, tensor] : record->slots)  // what a launch may index
    if (ok && (cell < 0 || static_cast<size_t>(cell) >= record->cells.size() || tensor < 0
               || static_cast<size_t>(tensor) >= tensors)) {
      PyErr_SetString(PyExc_ValueError, "slots: a cell or tensor out of range");
      ok = false;
    }
  for (int index : record->returned)
    if (ok && (index < 0 || static_cast<size_t>(index) >= record->outputs.size())) {
      PyErr_SetString(PyExc_ValueError, "returned: an index out of range");
      ok = false;
    }
  if (!ok) return nullptr;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& layout : record->inputs) shapes.push_back(layout.sizes);
  index[key_of(record->op, group, record->scalar, shapes)].push_back(std::move(record));
  ++recorded;
  Py_RETURN_NONE;
}

PyObject* clear(PyObject*, PyObject*) {
  index.clear();
  recorded = 0;
  Py_RETURN_NONE;
}

PyObject* bind(PyObject*, PyObject* args) {
  PyObject* given[7];
  if (!PyArg_ParseTuple(args, "OOOOOOO", &given[0], &given[1], &given[2], &given[3], &given[4],
                        &given[5], &given[6]))
    return nullptr;
  PyObject** kept[] = {&torch_.tensor_type, &torch_.parameter_type, &torch_.empty,
                       &torch_.empty_like, &torch_.grad_enabled, &torch_.current_device,
                       &torch_.current_stream};
  for (size_t i = 0; i < 7; ++i) Py_XSETREF(*kept[i], Py_NewRef(given[i]));
  if (torch_.empty_kwnames == nullptr) {
    torch_.empty_kwnames = Py_BuildValue("(ss)", "dtype", "device");
    const char* names[] = {"shape", "dtype", "stride", "data_ptr", "get_device",
                           "requires_grad", "is_cuda"};
    PyObject** interned[] = {&torch_.shape, &torch_.dtype, &torch_.stride, &torch_.data_ptr,
                             &torch_.get_device, &torch_.requires_grad, &torch_.is_cuda};
    for (size_t i = 0; i < 7; ++i) *interned[i] = PyUnicode_InternFromString(names[i]);
  }
  Py_RETURN_NONE;
}

PyObject* size(PyObject*, PyObject*) { return PyLong_FromSize_t(recorded); }

PyObject* hit_count(PyObject*, PyObject*) { return PyLong_FromLongLong(hits); }

PyObject* set_launcher(PyObject*, PyObject* address) {
  void* pointer = PyLong_AsVoidPtr(address);
  if (PyErr_Occurred()) return nullptr;
  launcher = reinterpret_cast<LaunchFn>(pointer);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call)), METH_FASTCALL,
     "call(op, group, scalar, tensors): the outputs of a recorded launch, or None"},
    {"add", add, METH_VARARGS, "record one committed launch (kernels/express.py's add)"},
    {"clear", clear, METH_NOARGS, "forget every record"},
    {"bind", bind, METH_VARARGS, "torch's types and callables the table uses"},
    {"size", size, METH_NOARGS, "how many records"},
    {"hits", hit_count, METH_NOARGS, "calls launched from here"},
    {"param_sizes", param_sizes, METH_O, "a kernel's parameter sizes, from the driver"},
    {"set_launcher", set_launcher, METH_O, "the launch function's address (tests)"},
    {nullptr, nullptr, 0, nullptr}};

#define EXPRESS_STR2(x) #x
#define EXPRESS_STR(x) EXPRESS_STR2(x)
PyModuleDef definition = {PyModuleDef_HEAD_INIT, EXPRESS_STR(TORCH_EXTENSION_NAME), nullptr, -1,
                          methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

#define EXPRESS_INIT2(name) PyInit_##name
#define EXPRESS_INIT(name) EXPRESS_INIT2(name)
PyMODINIT_FUNC EXPRESS_INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&definition); }
