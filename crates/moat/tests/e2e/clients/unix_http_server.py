"""An HTTP server on a unix socket, for socket forwards (ssh -L to a path).
Usage: SOCKET DIR (serves DIR's files at SOCKET)."""
import http.server
import os
import socketserver
import sys


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class Handler(http.server.SimpleHTTPRequestHandler):
    def address_string(self):
        return "unix"


os.chdir(sys.argv[2])
Server(sys.argv[1], Handler).serve_forever()
