"""Floods that no window bounds, at what does not read, end the connection
early (paramiko, speaking raw messages):
- a client that starts a re-key and never finishes it, then opens session
  channels after `no-more-sessions@openssh.com` (each refused, the refusal
  waiting for the re-key's end: 3.4 KB held for a 24-byte open) is cut off
  within about 64 messages; it held 590 MiB a connection with 172,000;
- 1-byte data alternating with 1-byte extended data at a `log --follow`
  that reads no input (a backlog entry each, ~100 bytes) is cut off by the
  1,025th entry (it was the 4,097th).
A session on another connection then still runs. Usage: HOST PORT KEY BOX."""
import sys
import time

import paramiko
from paramiko.common import (MSG_KEXINIT, cMSG_CHANNEL_DATA, cMSG_CHANNEL_EXTENDED_DATA, cMSG_CHANNEL_OPEN,
                             cMSG_GLOBAL_REQUEST)
from paramiko.message import Message

host, port, key, box = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
pkey = paramiko.Ed25519Key.from_private_key_file(key)


def transport(user):
    t = paramiko.Transport((host, port))
    t.connect(username=user, pkey=pkey)
    return t


def cut_within(t, seconds):
    deadline = time.monotonic() + seconds
    while t.is_active() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not t.is_active()


def send(t, build):
    m = Message()
    build(m)
    try:
        t.packetizer.send_message(m)
    except (OSError, EOFError):
        return False
    return True


# A stalled re-key, and channel opens meanwhile.
t = transport(box)
send(t, lambda m: (m.add_byte(cMSG_GLOBAL_REQUEST), m.add_string("no-more-sessions@openssh.com"), m.add_boolean(False)))
time.sleep(0.3)
t._handler_table = dict(paramiko.Transport._handler_table)
t._handler_table[MSG_KEXINIT] = lambda self, m: None
t._send_kex_init()
time.sleep(0.3)
for i in range(2000):
    opened = lambda m: (m.add_byte(cMSG_CHANNEL_OPEN), m.add_string("session"), m.add_int(i), m.add_int(0),
                        m.add_int(32768))
    if not send(t, opened):
        break
assert cut_within(t, 20), "2,000 channel opens during a stalled re-key, and the connection stays"
t.close()

# Alternating data at a reader that reads none.
t = transport("moat")
chan = t.open_session()
chan.exec_command(f"log {box} --follow")
time.sleep(1)
for i in range(2000):
    if i % 2 == 0:
        data = lambda m: (m.add_byte(cMSG_CHANNEL_DATA), m.add_int(chan.remote_chanid), m.add_string(b"x"))
    else:
        data = lambda m: (m.add_byte(cMSG_CHANNEL_EXTENDED_DATA), m.add_int(chan.remote_chanid), m.add_int(1),
                          m.add_string(b"x"))
    if not send(t, data):
        break
assert cut_within(t, 20), "2,000 backlog entries at a stalled reader, and the connection stays"
t.close()

t = transport(box)
chan = t.open_session()
chan.exec_command("echo still")
assert chan.makefile().read() == b"still\n"
t.close()
print("stalled floods cut off")
