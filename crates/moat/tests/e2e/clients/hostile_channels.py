"""Channel opens no client should send, from paramiko: a direct-streamlocal
with no path, a direct-tcpip to port 70000, x11 and forwarded-streamlocal
from the client side. Each is refused (or ends that connection); the server
then runs a command on a fresh connection. Then requests whose strings are
not UTF-8, each refused alone. Usage: HOST PORT KEY USER."""
import sys

import paramiko


def connect(host, port, key, user):
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    client.connect(host, port=port, username=user, key_filename=key, look_for_keys=False, allow_agent=False)
    return client


def main(host, port, key, user):
    opens = [
        ("direct-streamlocal@openssh.com", None),
        ("direct-tcpip", ("127.0.0.1", 70000)),
        ("x11", None),
        ("forwarded-streamlocal@openssh.com", None),
    ]
    for kind, dest in opens:
        client = connect(host, port, key, user)
        try:
            client.get_transport().open_channel(kind, dest_addr=dest, src_addr=("127.0.0.1", 5000), timeout=10)
            raise AssertionError(f"the server opened {kind} {dest}")
        except (paramiko.ChannelException, paramiko.SSHException, EOFError):
            pass
        finally:
            client.close()
    client = connect(host, port, key, user)
    _, out, _ = client.exec_command("echo alive")
    assert out.read() == b"alive\n", "no command after the hostile opens"
    # After no-more-sessions@openssh.com (as sshd): no session opens.
    transport = client.get_transport()
    transport.global_request("no-more-sessions@openssh.com", wait=True)
    try:
        transport.open_session(timeout=10)
        raise AssertionError("a session opened after no-more-sessions")
    except (paramiko.ChannelException, paramiko.SSHException, EOFError):
        pass
    client.close()
    # Requests whose strings are not UTF-8 are refused alone: the channel
    # and the connection go on (sshd skips them; russh ended the connection).
    client = connect(host, port, key, user)
    transport = client.get_transport()
    for request, fields in [
        ("env", [b"LC_ALL", b"fr\xe9"]),
        ("env", [b"LC_\xff", b"x"]),
        ("pty-req", [b"xt\xff", 80, 24, 0, 0, b"\0"]),
        ("subsystem", [b"sf\xfftp"]),
        ("signal", [b"\xff"]),
    ]:
        channel = transport.open_session(timeout=10)
        m = paramiko.Message()
        m.add_byte(paramiko.common.cMSG_CHANNEL_REQUEST)
        m.add_int(channel.remote_chanid)
        m.add_string(request)
        m.add_boolean(False)
        for field in fields:
            m.add_int(field) if isinstance(field, int) else m.add_string(field)
        transport._send_user_message(m)
        channel.exec_command("echo still")
        assert channel.makefile().read() == b"still\n", f"{request}: the channel ended"
        channel.close()
    client.close()
    print("hostile channel opens refused")


main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
