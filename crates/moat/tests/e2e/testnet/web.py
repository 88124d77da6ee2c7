"""The test internet's web servers on argv[1]: HTTP on 80 and HTTPS on 443
(certificate argv[2], key argv[3]). Each answers with what it received
(method, path, Host) so tests see what arrived; a UDP sink on 9999 logs
datagrams to argv[4]."""
import http.server, socket, ssl, sys, threading

addr, cert, key, udp_log = sys.argv[1:5]

class Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        text = f"{self.command} {self.path} host={self.headers.get('Host')} body={len(body)}\n".encode()
        if self.path.startswith("/big/"):
            text = b"x" * int(self.path[5:])
        self.send_response(200)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(text)

    do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = answer

    def log_message(self, *args):
        pass

def serve(port, tls):
    server = http.server.ThreadingHTTPServer((addr, port), Echo)
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

threading.Thread(target=serve, args=(80, False), daemon=True).start()
threading.Thread(target=sink, daemon=True).start()
serve(443, True)
