"""asyncssh on ONE connection: 100 sequential and 10 concurrent commands, an env
request the server refuses, SFTP, then port forwards to a server in the box
(sequential, concurrent, a large answer, a closed port, a local listener) and
to a unix socket in the box (direct-streamlocal).
Usage: HOST PORT KEY USER."""
import asyncio
import hashlib
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
            # asyncssh sends SYMLINK's paths in OpenSSH's order only to a
            # server whose banner names OpenSSH (the box's server takes it).
            await sftp.symlink("as-blob", "as-link")
            assert await sftp.readlink("as-link") == "as-blob", "symlink's paths were swapped"
            await sftp.remove("as-link")
            await sftp.remove("as-blob")
        await forwards(conn)
        await socket_forwards(conn)
    print("asyncssh: 100 commands, 10 concurrent, env, sftp, forwards, socket forwards ok")


async def get(conn, path, port=8124):
    return await ask(await conn.open_connection("127.0.0.1", port), path)


async def ask(connection, path):
    reader, writer = connection
    writer.write(f"GET {path} HTTP/1.0\r\nHost: box\r\n\r\n".encode())
    writer.write_eof()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], body


async def forwards(conn):
    r = await conn.run("mkdir -p /tmp/as-www && cd /tmp/as-www && head -c 8388608 /dev/urandom > big && sha256sum big")
    big = r.stdout.split()[0]
    server = await conn.create_process("cd /tmp/as-www && exec python3 -m http.server 8124 --bind 127.0.0.1")
    for _ in range(100):
        try:
            await get(conn, "/")
            break
        except (asyncssh.ChannelOpenError, OSError):
            await asyncio.sleep(0.1)
    for i in range(30):
        status, body = await get(conn, "/")
        assert status.endswith(b"200 OK") and b"big" in body, f"forward {i}: {status!r}"
    status, body = await get(conn, "/big")
    assert status.endswith(b"200 OK") and hashlib.sha256(body).hexdigest() == big, "an 8 MiB answer changed"
    results = await asyncio.gather(*(get(conn, "/") for _ in range(8)))
    assert all(s.endswith(b"200 OK") and b"big" in b for s, b in results), "concurrent forwards"
    # Nothing listens on 8125: the channel is refused, the connection lives on.
    try:
        await conn.open_connection("127.0.0.1", 8125)
        raise AssertionError("a forward to a closed port was opened")
    except asyncssh.ChannelOpenError:
        pass
    # A local listener (ssh -L's way), used by a plain socket.
    listener = await conn.forward_local_port("127.0.0.1", 0, "127.0.0.1", 8124)
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.get_port())
    writer.write(b"GET /big HTTP/1.0\r\nHost: box\r\n\r\n")
    data = await reader.read()
    writer.close()
    assert hashlib.sha256(data.partition(b"\r\n\r\n")[2]).hexdigest() == big, "-L changed an 8 MiB answer"
    listener.close()
    server.terminate()
    server.close()
    r = await conn.run("echo still")
    assert r.stdout == "still\n", r.stdout


async def socket_forwards(conn):
    """direct-streamlocal: the same files from a server on a unix socket."""
    r = await conn.run("rm -f /tmp/as-www.sock; sha256sum /tmp/as-www/big")
    big = r.stdout.split()[0]
    async with conn.start_sftp_client() as sftp:
        await sftp.put(os.path.join(os.path.dirname(os.path.abspath(__file__)), "unix_http_server.py"), "/tmp/as-unix.py")
    server = await conn.create_process("exec python3 /tmp/as-unix.py /tmp/as-www.sock /tmp/as-www")
    for _ in range(100):
        try:
            await ask(await conn.open_unix_connection("/tmp/as-www.sock"), "/")
            break
        except (asyncssh.ChannelOpenError, OSError):
            await asyncio.sleep(0.1)
    status, body = await ask(await conn.open_unix_connection("/tmp/as-www.sock"), "/big")
    assert status.endswith(b"200 OK") and hashlib.sha256(body).hexdigest() == big, "an 8 MiB answer over a socket changed"
    async def get_root():
        return await ask(await conn.open_unix_connection("/tmp/as-www.sock"), "/")

    results = await asyncio.gather(*(get_root() for _ in range(8)))
    assert all(s.endswith(b"200 OK") and b"big" in b for s, b in results), "concurrent socket forwards"
    for missing in ("/tmp/no-such.sock", "relative.sock", "/tmp/as-www"):
        try:
            await conn.open_unix_connection(missing)
            raise AssertionError(f"a forward to {missing} was opened")
        except asyncssh.ChannelOpenError:
            pass
    server.terminate()
    server.close()


asyncio.run(asyncio.wait_for(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]), 150))
