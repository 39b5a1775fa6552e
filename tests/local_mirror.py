"""A local HTTP mirror for the download tests: a threaded static-file server over a
directory, on 127.0.0.1 and a free port, that records every request path.

`/short/<anything>` promises 1000 bytes and sends 10, for the "connection ended early" case.
"""

from __future__ import annotations

import http.server
import threading
from pathlib import Path


class LocalMirror:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[str] = []
        requests = self.requests

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(root), **kwargs)

            def do_GET(self):
                requests.append(self.path)
                if self.path.startswith("/short/"):  # promises 1000 bytes, sends 10
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b"\x1f\x8b" + bytes(8))
                    self.close_connection = True
                    return
                super().do_GET()

            def log_message(self, format, *args):  # keep pytest output clean
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def mirror(self, subdir: str) -> str:
        """The base URL of `root/subdir`."""
        return f"http://127.0.0.1:{self.port}/{subdir}/"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
