"""TritonServer.is_ready: ready only once the HTTP health route says so *and* the metrics endpoint serves
(Triton opens its metrics port ~40 ms after the HTTP one; a scrape in between was refused, a CI failure)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagedcore.distributed.launch import free_port


class Ok(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def serve(port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_ready_waits_for_the_metrics_endpoint(tmp_path):
    pytest.importorskip("pytriton")
    from pagedcore.adapters.triton_launcher import TritonServer

    http, metrics = free_port(), free_port()
    launcher = TritonServer(tmp_path, http_port=http, grpc_port=free_port(), metrics_port=metrics)
    servers = [serve(http)]
    try:
        assert not launcher.is_ready(), "HTTP ready, metrics port closed: not ready yet"
        servers.append(serve(metrics))
        assert launcher.is_ready()
        no_metrics = TritonServer(tmp_path, http_port=http, grpc_port=free_port(), metrics_port=free_port(),
                                  extra_args=["--allow-metrics=false"])
        assert no_metrics.is_ready(), "metrics switched off: HTTP alone decides"
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
