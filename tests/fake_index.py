"""A package index on loopback (PEP 503's simple pages) for the built-in model's download: real pip
against wheels we make, an index that does not know the project, or one that holds every request
until told to answer (a slow registry, for what a server does while its model loads)."""
from __future__ import annotations

import hashlib
import io
import os
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOLD_LIMIT_S = 60.0  # a held request answers by then even if no test releases it


def make_wheel(project: str, version: str, files: dict[str, bytes]) -> tuple[str, bytes]:
    """A minimal pure-Python wheel holding `files`: its file name and bytes."""
    dist = f"{project.replace('-', '_')}-{version}"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                "Tag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return f"{dist}-py3-none-any.whl", buf.getvalue()


class FakeIndex:
    def __init__(self, projects: dict[str, list[tuple[str, bytes]]] | None = None, hold: bool = False) -> None:
        self.projects = projects or {}
        self.released = threading.Event()
        if not hold:
            self.released.set()
        self.requests = 0
        index = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                index.requests += 1
                index.released.wait(HOLD_LIMIT_S)
                status, body = index.answer(self.path)
                self.send_response(status)
                self.send_header("Content-Type", "text/html" if self.path.startswith("/simple") else
                                 "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str) -> tuple[int, bytes]:
        parts = [p for p in path.split("/") if p]
        if len(parts) == 2 and parts[0] == "simple" and parts[1] in self.projects:
            links = "".join(f'<a href="/files/{name}#sha256={hashlib.sha256(data).hexdigest()}">{name}</a>'
                            for name, data in self.projects[parts[1]])
            return 200, f"<html><body>{links}</body></html>".encode()
        if len(parts) == 2 and parts[0] == "files":
            for name, data in (w for wheels in self.projects.values() for w in wheels):
                if name == parts[1]:
                    return 200, data
        return 404, b"not found"

    def pip_env(self) -> dict[str, str]:
        """Environment variables that point pip at this index alone: no config files and no local
        wheel folders (they would answer first), no retries, no cache."""
        return dict(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=self.url, PIP_EXTRA_INDEX_URL="", PIP_FIND_LINKS="",
                    PIP_RETRIES="0", PIP_DEFAULT_TIMEOUT="90", PIP_NO_CACHE_DIR="1", PIP_NO_INPUT="1")

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
