"""A client that floods requests at a channel whose reader has stopped (its
program is stopped and its input full) is cut off when the channel's
backlog is full (1,024 held), not let to grow the server's memory, and not
later, on an innocent EOF: the connection ends during the flood. A storm of
window changes there is held as its last one, and cut off nothing. Another
connection is served meanwhile.
Usage: HOST PORT KEY USER."""
import sys
import threading
import time

import paramiko

host, port, key, user = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


def connect():
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    client.connect(host, port=port, username=user, key_filename=key, look_for_keys=False, allow_agent=False)
    return client


flooder = connect()
transport = flooder.get_transport()
stopped = transport.open_session()
stopped.exec_command("kill -STOP $$; cat > /dev/null")


def fill():
    try:
        while True:
            stopped.sendall(b"x" * 65536)
    except Exception:
        pass


threading.Thread(target=fill, daemon=True).start()
# The window is used up once sendall blocks: the reader holds the rest back.
time.sleep(3)
for i in range(5000):
    stopped.resize_pty(width=80 + i % 7, height=24)
time.sleep(1)
assert transport.is_active(), "a storm of window changes at a stopped reader ended the connection"
sent = 0
try:
    for i in range(20000):
        stopped.set_environment_variable("LC_FLOOD", str(i))
        sent += 1
except Exception:
    pass
deadline = time.monotonic() + 10
while transport.is_active() and time.monotonic() < deadline:
    time.sleep(0.1)
assert not transport.is_active(), f"{sent} requests at a stopped reader and the connection is still up"
other = connect()
_, out, _ = other.exec_command("echo served")
assert out.read() == b"served\n"
other.close()
print(f"a request flood at a stopped reader ends its connection ({sent} sent)")
