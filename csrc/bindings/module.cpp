// mooncake_pg._C: refuses to load under another torch than the one it was built for, then
// registers each part (bindings.hpp).
#include <string>

#include "bindings/bindings.hpp"

namespace py = pybind11;

#ifndef MOONCAKE_TORCH_VERSION
#define MOONCAKE_TORCH_VERSION "unknown"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "mooncake_pg private extension";
  {
    std::string running = py::module::import("torch").attr("__version__").cast<std::string>();
    if (running != MOONCAKE_TORCH_VERSION) {
      throw py::import_error(std::string("mooncake_pg._C was built for torch ") + MOONCAKE_TORCH_VERSION +
                             " but torch " + running +
                             " is running; rebuild with "
                             "`pip install --no-build-isolation -e .`");
    }
  }
  m.attr("TORCH_VERSION") = MOONCAKE_TORCH_VERSION;
  py::module::import("torch.distributed");
  mooncake::bindings::register_pg(m);
  mooncake::bindings::register_ep(m);
  mooncake::bindings::register_transport(m);
}
