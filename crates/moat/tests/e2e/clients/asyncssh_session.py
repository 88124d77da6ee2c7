"""asyncssh on ONE connection: 100 sequential and 10 concurrent commands, an env
request the server refuses, then SFTP. Usage: HOST PORT KEY USER."""
import asyncio
import os
import sys

import asyncssh


async def main(host, port, key, user):
    async with asyncssh.connect(host, port=port, username=user, client_keys=[key], known_hosts=None) as conn:
        for i in range(100):
            r = await conn.run(f"echo n{i}; echo e{i} >&2; exit {i % 7}")
            got = (r.stdout, r.stderr, r.exit_status)
            assert got == (f"n{i}\n", f"e{i}\n", i % 7), f"command {i}: {got!r}"
        r = await conn.run("echo ${LC_FOO:-unset} ${NOT_ALLOWED:-unset}", env={"LC_FOO": "bar", "NOT_ALLOWED": "x"})
        assert (r.stdout, r.exit_status) == ("bar unset\n", 0), f"env: {r.stdout!r} {r.stderr!r}"
        results = await asyncio.gather(*(conn.run(f"echo c{i}") for i in range(10)))
        assert [r.stdout for r in results] == [f"c{i}\n" for i in range(10)], "concurrent commands"
        data = os.urandom(1 << 20)
        async with conn.start_sftp_client() as sftp:
            async with sftp.open("as-blob", "wb") as f:
                await f.write(data)
            async with sftp.open("as-blob", "rb") as f:
                assert await f.read() == data, "sftp round trip changed the bytes"
            assert "as-blob" in await sftp.listdir(".")
            await sftp.remove("as-blob")
    print("asyncssh: 100 commands, 10 concurrent, env, sftp ok")


asyncio.run(asyncio.wait_for(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]), 150))
