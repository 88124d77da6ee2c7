"""256 forwards open at once on one connection (to a server in the box): all
open; the 257th is refused at once; another connection's command runs
meanwhile (the box's agent, carrying them, keeps room for it).
Usage: HOST PORT KEY USER."""
import sys
import time

import paramiko

host, port, key, user = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


def connect():
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    client.connect(host, port=port, username=user, key_filename=key, look_for_keys=False, allow_agent=False, timeout=30)
    return client


first = connect()
_, out, _ = first.exec_command("httpd -p 127.0.0.1:8080 -h /tmp; echo started")
assert out.read() == b"started\n"
transport = first.get_transport()
held = []
for i in range(256):
    held.append(transport.open_channel("direct-tcpip", ("127.0.0.1", 8080), ("127.0.0.1", 5000 + i), timeout=15))
started = time.monotonic()
try:
    transport.open_channel("direct-tcpip", ("127.0.0.1", 8080), ("127.0.0.1", 4999), timeout=15)
    raise AssertionError("a 257th forward opened on one connection")
except paramiko.ChannelException:
    pass
assert time.monotonic() - started < 5, "the 257th forward was not refused at once"
second = connect()
_, out, _ = second.exec_command("echo alive", timeout=15)
assert out.read() == b"alive\n", "no command beside 256 forwards"
second.close()
for chan in held:
    chan.close()
first.close()
print("256 forwards held, the next refused, the box still answers")
