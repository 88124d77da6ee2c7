"""The test internet's DNS server: NAME=ADDR pairs from argv[3:], NXDOMAIN
for the rest; every query is appended to the log file argv[2]."""
import socket, struct, sys

bind, log_path, records = sys.argv[1], sys.argv[2], dict(a.split("=") for a in sys.argv[3:])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((bind, 53))
log = open(log_path, "a", buffering=1)
while True:
    q, peer = s.recvfrom(4096)
    try:
        i, labels = 12, []
        while q[i]:
            labels.append(q[i + 1:i + 1 + q[i]].decode("ascii", "replace"))
            i += 1 + q[i]
        qtype = struct.unpack("!H", q[i + 1:i + 3])[0]
    except Exception:
        continue
    name = ".".join(labels).lower()
    log.write(f"{name} {qtype}\n")
    question = q[12:i + 5]
    addr = records.get(name)
    if addr is None:
        flags, answers = 0x8183, b""
    elif qtype == 1:
        flags, answers = 0x8180, b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 30, 4) + socket.inet_aton(addr)
    else:
        flags, answers = 0x8180, b""
    count = 1 if answers else 0
    s.sendto(q[:2] + struct.pack("!HHHHH", flags, 1, count, 0, 0) + question + answers, peer)
