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
  trickle   its blob sends a byte a second (never a stall, never done)
  zeros     three layers, each a gzip of 200 MiB of zeros: 600 MiB from 600 KB
  longname  its layer's first entry is a GNU long name of 400 MiB (400 KB gzipped)

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

TRICKLE = image("trickle", tar_of([("hostile/trickle", b"t" * 4096)]))

def gzip_of(*pieces):
    """A gzip of the pieces: bytes, or (byte, count) for count of that byte."""
    z, out = zlib.compressobj(6, zlib.DEFLATED, 31), []
    for piece in pieces:
        if isinstance(piece, tuple):
            chunk, left = piece[0] * (1 << 20), piece[1]
            while left:
                n = min(left, len(chunk)); out.append(z.compress(chunk[:n])); left -= n
        else:
            out.append(z.compress(piece))
    out.append(z.flush())
    return b"".join(out)

def header(name, size, kind=b"0"):
    info = tarfile.TarInfo(name); info.size = size
    block = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    block[156:157] = kind
    block[148:156] = b"        "
    block[148:155] = ("%06o\0" % sum(block[0:512])).encode()
    return bytes(block)

GZ = "application/vnd.oci.image.layer.v1.tar+gzip"
def layers_image(repo, layers):
    """An image of several gzipped layers (their diff ids unchecked: all zeros)."""
    config = json.dumps({"os": "linux", "architecture": "amd64", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    manifests[repo] = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": blob(config), "size": len(config)},
        "layers": [{"mediaType": GZ, "digest": blob(l), "size": len(l)} for l in layers]}).encode()

ZERO_FILE = 200 << 20
layers_image("zeros", [gzip_of(header(f"zeros{i}", ZERO_FILE), (b"\0", ZERO_FILE), bytes(1024)) for i in range(3)])
LONG = 400 << 20
layers_image("longname", [gzip_of(header("././@LongLink", LONG, b"L"), (b"a", LONG), bytes(-LONG % 512),
                                   header("short", 0), bytes(1024))])

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
            if repo == "trickle" and digest == TRICKLE:
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    time.sleep(2)
                    for i in range(len(data)):
                        self.wfile.write(data[i:i + 1]); self.wfile.flush(); time.sleep(1)
                except OSError:
                    pass
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
