// The eager ops' per-call path below Python (kernels/express.py builds and explains it): a
// table of committed launches, each matched on the op, its group, its scalar and the exact
// layout of its tensors, then launched with cuLaunchKernel on the current stream. Python only
// builds the records; a call that matches none returns None and takes the Python path.
// Only what the table uses, not torch/extension.h (the whole C++ frontend): a fresh machine's
// first build takes half the time, and until it is done eager calls take the Python path.
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <dlfcn.h>

#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

#ifdef EXPRESS_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

// cuLaunchKernel's signature, with the driver's handle types as void*.
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void*, void**, void**);
using ParamInfoFn = int (*)(void*, size_t, size_t*, size_t*);

void* driver_symbol(const char* name) {
  static void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  return library == nullptr ? nullptr : dlsym(library, name);
}

LaunchFn launcher = nullptr;  // cuLaunchKernel unless a test set another

struct Layout {  // what a tensor argument must be like
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  bool aligned;  // its address is a kernel argument: 16-byte aligned, like Triton's
};

struct Record {
  int op;
  PyObject* group;   // matched by identity; a reference held until clear()
  PyObject* keep;    // what owns the launch's buffers and kernel: alive while recorded
  double scalar;
  int device;        // -1: any (CPU tests)
  std::vector<Layout> inputs;
  std::vector<std::pair<std::vector<int64_t>, at::ScalarType>> outputs;
  std::vector<int> returned;  // indices into outputs, in the op's order
  uint64_t function;
  unsigned grid[3], threads, shared;
  std::vector<uint64_t> cells;                  // one 8-byte cell per kernel parameter
  std::vector<std::pair<int, int>> slots;       // (cell, tensor: inputs, then outputs)
};

std::vector<std::unique_ptr<Record>> records;
// Records by the hash of what a call is matched on first (op, group, scalar, input sizes), so
// that a serving job's hundreds of token counts cost one lookup, not a scan.
std::unordered_map<uint64_t, std::vector<Record*>> index;
int64_t hits = 0;  // calls launched from here: what tests and benchmarks check

uint64_t mix(uint64_t seed, uint64_t value) {
  return seed ^ (value + 0x9e3779b97f4a7c15ULL + (seed << 6) + (seed >> 2));
}

uint64_t key_of(int op, const void* group, double scalar,
                const std::vector<c10::IntArrayRef>& shapes) {
  uint64_t bits;
  std::memcpy(&bits, &scalar, sizeof bits);
  uint64_t key = mix(mix(mix(static_cast<uint64_t>(op), reinterpret_cast<uintptr_t>(group)),
                         bits), shapes.size());
  for (const auto& shape : shapes)
    for (int64_t size : shape) key = mix(key, static_cast<uint64_t>(size));
  return key;
}

bool matches(const Layout& layout, const at::Tensor& t) {
  if (!t.defined() || t.scalar_type() != layout.dtype || !t.has_storage()
      || t.key_set().has(c10::DispatchKey::Python) || t.sizes() != layout.sizes
      || t.strides() != layout.strides)
    return false;
  return !layout.aligned || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// `items`: the call's arguments as passed; anything but tensors leaves the call to Python,
// whose checks say what is wrong.
py::object call(int op, py::handle group, double scalar, const py::sequence& items) {
  std::vector<at::Tensor> args;
  args.reserve(items.size());
  for (const auto& item : items) {
    if (!THPVariable_Check(item.ptr())) return py::none();
    args.push_back(THPVariable_Unpack(item.ptr()));
  }
  std::vector<c10::IntArrayRef> shapes;
  shapes.reserve(args.size());
  for (const auto& t : args) shapes.push_back(t.sizes());
  auto found = index.find(key_of(op, group.ptr(), scalar, shapes));
  if (found == index.end()) return py::none();
  bool grad = at::GradMode::is_enabled();
  for (const Record* record : found->second) {
    if (record->op != op || record->group != group.ptr() || record->scalar != scalar
        || record->inputs.size() != args.size())
      continue;
    bool ok = true;
    for (size_t i = 0; ok && i < args.size(); ++i)
      ok = matches(record->inputs[i], args[i]) && !(grad && args[i].requires_grad())
           && (record->device < 0 || (args[i].is_cuda() && args[i].get_device() == record->device));
    if (!ok) continue;
    void* stream = nullptr;
    if (record->device >= 0) {
#ifdef EXPRESS_WITH_CUDA
      if (c10::cuda::current_device() != record->device) return py::none();
      stream = c10::cuda::getCurrentCUDAStream(record->device).stream();
#else
      return py::none();
#endif
    }
    std::vector<at::Tensor> outputs;
    outputs.reserve(record->outputs.size());
    for (const auto& [sizes, dtype] : record->outputs)
      outputs.push_back(at::empty(sizes, args[0].options().dtype(dtype)));
    std::vector<uint64_t> cells = record->cells;
    for (const auto& [cell, tensor] : record->slots) {
      const at::Tensor& t = tensor < static_cast<int>(args.size())
                                ? args[tensor] : outputs[tensor - args.size()];
      cells[cell] = reinterpret_cast<uint64_t>(t.data_ptr());
    }
    std::vector<void*> params(cells.size());
    for (size_t i = 0; i < cells.size(); ++i) params[i] = &cells[i];
    int status = launcher(reinterpret_cast<void*>(record->function), record->grid[0],
                          record->grid[1], record->grid[2], record->threads, 1, 1,
                          record->shared, stream, params.data(), nullptr);
    if (status != 0)
      throw std::runtime_error("infini_dist express launch: cuLaunchKernel returned " +
                               std::to_string(status));
    ++hits;
    py::tuple result(record->returned.size());
    for (size_t i = 0; i < record->returned.size(); ++i)
      result[i] = py::cast(outputs[record->returned[i]]);
    return std::move(result);
  }
  return py::none();
}

// Sizes of the kernel's parameters as the driver reports them (cuFuncGetParamInfo), or an
// empty list where the driver cannot tell.
std::vector<int64_t> param_sizes(uint64_t function) {
  auto info = reinterpret_cast<ParamInfoFn>(driver_symbol("cuFuncGetParamInfo"));
  std::vector<int64_t> sizes;
  if (info == nullptr) return sizes;
  for (size_t i = 0;; ++i) {
    size_t offset = 0, size = 0;
    if (info(reinterpret_cast<void*>(function), i, &offset, &size) != 0) break;
    sizes.push_back(static_cast<int64_t>(size));
  }
  return sizes;
}

void add(int op, py::object group, py::object keep, double scalar, int device,
         const std::vector<at::Tensor>& inputs, const std::vector<bool>& aligned,
         const std::vector<at::Tensor>& outputs, const std::vector<int>& returned,
         uint64_t function, const std::vector<int64_t>& grid, int64_t threads, int64_t shared,
         const std::vector<uint64_t>& cells, const std::vector<std::pair<int, int>>& slots) {
  if (launcher == nullptr) launcher = reinterpret_cast<LaunchFn>(driver_symbol("cuLaunchKernel"));
  if (launcher == nullptr) throw std::runtime_error("infini_dist express: no cuLaunchKernel");
  auto record = std::make_unique<Record>();
  record->op = op;
  record->group = group.release().ptr();
  record->keep = keep.release().ptr();
  record->scalar = scalar;
  record->device = device;
  for (size_t i = 0; i < inputs.size(); ++i)
    record->inputs.push_back({inputs[i].sizes().vec(), inputs[i].strides().vec(),
                              inputs[i].scalar_type(), static_cast<bool>(aligned.at(i))});
  for (const auto& t : outputs) record->outputs.emplace_back(t.sizes().vec(), t.scalar_type());
  record->returned = returned;
  record->function = function;
  for (int i = 0; i < 3; ++i) record->grid[i] = static_cast<unsigned>(grid.at(i));
  record->threads = static_cast<unsigned>(threads);
  record->shared = static_cast<unsigned>(shared);
  record->cells = cells;
  record->slots = slots;
  std::vector<c10::IntArrayRef> shapes;
  for (const auto& layout : record->inputs) shapes.push_back(layout.sizes);
  index[key_of(op, record->group, scalar, shapes)].push_back(record.get());
  records.push_back(std::move(record));
}

void clear() {  // with the GIL held, from Python: the groups' references are dropped here
  for (auto& record : records) {
    Py_XDECREF(record->group);
    Py_XDECREF(record->keep);
  }
  index.clear();
  records.clear();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("call", &call);
  m.def("add", &add);
  m.def("clear", &clear);
  m.def("size", [] { return records.size(); });
  m.def("hits", [] { return hits; });
  m.def("param_sizes", &param_sizes);
  m.def("set_launcher", [](uint64_t address) { launcher = reinterpret_cast<LaunchFn>(address); });
}
