"""A registry that lies, for image pulls' tests: HTTPS on argv[1]:argv[2]
(certificate argv[3], key argv[4]), anonymous, serving one image per
repository, each broken its own way:

  good      a sound image of one plain-tar layer (the control)
  redirect  its blob is a 307 to another host the registry names (other.test), then served
  insecure  its blob is a 302 to plain http
  inward    its blob is a 302 to loop.test (this host's loopback)
  wrong     its blob is not the bytes its digest says
  stall     its blob sends its headers and 100 bytes, then nothing
  endless   its manifest never ends (bytes forever, no length)
  bomb      its layer is a gzip of 1 GiB of zeros (about 1 MiB)
  escape    its layer writes ../../outside

Blobs are kept by digest; manifests by repository. Every request is
appended to argv[5]/hostile.log."""
import gzip, hashlib, http.server, io, json, os, ssl, sys, tarfile, time, zlib

addr, port, cert, key, logdir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
blobs, manifests = {}, {}

def blob(data):
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return digest

def tar_of(files):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        for name, text in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(text), 0o644
            t.addfile(info, io.BytesIO(text))
    return out.getvalue()

def image(repo, layer, media="application/vnd.oci.image.layer.v1.tar", diff=None):
    ld = blob(layer)
    config = json.dumps({"os": "linux", "architecture": "amd64", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": [diff or ld]}}).encode()
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": blob(config), "size": len(config)},
                "layers": [{"mediaType": media, "digest": ld, "size": len(layer)}]}
    manifests[repo] = json.dumps(manifest).encode()
    return ld

layer = tar_of([("hostile/ok", b"a sound layer\n")])
image("good", layer)
REDIRECTED = image("redirect", tar_of([("hostile/redirected", b"from blob storage\n")]))
INSECURE = image("insecure", tar_of([("hostile/insecure", b"x\n")]))
INWARD = image("inward", tar_of([("hostile/inward", b"x\n")]))
honest = tar_of([("hostile/wrong", b"what the digest says\n")])
WRONG = image("wrong", honest)
STALL = image("stall", tar_of([("hostile/stall", b"y" * 4096)]))
manifests["endless"] = b""
z = zlib.compressobj(9, zlib.DEFLATED, 31)
parts, zeros = [], bytes(1 << 20)
header = tarfile.TarInfo("bomb"); header.size = 1 << 30
parts.append(z.compress(header.tobuf()))
for _ in range(1024):
    parts.append(z.compress(zeros))
parts.append(z.flush())
image("bomb", b"".join(parts), media="application/vnd.oci.image.layer.v1.tar+gzip",
      diff="sha256:" + "0" * 64)
raw = io.BytesIO()
with tarfile.open(fileobj=raw, mode="w") as t:
    info = tarfile.TarInfo("placeholder"); info.size = 3
    t.addfile(info, io.BytesIO(b"out"))
escape = bytearray(raw.getvalue())
name = b"../../outside"
escape[0:100] = name + bytes(100 - len(name))
escape[148:156] = b"        "
escape[148:155] = ("%06o\0" % sum(escape[0:512])).encode()
image("escape", bytes(escape))

class Server(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, body, headers=()):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        host = (self.headers.get("Host") or "").split(":")[0]
        with open(os.path.join(logdir, "hostile.log"), "a") as log:
            log.write(f"GET {host} {self.path}\n")
        parts = self.path.split("/")
        if self.path == "/v2/":
            return self.reply(200, b"{}")
        if host == "other.test" and self.path.startswith("/storage/"):
            return self.reply(200, blobs[self.path[len("/storage/"):]])
        if len(parts) == 5 and parts[1] == "v2" and parts[3] == "manifests":
            repo = parts[2]
            if repo == "endless":
                self.send_response(200)
                self.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
                self.end_headers()
                try:
                    while True:
                        self.wfile.write(b" " * 65536)
                except OSError:
                    return
            if repo in manifests:
                return self.reply(200, manifests[repo], [("Content-Type", "application/vnd.oci.image.manifest.v1+json")])
        if len(parts) == 5 and parts[1] == "v2" and parts[3] == "blobs" and parts[4] in blobs:
            repo, digest = parts[2], parts[4]
            data = blobs[digest]
            if repo == "redirect" and digest == REDIRECTED:
                return self.reply(307, b"", [("Location", f"https://other.test:{port}/storage/{digest}")])
            if repo == "insecure" and digest == INSECURE:
                return self.reply(302, b"", [("Location", f"http://other.test/storage/{digest}")])
            if repo == "inward" and digest == INWARD:
                return self.reply(302, b"", [("Location", f"https://loop.test:{port}/storage/{digest}")])
            if repo == "wrong" and digest == WRONG:
                data = bytearray(data); data[600] ^= 1
                return self.reply(200, bytes(data))
            if repo == "stall" and digest == STALL:
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[:100]); self.wfile.flush()
                time.sleep(120)
                return
            return self.reply(200, data)
        self.reply(404, b'{"errors":[{"code":"NAME_UNKNOWN"}]}')

server = http.server.ThreadingHTTPServer((addr, port), Server)
server.daemon_threads = True
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
server.socket = ctx.wrap_socket(server.socket, server_side=True)
print("ready", flush=True)
server.serve_forever()
