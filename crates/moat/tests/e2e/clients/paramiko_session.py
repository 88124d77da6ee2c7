"""paramiko on ONE connection: 100 commands (stdout, stderr, status), an env
request the server refuses, SFTP, then port forwards (direct-tcpip channels) to
a server in the box: sequential, concurrent, a large answer, a closed port.
Usage: HOST PORT KEY USER."""
import hashlib
import os
import sys
import threading
import time

import paramiko

host, port, key, user = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
client = paramiko.SSHClient()
client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
client.connect(host, port=port, username=user, key_filename=key, look_for_keys=False, allow_agent=False, timeout=30)


def run(cmd, environment=None):
    _, out, err = client.exec_command(cmd, timeout=60, environment=environment)
    return out.read().decode(), err.read().decode(), out.channel.recv_exit_status()


for i in range(100):
    got = run(f"echo n{i}; echo e{i} >&2; exit {i % 7}")
    assert got == (f"n{i}\n", f"e{i}\n", i % 7), f"command {i}: {got!r}"
# Refused variables are dropped; the command runs all the same.
got = run("echo ${LC_FOO:-unset} ${NOT_ALLOWED:-unset}", environment={"LC_FOO": "bar", "NOT_ALLOWED": "x"})
assert got == ("bar unset\n", "", 0), f"env: {got!r}"

sftp = client.open_sftp()
sftp.get_channel().settimeout(60)
data = os.urandom(1 << 20)
sftp.mkdir("pm-dir")
with sftp.open("pm-dir/blob", "wb") as f:
    f.write(data)
assert sftp.stat("pm-dir/blob").st_size == len(data)
with sftp.open("pm-dir/blob", "rb") as f:
    assert f.read() == data, "sftp round trip changed the bytes"
assert sftp.listdir("pm-dir") == ["blob"]
sftp.symlink("blob", "pm-dir/link")
assert sftp.readlink("pm-dir/link") == "blob", "symlink's paths were swapped"
sftp.remove("pm-dir/link")
sftp.rename("pm-dir/blob", "pm-dir/blob2")
sftp.remove("pm-dir/blob2")
sftp.rmdir("pm-dir")
sftp.close()

# A server in the box, held by a session of its own on this connection.
big = run("mkdir -p /tmp/pm-www && cd /tmp/pm-www && head -c 8388608 /dev/urandom > big && sha256sum big")[0].split()[0]
server = client.get_transport().open_session()
server.exec_command("cd /tmp/pm-www && exec python3 -m http.server 8123 --bind 127.0.0.1")
transport = client.get_transport()


def get(path, host="127.0.0.1"):
    chan = transport.open_channel("direct-tcpip", (host, 8123), ("127.0.0.1", 50000), timeout=30)
    chan.settimeout(60)
    chan.sendall(f"GET {path} HTTP/1.0\r\nHost: box\r\n\r\n".encode())
    chan.shutdown_write()
    data = b""
    while True:
        piece = chan.recv(65536)
        if not piece:
            break
        data += piece
    chan.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], body


for _ in range(100):
    try:
        get("/")
        break
    except (paramiko.ChannelException, paramiko.SSHException, OSError, EOFError):
        time.sleep(0.1)
for i in range(30):
    status, body = get("/", host="localhost" if i % 2 else "127.0.0.1")
    assert status.endswith(b"200 OK") and b"big" in body, f"forward {i}: {status!r}"
status, body = get("/big")
assert status.endswith(b"200 OK") and hashlib.sha256(body).hexdigest() == big, "an 8 MiB answer changed"
failures = []


def concurrent(i):
    try:
        status, body = get("/")
        assert status.endswith(b"200 OK") and b"big" in body, f"{status!r}"
    except Exception as e:  # noqa: BLE001 - reported below
        failures.append(f"concurrent {i}: {e!r}")


threads = [threading.Thread(target=concurrent, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join(120)
assert not failures, failures
# Nothing listens on 8124: the channel is refused, and the connection lives on.
try:
    transport.open_channel("direct-tcpip", ("127.0.0.1", 8124), ("127.0.0.1", 50000), timeout=30)
    raise AssertionError("a forward to a closed port was opened")
except paramiko.ChannelException:
    pass
assert run("echo still") == ("still\n", "", 0)
server.close()
client.close()
print("paramiko: 100 commands, env, sftp, forwards ok")
