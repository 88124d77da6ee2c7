"""paramiko tries its keys in turn on one connection, asking for the
service again before each (as it does): three keys not listed are refused,
the fourth gets in and runs a command. Usage: HOST PORT KEY USER."""
import sys

import paramiko


def main(host, port, key, user):
    transport = paramiko.Transport((host, port))
    transport.start_client(timeout=10)
    transport.auth_timeout = 20
    for _ in range(3):
        try:
            transport.auth_publickey(user, paramiko.ECDSAKey.generate())
            raise AssertionError("a key not listed got in")
        except paramiko.AuthenticationException:
            pass
    transport.auth_publickey(user, paramiko.Ed25519Key.from_private_key_file(key))
    channel = transport.open_session()
    channel.exec_command("echo in")
    assert channel.makefile().read() == b"in\n"
    assert channel.recv_exit_status() == 0
    transport.close()
    print("the fourth key got in")


main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
