"""A signal or a terminal's resize sent after stdin the program has not read
reaches the program at once, as under sshd (which keeps such stdin in the
channel's buffer and handles requests as they come): asyncssh writes 1 MiB
to `sleep 600`, which reads none, then sends TERM: the process ends by it
within 10 s. Then, on a terminal in raw mode whose program reads nothing,
1 MiB of input and a resize: the program's WINCH trap prints the new size.
(The box's agent wrote stdin inline, so both waited for good behind it.)
Usage: HOST PORT KEY USER."""
import asyncio
import sys

import asyncssh

host, port, key, user = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
MIB = b"x" * (1 << 20)


async def main():
    async with asyncssh.connect(host, port=port, username=user, client_keys=[key], known_hosts=None) as conn:
        process = await conn.create_process("sleep 600", encoding=None)
        process.stdin.write(MIB)
        await asyncio.sleep(0.5)
        process.send_signal("TERM")
        done = await asyncio.wait_for(process.wait(), 10)
        assert done.exit_signal and done.exit_signal[0] == "TERM", (done.exit_status, done.exit_signal)

        trap = "stty raw -echo; echo ready; trap 'stty size; exit 3' WINCH; while :; do sleep 1; done"
        process = await conn.create_process(trap, term_type="xterm", term_size=(80, 24), encoding=None)
        ready = await asyncio.wait_for(process.stdout.readline(), 10)
        assert b"ready" in ready, ready
        process.stdin.write(MIB)
        await asyncio.sleep(0.5)
        process.change_terminal_size(100, 40)
        done = await asyncio.wait_for(process.wait(), 10)
        assert done.exit_status == 3 and b"40 100" in done.stdout, (done.exit_status, done.stdout[-200:])
    print("signals and resizes pass unread stdin")


asyncio.run(main())
