// Bindings of the process group: BackendConfig, MooncakeBackend (a c10d::Backend) and its
// Work, the RankFailureError translator, the CUDA test helpers.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bindings/bindings.hpp"
#include "pg/backend.hpp"

namespace py = pybind11;

namespace mooncake::bindings {

void register_pg(py::module_& m) {
  py::class_<mooncake::BackendConfig>(m, "BackendConfig")
      .def(py::init<>())
      .def_readwrite("timeout_s", &mooncake::BackendConfig::timeout_s)
      .def_readwrite("transport", &mooncake::BackendConfig::transport)
      .def_readwrite("host_id", &mooncake::BackendConfig::host_id)
      .def_readwrite("listen_host", &mooncake::BackendConfig::listen_host)
      .def_readwrite("listen_host_explicit", &mooncake::BackendConfig::listen_host_explicit)
      .def_readwrite("rendezvous_addr", &mooncake::BackendConfig::rendezvous_addr)
      .def_readwrite("shm_slot_bytes", &mooncake::BackendConfig::shm_slot_bytes)
      .def_readwrite("p2p_ring_bytes", &mooncake::BackendConfig::p2p_ring_bytes)
      .def_readwrite("debug", &mooncake::BackendConfig::debug)
      .def_readwrite("group_name", &mooncake::BackendConfig::group_name)
      .def_readwrite("on_failure", &mooncake::BackendConfig::on_failure)
      .def_readwrite("inject_kill_op", &mooncake::BackendConfig::inject_kill_op)
      .def_readwrite("inject_kill_round", &mooncake::BackendConfig::inject_kill_round)
      .def_readwrite("inject_delay_op", &mooncake::BackendConfig::inject_delay_op)
      .def_readwrite("inject_delay_peer", &mooncake::BackendConfig::inject_delay_peer)
      .def_readwrite("inject_delay_ms", &mooncake::BackendConfig::inject_delay_ms)
      .def_readwrite("global_ranks", &mooncake::BackendConfig::global_ranks)
      .def_readwrite("initial_active", &mooncake::BackendConfig::initial_active)
      .def_readwrite("is_recovery", &mooncake::BackendConfig::is_recovery)
      .def_readwrite("rdma_device", &mooncake::BackendConfig::rdma_device)
      .def_readwrite("rdma_gid_index", &mooncake::BackendConfig::rdma_gid_index)
      .def_readwrite("cuda_ipc", &mooncake::BackendConfig::cuda_ipc)
      .def_readwrite("hierarchical", &mooncake::BackendConfig::hierarchical);

  // CUDA parts (private helpers for GPU tests; without CUDA they raise)
#ifdef MOONCAKE_WITH_CUDA
  m.attr("WITH_CUDA") = true;
  m.def(
      "_cuda_reduce",
      [](at::Tensor dst, const std::vector<at::Tensor>& srcs, int op) {
        mooncake::cuda_reduce_(dst, srcs, op);
      },
      py::arg("dst"), py::arg("srcs"), py::arg("op"));
  m.def(
      "_cuda_ipc_export",
      [](const at::Tensor& t) {
        int64_t off = 0;
        std::string h = mooncake::cuda_ipc_export(t, &off);
        return py::make_tuple(py::bytes(h), off);
      },
      py::arg("tensor"));
  m.def(
      "_cuda_ipc_reduce_from",
      [](at::Tensor dst, const py::bytes& handle, int64_t offset, int op) {
        mooncake::cuda_ipc_reduce_from(dst, std::string(handle), offset, op);
      },
      py::arg("dst"), py::arg("handle"), py::arg("offset"), py::arg("op"),
      py::call_guard<py::gil_scoped_release>());
#else
  m.attr("WITH_CUDA") = false;
  auto no_cuda = [](const char* fn) {
    return [fn](py::args, py::kwargs) {
      throw std::runtime_error(std::string("mooncake_pg._C.") + fn +
                               ": expected a build with CUDA "
                               "(MOONCAKE_WITH_CUDA=1), got a CPU-only build");
    };
  };
  m.def("_cuda_reduce", no_cuda("_cuda_reduce"));
  m.def("_cuda_ipc_export", no_cuda("_cuda_ipc_export"));
  m.def("_cuda_ipc_reduce_from", no_cuda("_cuda_ipc_reduce_from"));
#endif

  // RankFailureError -> mooncake_pg.errors.RankFailureError / RankFencedError (subclasses of
  // torch.distributed.DistBackendError), also when raised through torch's Work.wait.
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const mooncake::RankFailureError& e) {
      py::gil_scoped_acquire gil;
      py::module errors = py::module::import("mooncake_pg.errors");
      py::object cls = errors.attr(e.fenced ? "RankFencedError" : "RankFailureError");
      py::object exc = cls(e.what_without_backtrace(), py::cast(e.failed_ranks), e.epoch);
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });

  py::class_<mooncake::MooncakeWork, c10d::Work, c10::intrusive_ptr<mooncake::MooncakeWork>>(m,
                                                                                             "MooncakeWork")
      .def_property_readonly("failed_ranks", [](mooncake::MooncakeWork& w) {
        std::vector<int> out;
        auto e = w.exception();
        if (!e) return out;
        try {
          std::rethrow_exception(e);
        } catch (const mooncake::RankFailureError& f) {
          out = f.failed_ranks;
        } catch (...) {
        }
        return out;
      });

  using mooncake::Group;
  using mooncake::MooncakeBackend;
  using mooncake::translated;
  py::class_<MooncakeBackend, c10d::Backend, c10::intrusive_ptr<MooncakeBackend>>(m, "MooncakeBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       const mooncake::BackendConfig& cfg) {
             return c10::make_intrusive<MooncakeBackend>(store, rank, size, cfg);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("config"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("transport", &MooncakeBackend::transport_name)
      .def_property_readonly("ops_issued", &MooncakeBackend::ops_issued)
      .def("_cuda_ipc_status", &MooncakeBackend::cuda_ipc_status)
      // membership: the group core's, its errors as torch's (pg/convert.hpp)
      .def("rank_hosts", [](MooncakeBackend& b) { return b.group().rank_hosts(); })
      .def("active_ranks", [](MooncakeBackend& b) { return b.group().active_ranks(); })
      .def("epoch", [](MooncakeBackend& b) { return b.group().epoch(); })
      .def("failed_ranks", [](MooncakeBackend& b) { return b.group().failed_ranks(); })
      .def("pending_failed", [](MooncakeBackend& b) { return b.group().pending_failed(); })
      .def(
          "deactivate_ranks",
          [](MooncakeBackend& b, const std::vector<int>& ranks) {
            translated([&] { b.group().deactivate_ranks(ranks); });
          },
          py::arg("ranks"), py::call_guard<py::gil_scoped_release>())
      .def(
          "pending_ranks",
          [](MooncakeBackend& b) { return translated([&] { return b.group().pending_ranks(); }); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "recover_ranks",
          [](MooncakeBackend& b, const std::vector<int>& ranks) {
            translated([&] { b.group().recover_ranks(ranks); });
          },
          py::arg("ranks"), py::call_guard<py::gil_scoped_release>())
      .def(
          "join_group",
          [](MooncakeBackend& b, double timeout_s) { translated([&] { b.group().join_group(timeout_s); }); },
          py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("joining", [](MooncakeBackend& b) { return b.group().joining(); })
      .def("last_joined", [](MooncakeBackend& b) { return b.group().last_joined(); });
  m.def("known_failed_global_ranks", &mooncake::known_failed_global_ranks,
        "Default-group ranks that any mooncake group of this process has agreed failed.");
}

}  // namespace mooncake::bindings
