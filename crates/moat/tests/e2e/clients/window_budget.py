"""What one account's stalled channels make the front door hold is bounded.
Four connections of one key run, on 128 channels, a program that reads 4 MiB
(so each channel's window grows to its most, 2 MiB) and then reads nothing;
each is pushed 8 MiB. What the front door then holds for them (the windows
it gave, less the 4 MiB each program read) stays within the account's
budget, 128 MiB, and what the box holds (pipes, the agent's buffers);
without the budget it would be 2 MiB a channel besides. A client flooding
requests (which no window bounds) at a stalled channel, with the budget
spent, is cut off. Meanwhile another
account's upload still gets a full window, and once the connections close,
the first account's does again. Usage: HOST PORT KEY BOX OTHER-KEY OTHER-BOX."""
import asyncio
import sys
import time

import asyncssh
from asyncssh.packet import String

MIB = 1 << 20
CHANNELS = 128
READ = 4 * MIB
PUSHED = 8 * MIB


async def stalled(conns, count):
    """`count` channels over `conns`, each pushed PUSHED bytes; what each was
    given in all, less what its program read, once nothing moves any more."""
    chans = []
    for conn in conns:
        for _ in range(count // len(conns)):
            writer, _, _ = await conn.open_session(f"head -c {READ} >/dev/null; exec sleep 600", encoding=None)
            writer.write(b"x" * PUSHED)
            chans.append(writer.channel)

    def given():
        return [PUSHED - chan.get_write_buffer_size() + chan._send_window - READ for chan in chans]

    last, still_since, deadline = None, time.monotonic(), time.monotonic() + 60
    while time.monotonic() - still_since < 2:
        assert time.monotonic() < deadline, "the channels' windows never settled"
        await asyncio.sleep(0.25)
        now = sum(given())
        if now != last:
            last, still_since = now, time.monotonic()
    return given()


async def main(host, port, key, box, other_key, other_box):
    opts = dict(username=box, client_keys=[key], known_hosts=None)
    conns = [await asyncssh.connect(host, port, **opts) for _ in range(4)]
    given = sorted(await stalled(conns, CHANNELS))
    print(f"{CHANNELS} stalled channels hold {sum(given) // MIB} MiB in all, "
          f"{given[0] // 1024} to {given[-1] // 1024} KiB each")
    # Without the budget: 256 MiB of windows, and what the box holds besides.
    assert sum(given) < 128 * MIB + CHANNELS * 640 * 1024, f"{sum(given) // MIB} MiB held in all"
    # One more channel of the account is held to the floor (and what the box holds).
    conns.append(await asyncssh.connect(host, port, **opts))
    [more] = await stalled(conns[-1:], 1)
    assert more < MIB, f"a channel past the budget was given {more}"
    # Requests wait for the reader in memory no window bounds: past a
    # channel's 64 KiB of them, they come out of the budget; with none left,
    # a client flooding them at a reader that does not read is cut off.
    flooder = conns[-1]
    chan = (await flooder.open_session(f"head -c {READ} >/dev/null; exec sleep 600", encoding=None))[0].channel
    chan.write(b"x" * PUSHED)
    await asyncio.sleep(2)
    for _ in range(40):
        chan._send_request(b"env", String(b"LC_FLOOD"), String(b"v" * 200_000))
    try:
        await asyncio.wait_for(flooder.wait_closed(), 30)
    except asyncio.TimeoutError:
        raise AssertionError("8 MB of requests at a stopped reader, past the budget, and the connection stays") from None
    async with asyncssh.connect(host, port, username=other_box, client_keys=[other_key], known_hosts=None) as other:
        [theirs] = await stalled([other], 1)
        assert theirs >= 2 * MIB, f"another account's channel was given {theirs}"
        await other.run("killall sleep")
    for conn in conns:
        conn.close()
    deadline = time.monotonic() + 20
    async with asyncssh.connect(host, port, **opts) as conn:
        while (again := (await stalled([conn], 1))[0]) < 2 * MIB:
            assert time.monotonic() < deadline, f"a channel was given {again} after every channel closed"
        await conn.run("killall sleep")
    print(f"the budget held: one more channel was given {more // 1024} KiB, another account's "
          f"{theirs // 1024} KiB, and after the close {again // 1024} KiB")


asyncio.run(main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:7]))
