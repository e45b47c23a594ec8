// The only pybind11 file: exposes the backend as mooncake_pg._C (private).
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include "ep/rows.hpp"
#include "pg/backend.hpp"
#include "transport/copy.hpp"
#include "transport/shm.hpp"
#include "transport/tcp.hpp"
#include "transport/transfer_engine.hpp"
#ifdef MOONCAKE_WITH_RDMA
#include "transport/rdma/verbs.hpp"
#endif

namespace py = pybind11;

#ifndef MOONCAKE_TORCH_VERSION
#define MOONCAKE_TORCH_VERSION "unknown"
#endif

namespace {
// Bytes of a C-contiguous buffer (what the copies and transfers below read or write
// linearly); a strided one (a slice with a step, a broadcast or reversed array) is refused
// with TORCH_CHECK naming `what`, instead of reading or writing past what it covers.
size_t contiguous_bytes(const py::buffer_info& i, const char* what) {
  py::ssize_t expect = i.itemsize;
  for (py::ssize_t d = i.ndim - 1; d >= 0; --d) {
    TORCH_CHECK(i.shape[d] <= 1 || i.strides[d] == expect, what, ": buffer is not contiguous (dimension ", d,
                " has stride ", i.strides[d], " bytes, expected ", expect, ")");
    expect *= i.shape[d];
  }
  return static_cast<size_t>(i.size) * static_cast<size_t>(i.itemsize);
}

// A TransferEngine exception as a Python error: a failed connection to the peer
// (PeerConnectionError) as torch.distributed.DistNetworkError, anything else as
// RuntimeError; both keep the engine's "TransferEngine::method:" message.
[[noreturn]] void raise_engine_error(const std::exception& e) {
  if (dynamic_cast<const mooncake::PeerConnectionError*>(&e) != nullptr)
    TORCH_CHECK_WITH(DistNetworkError, false, e.what());
  TORCH_CHECK(false, e.what());
}
}  // namespace

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
      .def_readwrite("global_ranks", &mooncake::BackendConfig::global_ranks)
      .def_readwrite("initial_active", &mooncake::BackendConfig::initial_active)
      .def_readwrite("is_recovery", &mooncake::BackendConfig::is_recovery)
      .def_readwrite("rdma_device", &mooncake::BackendConfig::rdma_device)
      .def_readwrite("rdma_gid_index", &mooncake::BackendConfig::rdma_gid_index)
      .def_readwrite("cuda_ipc", &mooncake::BackendConfig::cuda_ipc)
      .def_readwrite("hierarchical", &mooncake::BackendConfig::hierarchical);

  // mooncake_ep's CPU row kernel (mooncake_ep/kernels.py)
  m.def(
      "_ep_scatter_add_rows",
      [](const at::Tensor& rows, const at::Tensor& idx, const std::optional<at::Tensor>& src,
         const std::optional<at::Tensor>& weights, at::Tensor out) {
        mooncake::ep::scatter_add_rows(rows, idx, src.value_or(at::Tensor()), weights.value_or(at::Tensor()),
                                       out);
      },
      py::arg("rows"), py::arg("idx"), py::arg("src"), py::arg("weights"), py::arg("out"),
      py::call_guard<py::gil_scoped_release>());

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

  // RDMA NIC discovery (lists of plain dicts; mooncake_pg.rdma_devices() wraps them)
#ifdef MOONCAKE_WITH_RDMA
  m.attr("WITH_RDMA") = true;
  m.def("rdma_devices", []() {
    std::vector<mooncake::RdmaDeviceInfo> devs;
    {
      py::gil_scoped_release nogil;
      devs = mooncake::rdma_devices();
    }
    py::list out;
    for (const auto& d : devs) {
      py::list ports;
      for (const auto& p : d.ports) {
        py::dict pd;
        pd["port"] = p.port;
        pd["state"] = p.state;
        pd["active"] = p.active;
        pd["link_layer"] = p.link_layer;
        pd["lid"] = p.lid;
        pd["active_mtu"] = p.active_mtu;
        pd["gid_index"] = p.gid_index;
        pd["gid"] = p.gid;
        ports.append(pd);
      }
      py::dict dd;
      dd["name"] = d.name;
      dd["node_guid"] = d.node_guid;
      dd["ports"] = ports;
      out.append(dd);
    }
    return out;
  });
  // private, for tests: the port choice over a given device list, and QP info codec
  m.def(
      "_rdma_choose",
      [](const py::list& devs, const std::string& spec) {
        std::vector<mooncake::RdmaDeviceInfo> v;
        for (const auto& d : devs) {
          mooncake::RdmaDeviceInfo info;
          info.name = d["name"].cast<std::string>();
          for (const auto& p : d["ports"]) {
            mooncake::RdmaPortInfo pi;
            pi.port = p["port"].cast<int>();
            pi.state = p["state"].cast<std::string>();
            pi.active = pi.state == "PORT_ACTIVE";
            info.ports.push_back(pi);
          }
          v.push_back(info);
        }
        std::string dev;
        int port = 0;
        mooncake::rdma_choose(v, spec, &dev, &port);
        return py::make_tuple(dev, port);
      },
      py::arg("devices"), py::arg("spec"));
  m.def("_rdma_qp_info_roundtrip",
        [](const std::string& s) { return mooncake::RdmaQpInfo::decode(s).encode(); });
#else
  m.attr("WITH_RDMA") = false;
  m.def("rdma_devices", []() { return py::list(); });
#endif

  // RankFailure -> mooncake_pg.errors.RankFailureError / RankFencedError (subclasses of
  // torch.distributed.DistBackendError), also when raised through torch's Work.wait.
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const mooncake::RankFailure& e) {
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
        } catch (const mooncake::RankFailure& f) {
          out = f.failed_ranks;
        } catch (...) {
        }
        return out;
      });

  py::class_<mooncake::MooncakeBackend, c10d::Backend, c10::intrusive_ptr<mooncake::MooncakeBackend>>(
      m, "MooncakeBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       const mooncake::BackendConfig& cfg) {
             return c10::make_intrusive<mooncake::MooncakeBackend>(store, rank, size, cfg);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("config"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("transport", &mooncake::MooncakeBackend::transport_name)
      .def_property_readonly("ops_issued", &mooncake::MooncakeBackend::ops_issued)
      .def("_cuda_ipc_status", &mooncake::MooncakeBackend::cuda_ipc_status)
      .def("rank_hosts", &mooncake::MooncakeBackend::rank_hosts)
      .def("active_ranks", &mooncake::MooncakeBackend::active_ranks)
      .def("epoch", &mooncake::MooncakeBackend::epoch)
      .def("failed_ranks", &mooncake::MooncakeBackend::failed_ranks)
      .def("pending_failed", &mooncake::MooncakeBackend::pending_failed)
      .def("deactivate_ranks", &mooncake::MooncakeBackend::deactivate_ranks, py::arg("ranks"),
           py::call_guard<py::gil_scoped_release>())
      .def("pending_ranks", &mooncake::MooncakeBackend::pending_ranks,
           py::call_guard<py::gil_scoped_release>())
      .def("recover_ranks", &mooncake::MooncakeBackend::recover_ranks, py::arg("ranks"),
           py::call_guard<py::gil_scoped_release>())
      .def("join_group", &mooncake::MooncakeBackend::join_group, py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("joining", &mooncake::MooncakeBackend::joining)
      .def("last_joined", &mooncake::MooncakeBackend::last_joined);

  // Transfer engine (exposed as mooncake_pg.transfer.TransferEngine; the store uses it to
  // reach segments of other hosts). Buffers are anything with the buffer protocol; they
  // stay exported (and so alive) while the GIL is released for the transfer.
  py::class_<mooncake::TransferEngine>(m, "TransferEngine")
      .def(py::init([](const std::string& listen_host, const std::string& secret) {
             try {
               return std::make_unique<mooncake::TransferEngine>(listen_host, secret);
             } catch (const std::exception& e) {
               raise_engine_error(e);
             }
           }),
           py::arg("listen_host"), py::arg("secret") = "")
      .def_property_readonly("port", &mooncake::TransferEngine::port)
      .def_property_readonly("host", &mooncake::TransferEngine::host)
      .def(
          "register_memory",
          [](mooncake::TransferEngine& te, py::buffer b) {
            py::buffer_info info = b.request(true);
            size_t len = contiguous_bytes(info, "TransferEngine::register_memory");
            return te.register_memory(info.ptr, len);
          },
          py::arg("buffer"))
      .def(
          "unregister_memory",
          [](mooncake::TransferEngine& te, uint32_t region) {
            try {
              py::gil_scoped_release nogil;
              te.unregister_memory(region);
            } catch (const std::exception& e) {
              raise_engine_error(e);
            }
          },
          py::arg("region"))
      .def(
          "batch_write",
          [](mooncake::TransferEngine& te, const std::string& host, int port, uint32_t region,
             const std::vector<uint64_t>& offsets, const std::vector<py::buffer>& buffers) {
            TORCH_CHECK(offsets.size() == buffers.size(), "TransferEngine::batch_write: ", offsets.size(),
                        " offsets but ", buffers.size(), " buffers");
            std::vector<py::buffer_info> infos;
            std::vector<const void*> ptrs;
            std::vector<uint64_t> lens;
            for (auto& b : buffers) {
              infos.push_back(b.request(false));
              auto& i = infos.back();
              ptrs.push_back(i.ptr);
              lens.push_back(contiguous_bytes(i, "TransferEngine::batch_write"));
            }
            try {
              py::gil_scoped_release nogil;
              te.batch_write(host, port, region, offsets, ptrs, lens);
            } catch (const std::exception& e) {
              raise_engine_error(e);
            }
          },
          py::arg("host"), py::arg("port"), py::arg("region"), py::arg("offsets"), py::arg("buffers"))
      .def(
          "batch_read",
          [](mooncake::TransferEngine& te, const std::string& host, int port, uint32_t region,
             const std::vector<uint64_t>& offsets, const std::vector<py::buffer>& buffers) {
            TORCH_CHECK(offsets.size() == buffers.size(), "TransferEngine::batch_read: ", offsets.size(),
                        " offsets but ", buffers.size(), " buffers");
            std::vector<py::buffer_info> infos;
            std::vector<void*> ptrs;
            std::vector<uint64_t> lens;
            for (auto& b : buffers) {
              infos.push_back(b.request(true));
              auto& i = infos.back();
              TORCH_CHECK(!i.readonly, "TransferEngine::batch_read: buffer is read-only");
              ptrs.push_back(i.ptr);
              lens.push_back(contiguous_bytes(i, "TransferEngine::batch_read"));
            }
            try {
              py::gil_scoped_release nogil;
              te.batch_read(host, port, region, offsets, ptrs, lens);
            } catch (const std::exception& e) {
              raise_engine_error(e);
            }
          },
          py::arg("host"), py::arg("port"), py::arg("region"), py::arg("offsets"), py::arg("buffers"))
      .def(
          "batch_read_bytes",
          [](mooncake::TransferEngine& te, const std::string& host, int port, uint32_t region,
             const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& lens) {
            TORCH_CHECK(offsets.size() == lens.size(), "TransferEngine::batch_read_bytes: ", offsets.size(),
                        " offsets but ", lens.size(), " lengths");
            // Fresh bytes objects, filled before anyone else can see them (one copy, no
            // intermediate buffer).
            std::vector<py::object> outs;
            std::vector<void*> ptrs;
            for (uint64_t n : lens) {
              PyObject* b = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(n));
              if (!b) throw py::error_already_set();
              outs.push_back(py::reinterpret_steal<py::object>(b));
              ptrs.push_back(PyBytes_AS_STRING(b));
            }
            try {
              py::gil_scoped_release nogil;
              mooncake::prefault_fresh_outputs(ptrs, lens);  // see copy.hpp
              te.batch_read(host, port, region, offsets, ptrs, lens);
            } catch (const std::exception& e) {
              raise_engine_error(e);
            }
            py::list result;
            for (auto& o : outs) result.append(o);
            return result;
          },
          py::arg("host"), py::arg("port"), py::arg("region"), py::arg("offsets"), py::arg("lens"))
      .def("close", &mooncake::TransferEngine::close, py::call_guard<py::gil_scoped_release>());
  // Parallel copies for the store (shared-memory segments <-> user buffers).
  m.def(
      "copy_buffers",
      [](const std::vector<py::buffer>& dsts, const std::vector<py::buffer>& srcs, int threads) {
        TORCH_CHECK(dsts.size() == srcs.size(), "copy_buffers: ", dsts.size(), " destinations but ",
                    srcs.size(), " sources");
        std::vector<py::buffer_info> infos;
        infos.reserve(dsts.size() * 2);
        std::vector<mooncake::CopyOp> ops;
        for (size_t i = 0; i < dsts.size(); ++i) {
          infos.push_back(dsts[i].request(true));
          auto& d = infos.back();
          TORCH_CHECK(!d.readonly, "copy_buffers: destination ", i, " is read-only");
          size_t dn = contiguous_bytes(d, "copy_buffers: destination");
          void* dp = d.ptr;
          infos.push_back(srcs[i].request(false));
          auto& s = infos.back();
          size_t sn = contiguous_bytes(s, "copy_buffers: source");
          TORCH_CHECK(dn == sn, "copy_buffers: destination ", i, " has ", dn, " bytes but its source ", sn);
          ops.push_back({dp, s.ptr, sn});
        }
        py::gil_scoped_release nogil;
        mooncake::copy_parallel(ops, threads);
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("threads"));
  m.def(
      "copy_to_bytes",
      [](const std::vector<py::buffer>& srcs, int threads) {
        std::vector<py::buffer_info> infos;
        infos.reserve(srcs.size());
        std::vector<py::object> outs;
        std::vector<mooncake::CopyOp> ops;
        for (auto& b : srcs) {
          infos.push_back(b.request(false));
          auto& s = infos.back();
          size_t n = contiguous_bytes(s, "copy_to_bytes");
          PyObject* o = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(n));
          if (!o) throw py::error_already_set();
          outs.push_back(py::reinterpret_steal<py::object>(o));
          ops.push_back({PyBytes_AS_STRING(o), s.ptr, n});
        }
        {
          py::gil_scoped_release nogil;
          mooncake::copy_parallel(ops, threads, /*prefault_dst=*/true);  // fresh bytes objects: see copy.hpp
        }
        py::list result;
        for (auto& o : outs) result.append(o);
        return result;
      },
      py::arg("srcs"), py::arg("threads"));
  m.def(
      "touch_pages",
      [](const py::buffer& b) {
        py::buffer_info i = b.request(false);
        size_t n = contiguous_bytes(i, "touch_pages");
        py::gil_scoped_release nogil;
        return mooncake::touch_pages(i.ptr, n);
      },
      py::arg("buffer"));
  m.def("local_address_for", [](const std::string& peer, const std::string& ifname) {
    try {
      return mooncake::local_address_for(peer, ifname);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "TransferEngine::local_address_for: ", e.what());
    }
  });
  m.def("available_cpus", &mooncake::available_cpus);
  m.def("known_failed_global_ranks", &mooncake::known_failed_global_ranks,
        "Default-group ranks that any mooncake group of this process has agreed failed.");
}
