"""One account's channels, over many connections, stop at its share; the
account's further channels are refused; another account still logs in and
runs a verb meanwhile. The windows its channels were given stop at the
account's window budget (128 MiB; one packet's window each past it),
another account's channel still gets a full window, and once the
connections close the account's do again.
Usage: HOST PORT KEY USER OTHER-KEY BOX EXPECTED."""
import asyncio
import sys
import time

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
    windows = [chan._send_window for chan in held]
    assert sum(windows) <= (128 << 20) + len(held) * (32 << 10), f"windows of {sum(windows) >> 20} MiB in all"
    assert windows[0] == 2 << 20 and windows[-1] == 32 << 10, (windows[0], windows[-1])
    # Another account is not locked out, nor short of window.
    async with asyncssh.connect(host, port, username=user, client_keys=[other_key], known_hosts=None) as other:
        result = await asyncio.wait_for(other.run("whoami"), 30)
        assert result.exit_status == 0, result.stderr
        assert await first_window(other, box) == 2 << 20, "another account's window"
    for conn in conns:
        conn.close()
    # Closed connections give their windows back.
    async with asyncssh.connect(host, port, **opts) as conn:
        deadline = time.monotonic() + 20
        while (window := await first_window(conn, box)) < 2 << 20:
            assert time.monotonic() < deadline, f"a window of {window} after every channel closed"
            await asyncio.sleep(0.2)
    # A command holding a NUL is refused, not run cut short.
    async with asyncssh.connect(host, port, **opts) as conn:
        try:
            result = await conn.run("echo a\0b", check=False)
            assert result.exit_status != 0 and b"ab" not in (result.stdout or "").encode(), result
        except asyncssh.ChannelOpenError:
            pass
    print(f"held {len(held)}, refused {refused}")


async def first_window(conn, box):
    """The window a new channel of `conn` is given."""
    chan, _ = await conn.create_session(asyncssh.SSHClientSession, f"log {box}")
    window = chan._send_window
    chan.close()
    return window


asyncio.run(main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:7], int(sys.argv[7])))
