"""asyncssh re-keys while it sends, as it does after 1 GB (here after 1 MB):
asyncssh sends its KEXINIT and then the packet that set off the re-key; the
server must take that packet (OpenSSH's sshd does), not reset the
connection. 8 MiB each way over a connection that re-keys every MiB, the
bytes checked; then another command on the same connection.
Usage: HOST PORT KEY USER."""
import asyncio
import hashlib
import os
import sys

import asyncssh

host, port, key, user = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


async def main():
    async with asyncssh.connect(host, port=port, username=user, client_keys=[key], known_hosts=None,
                                rekey_bytes=1 << 20) as conn:
        data = os.urandom(8 << 20)
        up = await conn.run("sha256sum", input=data, encoding=None, check=True)
        assert up.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest(), up.stdout
        down = await conn.run("head -c 8388608 /dev/urandom | tee /tmp/down | sha256sum; cat /tmp/down",
                              encoding=None, check=True)
        digest, body = down.stdout[:64].decode(), down.stdout[down.stdout.index(b"\n") + 1:]
        assert (len(body), hashlib.sha256(body).hexdigest()) == (8 << 20, digest)
        again = await conn.run("echo still", check=True)
        assert again.stdout == "still\n", again.stdout
    print("asyncssh re-keys while it sends")


asyncio.run(main())
