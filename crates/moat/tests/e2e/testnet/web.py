"""The test internet's web servers on argv[1]: HTTP on 80 and HTTPS on 443
(certificate argv[2], key argv[3]); a UDP sink on 9999 logs datagrams to
argv[4], and so do ICMP echo requests. By Host: github.com serves the bare repositories under argv[5]/git
(git http-backend, pushes enabled, so that only the gateway can stop one);
pypi.org is a package index (PEP 503) of the files in argv[5]/pypi;
registry.npmjs.org an npm registry of the tarballs in argv[5]/npm;
index.crates.io a sparse cargo index of the .crate files in argv[5]/crates,
which static.crates.io serves; any other host answers with what it received (method, path, Host, body size).
llm.test stands in for an LLM API: /echo answers with the request's headers
and a usage object, /gzip the same gzip-compressed whatever was asked, /stream
as server-sent events. Every request is appended to argv[5]/received.log,
with the address and port it came from (a connection's requests share one)."""
import base64, gzip, hashlib, http.server, json, os, socket, ssl, subprocess, sys, threading, time

addr, cert, key, udp_log, data = sys.argv[1:6]

def is_package_file(name):
    return not name.endswith((".published", ".served", ".broken", ".down", ".slow"))

def normal(name):
    return "-".join(p for p in name.lower().replace("_", "-").replace(".", "-").split("-") if p)

def sha256_of(registry, name):
    with open(os.path.join(data, registry, name), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()

def published(registry, name):
    path = os.path.join(data, registry, name + ".published")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    return "2020-01-01T00:00:00Z"

def served(registry, name):
    path = os.path.join(data, registry, name)
    if os.path.exists(path + ".served"):
        path += ".served"
    with open(path, "rb") as f:
        return f.read()

class Server(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def reply(self, status, body, headers=()):
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def answer(self):
        host = (self.headers.get("Host") or "").split(":")[0]
        body = self.body()
        with open(os.path.join(data, "received.log"), "a") as log:
            peer = "%s:%s" % self.client_address[:2]
            log.write(f"{self.command} {host} {self.path}\n{self.headers}{body.decode('latin-1')}\npeer {peer}\n----\n")
        if host == "llm.test":
            return self.llm(body)
        if host == "github.com":
            return self.git(body)
        if host == "pypi.org":
            return self.pypi()
        if host == "registry.npmjs.org":
            return self.npm()
        if host == "index.crates.io":
            return self.crates_index()
        if host == "static.crates.io":
            return self.crates_download()
        text = f"{self.command} {self.path} host={self.headers.get('Host')} body={len(body)}\n".encode()
        if self.path.startswith("/big/"):
            text = b"x" * int(self.path[5:])
        self.reply(200, text)

    def git(self, body):
        path, _, query = self.path.partition("?")
        env = dict(os.environ, GIT_PROJECT_ROOT=os.path.join(data, "git"), GIT_HTTP_EXPORT_ALL="1",
                   PATH_INFO=path, QUERY_STRING=query, REQUEST_METHOD=self.command, REMOTE_USER="test",
                   REMOTE_ADDR="203.0.113.1", CONTENT_TYPE=self.headers.get("Content-Type") or "",
                   CONTENT_LENGTH=str(len(body)), GIT_PROTOCOL=self.headers.get("Git-Protocol") or "",
                   HTTP_CONTENT_ENCODING=self.headers.get("Content-Encoding") or "")
        out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True).stdout
        head, _, content = out.partition(b"\r\n\r\n")
        status, headers = 200, []
        for line in head.decode().split("\r\n"):
            name, _, value = line.partition(": ")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                headers.append((name, value))
        self.reply(status, content, headers)

    def llm(self, body):
        usage = {"input_tokens": 10, "output_tokens": 5}
        echo = json.dumps({"headers": dict(self.headers), "path": self.path, "body": body.decode("latin-1"),
                           "usage": usage}).encode()
        if self.path.startswith("/gzip"):
            return self.reply(200, gzip.compress(echo), [("Content-Type", "application/json"), ("Content-Encoding", "gzip")])
        if self.path.startswith("/stream"):
            events = [
                {"type": "message_start", "message": {"usage": {"input_tokens": 10, "output_tokens": 1}}},
                {"type": "content_block_delta", "delta": {"text": dict(self.headers).get("Authorization", "")}},
                {"type": "message_delta", "usage": {"output_tokens": 5}},
            ]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for e in events:
                chunk = f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.reply(200, echo, [("Content-Type", "application/json"), ("X-Echo-Auth", self.headers.get("Authorization") or "")])

    def pypi(self):
        # PEP 691 JSON (hashes, upload times) when asked for, else PEP 503
        # HTML (hashes in the links). Beside a file, FILE.published holds its
        # upload time (default: long ago), FILE.served other bytes to serve
        # than those the index hashes (a tampered mirror), FILE.slow that it
        # goes at 1 MiB/s, NAME.broken an index page to answer instead, and
        # NAME.down a 503 (the index down).
        files = sorted(f for f in os.listdir(os.path.join(data, "pypi")) if is_package_file(f))
        parts = [p for p in self.path.split("/") if p]
        if parts[:1] == ["simple"] and len(parts) == 2:
            if os.path.exists(os.path.join(data, "pypi", parts[1] + ".down")):
                return self.reply(503, b"down\n")
            broken = os.path.join(data, "pypi", parts[1] + ".broken")
            if os.path.exists(broken):
                with open(broken, "rb") as f:
                    return self.reply(200, f.read(), [("Content-Type", "application/vnd.pypi.simple.v1+json")])
            mine = [f for f in files if normal(f.split("-")[0]) == normal(parts[1])]
            if "application/vnd.pypi.simple.v1+json" in (self.headers.get("Accept") or ""):
                page = {"meta": {"api-version": "1.1"}, "name": parts[1], "files": [
                    {"filename": f, "url": f"/files/{f}", "hashes": {"sha256": sha256_of("pypi", f)},
                     "upload-time": published("pypi", f)} for f in mine]}
                return self.reply(200, json.dumps(page).encode(), [("Content-Type", "application/vnd.pypi.simple.v1+json")])
            links = "".join(f'<a href="/files/{f}#sha256={sha256_of("pypi", f)}">{f}</a>\n' for f in mine)
            return self.reply(200, f"<html><body>\n{links}</body></html>\n".encode(), [("Content-Type", "text/html")])
        if parts[:1] == ["files"] and len(parts) == 2 and parts[1] in files:
            body = served("pypi", parts[1])
            if os.path.exists(os.path.join(data, "pypi", parts[1] + ".slow")):
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for at in range(0, len(body), 64 << 10):
                    self.wfile.write(body[at:at + (64 << 10)])
                    time.sleep(1 / 16)
                return
            return self.reply(200, body, [("Content-Type", "application/octet-stream")])
        self.reply(404, b"not found\n")

    def npm(self):
        # A package document per name, listing each version's tarball with
        # the hashes npm checks; the tarballs themselves.
        tarballs = sorted(f for f in os.listdir(os.path.join(data, "npm")) if is_package_file(f))
        parts = [p for p in self.path.split("/") if p]
        if len(parts) == 3 and parts[1] == "-" and parts[2] in tarballs:
            return self.reply(200, served("npm", parts[2]), [("Content-Type", "application/octet-stream")])
        if len(parts) != 1:
            return self.reply(404, b'{"error":"not found"}')
        broken = os.path.join(data, "npm", parts[0] + ".broken")
        if os.path.exists(broken):
            with open(broken, "rb") as f:
                return self.reply(200, f.read(), [("Content-Type", "application/json")])
        name, versions, times = parts[0], {}, {}
        for tarball in tarballs:
            if not tarball.startswith(name + "-"):
                continue
            version = tarball[len(name) + 1:-len(".tgz")]
            with open(os.path.join(data, "npm", tarball), "rb") as f:
                raw = f.read()
            versions[version] = {
                "name": name, "version": version,
                "dist": {"tarball": f"https://registry.npmjs.org/{name}/-/{tarball}",
                         "shasum": hashlib.sha1(raw).hexdigest(),
                         "integrity": "sha512-" + base64.b64encode(hashlib.sha512(raw).digest()).decode()},
            }
            times[version] = published("npm", tarball)
        if not versions:
            return self.reply(404, b'{"error":"not found"}')
        doc = {"name": name, "dist-tags": {"latest": max(versions)}, "versions": versions, "time": times}
        self.reply(200, json.dumps(doc).encode(), [("Content-Type", "application/json")])

    def crates_index(self):
        # config.json names the download host; a crate's file, at the path
        # cargo derives from its name, has a line per version with the
        # sha256 cargo checks.
        if self.path == "/config.json":
            config = {"dl": "https://static.crates.io/crates", "api": "https://crates.io"}
            return self.reply(200, json.dumps(config).encode(), [("Content-Type", "application/json")])
        parts = [p for p in self.path.split("/") if p]
        name = parts[-1] if parts else ""
        prefix = {1: ["1"], 2: ["2"], 3: ["3", name[:1]]}.get(len(name), [name[:2], name[2:4]])
        lines = []
        for file in sorted(f for f in os.listdir(os.path.join(data, "crates")) if is_package_file(f)):
            crate, _, version = file[:-len(".crate")].rpartition("-")
            if crate != name or parts != prefix + [name]:
                continue
            with open(os.path.join(data, "crates", file), "rb") as f:
                cksum = hashlib.sha256(f.read()).hexdigest()
            lines.append(json.dumps({"name": name, "vers": version, "deps": [], "cksum": cksum,
                                     "features": {}, "yanked": False, "pubtime": published("crates", file)}))
        if not lines:
            return self.reply(404, b"not found\n")
        self.reply(200, "".join(line + "\n" for line in lines).encode(), [("Content-Type", "text/plain")])

    def crates_download(self):
        # cargo asks {dl}/NAME/VERSION/download.
        parts = [p for p in self.path.split("/") if p]
        file = f"{parts[1]}-{parts[2]}.crate" if len(parts) == 4 and parts[3] == "download" else ""
        if parts[:1] != ["crates"] or file not in os.listdir(os.path.join(data, "crates")):
            return self.reply(404, b"not found\n")
        self.reply(200, served("crates", file), [("Content-Type", "application/x-tar")])

    do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = answer

    def log_message(self, *args):
        pass

def serve(port, tls):
    server = http.server.ThreadingHTTPServer((addr, port), Server)
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    server.serve_forever()

def sink():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((addr, 9999))
    log = open(udp_log, "a", buffering=1)
    while True:
        data, peer = s.recvfrom(4096)
        log.write(f"{peer} {data!r}\n")

def pings():
    # Echo requests the namespace gets, from anywhere (nothing of the test
    # internet pings): logged beside the datagrams.
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    log = open(udp_log, "a", buffering=1)
    while True:
        packet, peer = s.recvfrom(4096)
        icmp = packet[(packet[0] & 0xf) * 4:]
        if icmp[:1] == b"\x08":
            log.write(f"icmp echo-request {peer} {icmp[8:]!r}\n")

threading.Thread(target=serve, args=(80, False), daemon=True).start()
threading.Thread(target=sink, daemon=True).start()
threading.Thread(target=pings, daemon=True).start()
serve(443, True)
