"""paramiko on ONE connection: 100 commands (stdout, stderr, status), an env
request the server refuses, then SFTP. Usage: HOST PORT KEY USER."""
import os
import sys

import paramiko

host, port, key, user = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
client = paramiko.SSHClient()
client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
client.connect(host, port=port, username=user, key_filename=key, look_for_keys=False, allow_agent=False, timeout=30)


def run(cmd, environment=None):
    _, out, err = client.exec_command(cmd, timeout=60, environment=environment)
    return out.read().decode(), err.read().decode(), out.channel.recv_exit_status()


for i in range(100):
    got = run(f"echo n{i}; echo e{i} >&2; exit {i % 7}")
    assert got == (f"n{i}\n", f"e{i}\n", i % 7), f"command {i}: {got!r}"
# Refused variables are dropped; the command runs all the same.
got = run("echo ${LC_FOO:-unset} ${NOT_ALLOWED:-unset}", environment={"LC_FOO": "bar", "NOT_ALLOWED": "x"})
assert got == ("bar unset\n", "", 0), f"env: {got!r}"

sftp = client.open_sftp()
sftp.get_channel().settimeout(60)
data = os.urandom(1 << 20)
sftp.mkdir("pm-dir")
with sftp.open("pm-dir/blob", "wb") as f:
    f.write(data)
assert sftp.stat("pm-dir/blob").st_size == len(data)
with sftp.open("pm-dir/blob", "rb") as f:
    assert f.read() == data, "sftp round trip changed the bytes"
assert sftp.listdir("pm-dir") == ["blob"]
sftp.rename("pm-dir/blob", "pm-dir/blob2")
sftp.remove("pm-dir/blob2")
sftp.rmdir("pm-dir")
sftp.close()
client.close()
print("paramiko: 100 commands, env, sftp ok")
