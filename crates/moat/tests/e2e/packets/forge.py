"""Run as root in a VM box's guest: sends, as raw frames on its network
device, what the box's network namespace must let nowhere, then one honest
DNS query (which the gateway logs, so the test knows every frame before it
was handled). argv: the forged query's name, the name queried at loopback,
the honest name, and the port the test listens on in the namespace."""
import os, random, socket, struct, sys
forged, looped, ok, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
# A source port of its own for each packet: one reused would meet the
# connection tracking entry an earlier packet left.
def sport():
    return random.randrange(20000, 60000)
def csum(b):
    b += b'\0' * (len(b) % 2)
    s = sum(struct.unpack('!%dH' % (len(b) // 2), b))
    while s >> 16:
        s = (s & 0xffff) + (s >> 16)
    return ~s & 0xffff
def query(name):
    labels = b''.join(bytes([len(l)]) + l.encode() for l in name.split('.'))
    return struct.pack('!6H', 0x1234, 0x0100, 1, 0, 0, 0) + labels + b'\0' + struct.pack('!2H', 1, 1)
def ip4(src, dst, dport, payload):
    udp = struct.pack('!4H', sport(), dport, 8 + len(payload), 0) + payload
    head = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                       socket.inet_aton(src), socket.inet_aton(dst))
    return 0x0800, head[:10] + struct.pack('!H', csum(head)) + head[12:] + udp
def ip6(src, dst, dport, payload):
    s, d = socket.inet_pton(socket.AF_INET6, src), socket.inet_pton(socket.AF_INET6, dst)
    length = 8 + len(payload)
    udp = struct.pack('!4H', sport(), dport, length, 0) + payload
    c = csum(s + d + struct.pack('!I3xB', length, 17) + udp) or 0xffff
    udp = udp[:6] + struct.pack('!H', c) + udp[8:]
    return 0x86dd, struct.pack('!IHBB', 6 << 28, length, 17, 64) + s + d + udp
def link_local(mac):
    m = bytearray(mac)
    m[0] ^= 2
    return socket.inet_ntop(socket.AF_INET6, b'\xfe\x80' + b'\0' * 6 + bytes(m[:3]) + b'\xff\xfe' + bytes(m[3:]))
dev = sorted(d for d in os.listdir('/sys/class/net') if d != 'lo')[0]
mine = bytes.fromhex(open('/sys/class/net/%s/address' % dev).read().strip().replace(':', ''))
arp = [l.split() for l in open('/proc/net/arp').read().splitlines()[1:]]
router = bytes.fromhex([l[3] for l in arp if l[0] == '169.254.0.1'][0].replace(':', ''))
sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
sock.bind((dev, 0))
def send(to, packet):
    kind, data = packet
    sock.send(to + mine + struct.pack('!H', kind) + data)
me, gw = '198.18.0.1', '169.254.0.1'
# A forged source; loopback as the target (DNS, which the gateway would log
# had it got them); IPv6 to every node on the link and to the router's own
# link-local address; then an honest query, which is.
send(router, ip4('10.1.2.3', gw, 53, query(forged)))
send(router, ip4(me, '127.0.0.1', 53, query(looped)))
send(router, ip4(me, '127.0.0.1', port, b'loopback got through'))
for dst, mac in [('ff02::1', b'\x33\x33\0\0\0\1'), (link_local(router), router)]:
    send(mac, ip6(link_local(mine), dst, port, b'ipv6 got through'))
send(router, ip4(me, gw, 53, query(ok)))
print('sent')
