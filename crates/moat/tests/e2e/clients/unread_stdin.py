"""One channel whose program does not read its stdin stalls no other channel
of the connection (as under sshd): paramiko pushes 16 MiB into `sleep 20`
on one channel, from a thread (the push stops when the window the server
gave is used up), and meanwhile runs `echo` on five more channels of the
same connection, each answered within 5 s. Then the sleeper's channel is
closed and the connection still serves a command.
Usage: HOST PORT KEY USER."""
import sys
import threading
import time

import paramiko

host, port, key, user = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
client = paramiko.SSHClient()
client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
client.connect(host, port=port, username=user, key_filename=key, look_for_keys=False, allow_agent=False)
transport = client.get_transport()

sleeper = transport.open_session()
sleeper.exec_command("sleep 20")
pushed = [0]


def push():
    block = b"x" * 65536
    try:
        for _ in range(256):
            sleeper.sendall(block)
            pushed[0] += len(block)
    except Exception:
        pass


threading.Thread(target=push, daemon=True).start()
time.sleep(2)
assert pushed[0] < 16 << 20, f"the server took all {pushed[0]} bytes a program never read"


def echo(word):
    started = time.monotonic()
    channel = transport.open_session(timeout=5)
    channel.settimeout(5)
    channel.exec_command(f"echo {word}")
    out = b""
    while True:
        chunk = channel.recv(4096)
        if not chunk:
            break
        out += chunk
    status = channel.recv_exit_status()
    channel.close()
    assert (out, status) == (word.encode() + b"\n", 0), (out, status)
    return time.monotonic() - started


for i in range(5):
    took = echo(f"beside{i}")
    assert took < 5, f"echo beside an unread channel took {took:.1f} s"
sleeper.close()
assert echo("after") < 5
print(f"unread stdin stalls no other channel (held back {pushed[0] >> 10} KiB)")
