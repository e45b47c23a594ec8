// Bindings of the transfer engine and its helpers (no torch header): TransferEngine (exposed
// as mooncake_pg.transfer.TransferEngine; the store uses it to reach segments of other
// hosts), the store's parallel copies, the address and CPU helpers, RDMA NIC discovery.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/bindings.hpp"
#include "core/errors.hpp"  // cat()
#include "transport/copy.hpp"
#include "transport/shm.hpp"
#include "transport/tcp.hpp"
#include "transport/transfer_engine.hpp"
#ifdef MOONCAKE_WITH_RDMA
#include "transport/rdma/verbs.hpp"
#endif

namespace py = pybind11;

namespace {
// RuntimeError with the arguments streamed into its message (a check's failure)
#define MOONCAKE_PY_CHECK(cond, ...)                                     \
  do {                                                                   \
    if (!(cond)) throw std::runtime_error(::mooncake::cat(__VA_ARGS__)); \
  } while (0)

// Bytes of a C-contiguous buffer (what the copies and transfers below read or write
// linearly); a strided one (a slice with a step, a broadcast or reversed array) is refused
// with RuntimeError naming `what`, instead of reading or writing past what it covers.
size_t contiguous_bytes(const py::buffer_info& i, const char* what) {
  py::ssize_t expect = i.itemsize;
  for (py::ssize_t d = i.ndim - 1; d >= 0; --d) {
    MOONCAKE_PY_CHECK(i.shape[d] <= 1 || i.strides[d] == expect, what,
                      ": buffer is not contiguous (dimension ", d, " has stride ", i.strides[d],
                      " bytes, expected ", expect, ")");
    expect *= i.shape[d];
  }
  return static_cast<size_t>(i.size) * static_cast<size_t>(i.itemsize);
}

// A TransferEngine exception as a Python error: a failed connection to the peer
// (PeerConnectionError) as torch.distributed.DistNetworkError, anything else as
// RuntimeError; both keep the engine's "TransferEngine::method:" message.
[[noreturn]] void raise_engine_error(const std::exception& e) {
  if (dynamic_cast<const mooncake::PeerConnectionError*>(&e) != nullptr) {
    py::object cls = py::module::import("torch.distributed").attr("DistNetworkError");
    PyErr_SetString(cls.ptr(), e.what());
    throw py::error_already_set();
  }
  throw std::runtime_error(e.what());
}
}  // namespace

namespace mooncake::bindings {

void register_transport(py::module_& m) {
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
            MOONCAKE_PY_CHECK(offsets.size() == buffers.size(),
                              "TransferEngine::batch_write: ", offsets.size(), " offsets but ",
                              buffers.size(), " buffers");
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
            MOONCAKE_PY_CHECK(offsets.size() == buffers.size(),
                              "TransferEngine::batch_read: ", offsets.size(), " offsets but ", buffers.size(),
                              " buffers");
            std::vector<py::buffer_info> infos;
            std::vector<void*> ptrs;
            std::vector<uint64_t> lens;
            for (auto& b : buffers) {
              infos.push_back(b.request(true));
              auto& i = infos.back();
              MOONCAKE_PY_CHECK(!i.readonly, "TransferEngine::batch_read: buffer is read-only");
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
            MOONCAKE_PY_CHECK(offsets.size() == lens.size(),
                              "TransferEngine::batch_read_bytes: ", offsets.size(), " offsets but ",
                              lens.size(), " lengths");
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
        MOONCAKE_PY_CHECK(dsts.size() == srcs.size(), "copy_buffers: ", dsts.size(), " destinations but ",
                          srcs.size(), " sources");
        std::vector<py::buffer_info> infos;
        infos.reserve(dsts.size() * 2);
        std::vector<mooncake::CopyOp> ops;
        for (size_t i = 0; i < dsts.size(); ++i) {
          infos.push_back(dsts[i].request(true));
          auto& d = infos.back();
          MOONCAKE_PY_CHECK(!d.readonly, "copy_buffers: destination ", i, " is read-only");
          size_t dn = contiguous_bytes(d, "copy_buffers: destination");
          void* dp = d.ptr;
          infos.push_back(srcs[i].request(false));
          auto& s = infos.back();
          size_t sn = contiguous_bytes(s, "copy_buffers: source");
          MOONCAKE_PY_CHECK(dn == sn, "copy_buffers: destination ", i, " has ", dn, " bytes but its source ",
                            sn);
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
      throw std::runtime_error(std::string("TransferEngine::local_address_for: ") + e.what());
    }
  });
  m.def("available_cpus", &mooncake::available_cpus);
}

}  // namespace mooncake::bindings
