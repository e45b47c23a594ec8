// The parts of mooncake_pg._C (private), one register function per subsystem; module.cpp
// holds the one PYBIND11_MODULE, which calls them. Each part's .cpp includes only what its
// bindings need: the transfer engine's no torch header, the process group's and EP's torch.
#pragma once
#include <pybind11/pybind11.h>

namespace mooncake::bindings {

// TransferEngine, the store's parallel copies, address and CPU helpers, RDMA discovery
void register_transport(pybind11::module_& m);
// BackendConfig, MooncakeBackend, MooncakeWork, RankFailureError, the CUDA test helpers
void register_pg(pybind11::module_& m);
// mooncake_ep's CPU row kernel
void register_ep(pybind11::module_& m);

}  // namespace mooncake::bindings
