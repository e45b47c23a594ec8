"""An etcd server for the store's HA tests: ``MOONCAKE_TEST_ETCD`` (HOST:PORT, exported by
.ci/run) when set, else one started here on free 127.0.0.1 ports if the ``etcd`` binary
exists (own session, killed on teardown); otherwise the tests skip with a reason."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

from tests.faults import kill_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=2) as r:
            return b"true" in r.read()
    except OSError:
        return False


class EtcdServer:
    def __init__(self):
        self.proc = None
        self.dir = None
        ext = os.environ.get("MOONCAKE_TEST_ETCD")
        if ext:
            self.endpoint = ext
            return
        binary = shutil.which("etcd")
        if binary is None:
            raise FileNotFoundError(
                "no etcd binary (apt-get install etcd-server) and MOONCAKE_TEST_ETCD unset"
            )
        cport, pport = _free_port(), _free_port()
        self.dir = tempfile.mkdtemp(prefix="mooncake-etcd-")
        self.endpoint = f"127.0.0.1:{cport}"
        log = open(os.path.join(self.dir, "etcd.log"), "w")
        self.proc = subprocess.Popen(
            [
                binary,
                "--name",
                "t",
                "--data-dir",
                os.path.join(self.dir, "data"),
                "--listen-client-urls",
                f"http://127.0.0.1:{cport}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{cport}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{pport}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{pport}",
                "--initial-cluster",
                f"t=http://127.0.0.1:{pport}",
            ],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while not healthy(self.endpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("etcd did not start")
            time.sleep(0.1)

    def stop(self):
        if self.proc is not None:
            kill_group(self.proc, wait_s=10)
            self.proc = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
