"""A local stand-in for the Hugging Face hub's file endpoint, for testing gpulane's
download path where no hub is reachable: it serves `/{org}/{name}/resolve/{revision}/{file}`
the way huggingface.co does for what hf-hub reads (HTTP range requests answered 206 with
`Content-Range`, an `ETag` per file, the commit in `X-Repo-Commit`, 404 for files the
repo does not have). It is not the hub: it checks gpulane's use of hf-hub, not the hub."""

import contextlib
import hashlib
import http.server
import pathlib
import re
import threading

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@contextlib.contextmanager
def local_hub(repos: dict):
    """Serves `repos` ({"org/name": directory}) on 127.0.0.1; yields (endpoint, requests),
    `requests` the list of (path, range header) served, for assertions."""
    requests = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", self.path)
            root = repos.get(m.group(1)) if m else None
            path = pathlib.Path(root, m.group(3)) if root else None
            if path is None or not path.is_file():
                requests.append((self.path, None))
                self.send_error(404)
                return
            data = path.read_bytes()
            rng = self.headers.get("Range")
            requests.append((self.path, rng))
            start, stop = 0, len(data) - 1
            if rng:
                a, b = re.fullmatch(r"bytes=(\d+)-(\d*)", rng).groups()
                start, stop = int(a), min(int(b) if b else stop, stop)
            body = data[start : stop + 1]
            self.send_response(206 if rng else 200)
            self.send_header("ETag", '"%s"' % hashlib.sha256(data).hexdigest())
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Range", f"bytes {start}-{stop}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
