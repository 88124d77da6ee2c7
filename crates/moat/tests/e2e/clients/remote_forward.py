"""Remote forwards (`ssh -R`, tcpip-forward) from paramiko and asyncssh: the
server picks the port (0 asked), programs in the box reach an echo server on
the client's side through it (sequential and concurrent connections, bytes
both ways), and a cancelled forward's port is closed in the box.
Usage: HOST PORT KEY USER."""
import asyncio
import socket
import sys
import threading
import time

import asyncssh
import paramiko

host, port, key, user = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

# Run in the box: N connections to PORT (C at a time), each sending 256 KiB
# and reading them back; prints "echoed N" or why not.
IN_BOX = r"""
import os, socket, sys, threading
port, n, c = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def one(_):
    data = os.urandom(256 << 10)
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    got = []
    reader = threading.Thread(target=lambda: got.extend(iter(lambda: s.recv(65536), b"")))
    reader.start()
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    reader.join()
    s.close()
    return b"".join(got) == data
from concurrent.futures import ThreadPoolExecutor
with ThreadPoolExecutor(c) as pool:
    ok = sum(pool.map(one, range(n)))
print(f"echoed {ok}")
"""


def in_box_command(port, n, c):
    return f"cat > /tmp/rf.py <<'PY'\n{IN_BOX}PY\npython3 /tmp/rf.py {port} {n} {c}"


def refused_in_box(run, port):
    probe = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)\" 2>&1 | tail -1"
    return "Connection refused" in run(probe)


def echo(chan):
    try:
        while True:
            data = chan.recv(65536)
            if not data:
                break
            chan.sendall(data)
        chan.shutdown_write()
    finally:
        chan.close()


def with_paramiko():
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    client.connect(host, port=port, username=user, key_filename=key, look_for_keys=False, allow_agent=False, timeout=30)
    transport = client.get_transport()

    def run(cmd):
        _, out, err = client.exec_command(cmd, timeout=120)
        return out.read().decode() + err.read().decode()

    def handler(chan, origin, server):
        assert origin[0] == "127.0.0.1", origin
        threading.Thread(target=echo, args=(chan,), daemon=True).start()

    bound = transport.request_port_forward("localhost", 0, handler)
    assert 0 < bound < 65536, bound
    got = run(in_box_command(bound, 20, 1)) + run(in_box_command(bound, 10, 5))
    assert got == "echoed 20\nechoed 10\n", f"paramiko: {got!r}"
    transport.cancel_port_forward("localhost", bound)
    for _ in range(50):
        if refused_in_box(run, bound):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("paramiko: the cancelled port still listens in the box")
    client.close()


async def with_asyncssh():
    async def echo_client(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
        writer.close()

    local = await asyncio.start_server(echo_client, "127.0.0.1", 0)
    local_port = local.sockets[0].getsockname()[1]
    async with asyncssh.connect(host, port=port, username=user, client_keys=[key], known_hosts=None) as conn:
        listener = await conn.forward_remote_port("", 0, "127.0.0.1", local_port)
        bound = listener.get_port()
        assert 0 < bound < 65536, bound
        r = await conn.run(in_box_command(bound, 10, 5))
        assert r.stdout == "echoed 10\n", f"asyncssh: {r.stdout!r} {r.stderr!r}"
        listener.close()
        await listener.wait_closed()
        for _ in range(50):
            r = await conn.run(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {bound}), timeout=5)\" 2>&1 | tail -1")
            if "Connection refused" in r.stdout:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("asyncssh: the closed listener's port still listens in the box")
    local.close()


with_paramiko()
asyncio.run(with_asyncssh())
print("remote forwards: paramiko and asyncssh ok")
