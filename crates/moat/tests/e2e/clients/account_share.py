"""One account's channels, over many connections, stop at its share; the
account's further channels are refused; another account still logs in and
runs a verb meanwhile. Usage: HOST PORT KEY USER OTHER-KEY BOX EXPECTED."""
import asyncio
import sys

import asyncssh


async def main(host, port, key, user, other_key, box, expected):
    opts = dict(username=user, client_keys=[key], known_hosts=None)
    conns, held, refused = [], [], 0
    # 20 connections of 32 channels each (the most a connection may have):
    # 640 asked, more than an account's share.
    for _ in range(20):
        conn = await asyncssh.connect(host, port, **opts)
        conns.append(conn)
        for _ in range(32):
            try:
                chan, _ = await conn.create_session(asyncssh.SSHClientSession, f"log {box} --follow")
                held.append(chan)
            except asyncssh.ChannelOpenError:
                refused += 1
    assert len(held) == expected, f"{len(held)} channels held, {expected} expected ({refused} refused)"
    # Another account is not locked out.
    async with asyncssh.connect(host, port, username=user, client_keys=[other_key], known_hosts=None) as other:
        result = await asyncio.wait_for(other.run("whoami"), 30)
        assert result.exit_status == 0, result.stderr
    for conn in conns:
        conn.close()
    # A command holding a NUL is refused, not run cut short.
    async with asyncssh.connect(host, port, **opts) as conn:
        try:
            result = await conn.run("echo a\0b", check=False)
            assert result.exit_status != 0 and b"ab" not in (result.stdout or "").encode(), result
        except asyncssh.ChannelOpenError:
            pass
    print(f"held {len(held)}, refused {refused}")


asyncio.run(main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:7], int(sys.argv[7])))
