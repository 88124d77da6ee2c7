"""Run in a box's network namespace (from the host): prints every UDP
datagram that reaches port argv[1] there, on IPv6 or on 127.0.0.1, until
"end" arrives on 127.0.0.1 (sent by the test once the guest's frames were
handled), or a minute passes."""
import select, socket, sys
port = int(sys.argv[1])
v6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
v6.bind(('::', port))
v4 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
v4.bind(('127.0.0.1', port))
print('ready', flush=True)
while True:
    ready, _, _ = select.select([v6, v4], [], [], 60)
    if not ready:
        break
    for s in ready:
        data, peer = s.recvfrom(2048)
        if s is v4 and data == b'end':
            v6.setblocking(False)
            try:
                while True:
                    data, peer = v6.recvfrom(2048)
                    print(peer[0], data.decode('latin-1'), flush=True)
            except BlockingIOError:
                sys.exit(0)
        print(peer[0], data.decode('latin-1'), flush=True)
