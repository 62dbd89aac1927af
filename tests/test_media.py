"""Image URLs as the server reads them: data: URLs decoded, http(s) fetched only from allowed hosts,
under size limits, every failure a 400 naming the field (server/media.py), over a real HTTP server."""
from __future__ import annotations

import asyncio
import base64
import http.server
import threading

import pytest

from vinoserve.server.errors import APIError
from vinoserve.server.media import MediaPolicy, image_bytes

PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


def _read(url: str, policy: MediaPolicy = MediaPolicy()) -> bytes:
    return asyncio.run(image_bytes(url, policy, "messages.0.content.1"))


def _refused(url: str, policy: MediaPolicy = MediaPolicy()) -> str:
    with pytest.raises(APIError) as e:
        _read(url, policy)
    assert e.value.status == 400 and e.value.param == "messages.0.content.1"
    return e.value.message


def test_data_urls_decode_and_bad_ones_say_why():
    assert _read("data:image/png;base64," + base64.b64encode(PNG).decode()) == PNG
    assert _read("data:;base64," + base64.b64encode(PNG).decode()) == PNG  # no media type: the bytes decide
    assert "base64" in _refused("data:image/png;base64,@@@")
    assert "text/plain" in _refused("data:text/plain;base64,aGk=")
    assert "comma" in _refused("data:image/png;base64")
    assert "data: URL" in _refused("file:///etc/passwd")
    assert "at most 10" in _refused("data:image/png;base64," + base64.b64encode(PNG).decode(),
                                    MediaPolicy(max_image_bytes=10))


@pytest.fixture(scope="module")
def site():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "http://elsewhere.invalid/a.png")
                self.end_headers()
                return
            body = PNG if self.path == "/a.png" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_urls_are_fetched_only_from_allowed_hosts(site):
    assert "--allowed-media-domains" in _refused(f"{site}/a.png")  # none allowed: the default
    assert "127.0.0.1" in _refused(f"{site}/a.png", MediaPolicy(frozenset({"example.com"})))
    allowed = MediaPolicy(frozenset({"127.0.0.1"}))
    assert _read(f"{site}/a.png", allowed) == PNG
    assert "HTTP 404" in _refused(f"{site}/missing.png", allowed)
    assert "HTTP 302" in _refused(f"{site}/moved", allowed)  # a redirect could leave the allowed hosts
    assert "larger than" in _refused(f"{site}/a.png", MediaPolicy(frozenset({"127.0.0.1"}), max_image_bytes=10))


def test_a_domain_allows_its_subdomains_only():
    policy = MediaPolicy(frozenset({"example.com"}))
    assert policy.allows("example.com") and policy.allows("img.Example.com.") and not policy.allows("badexample.com")


def test_a_vision_model_takes_larger_bodies_by_default(tmp_path):
    """Images come as data: URLs: without --max-request-bytes a model with a projector takes 32 MiB."""
    from vinoserve.engine.config import EngineConfig
    from vinoserve.server.cli import IMAGE_REQUEST_BYTES, request_bytes
    from vinoserve.server.limits import Limits

    model = tmp_path / "vlm.gguf"
    model.write_bytes(b"")
    assert request_bytes(None, EngineConfig(model=str(model))) == Limits.max_request_bytes  # no projector beside
    (tmp_path / "mmproj-vlm.gguf").write_bytes(b"")
    assert request_bytes(None, EngineConfig(model=str(model))) == IMAGE_REQUEST_BYTES == 32 * 2**20
    assert request_bytes(1000, EngineConfig(model=str(model))) == 1000  # the flag wins
