"""Clients that stop reading, then leave or close, from paramiko: channels
whose window is full (the client reads nothing) when the client goes away
without a word, or closes them. A box's `yes` and a server in the box that
streams (busybox nc running `yes` per connection, on port 7000) are what
fill them; a server that sends nothing and never closes (nc running `sleep`,
on port 7001) is forwarded to and left too. Afterwards no such process may be
left in the box (its pipes and sockets must close, as under sshd), the box's
agent may hold no more threads than before (one carried each forward to the
silent server, waiting on it for good; not checked where the third argument
after USER is "vm": a microVM guest still keeps about one thread for each
such forward), and the connection that closed more channels than one
connection may hold open must still open one.
Usage: HOST PORT KEY USER [vm]."""
import os
import sys
import time

import paramiko

WINDOW = 32768
# More than the 32 channels a connection may hold open at once.
ROUNDS = 40


def connect(host, port, key, user):
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    client.connect(host, port=port, username=user, key_filename=key, look_for_keys=False, allow_agent=False)
    return client


def stuck_session(transport, marker):
    """A session whose output fills its window: nothing reads it."""
    channel = transport.open_session(window_size=WINDOW, max_packet_size=WINDOW)
    channel.exec_command(f"exec yes {marker}")
    return channel


def stuck_forward(transport, port=7000):
    return transport.open_channel(
        "direct-tcpip", ("127.0.0.1", port), ("127.0.0.1", 5000), window_size=WINDOW, max_packet_size=WINDOW
    )


def run(client, command):
    _, out, _ = client.exec_command(command)
    return out.read().decode()


def agent_threads(client):
    """The threads of the box's agent (PID 1), read from a session: the most
    of three reads, each once the session's own threads are all made (the
    agent makes its pumps and waiter as the command starts: a read at once
    saw 2 to 5)."""
    reads = run(client, "for i in 1 2 3; do sleep 0.1; sed -n 's/^Threads:[[:space:]]*//p' /proc/1/status; done")
    return max(int(n) for n in reads.split())


def main(host, port, key, user, vm):
    client = connect(host, port, key, user)
    run(client, "printf '#!/bin/sh\\nexec yes fwd-marker\\n' > /root/stream.sh && chmod +x /root/stream.sh")
    run(client, "printf '#!/bin/sh\\nexec sleep 1000\\n' > /root/silent.sh && chmod +x /root/silent.sh")
    run(client, "busybox nc -ll -p 7000 -e /root/stream.sh </dev/null >/dev/null 2>&1 &")
    run(client, "busybox nc -ll -p 7001 -e /root/silent.sh </dev/null >/dev/null 2>&1 &")
    time.sleep(0.5)
    threads_before = agent_threads(client)

    # A client that goes away (its process ends: no close, no disconnect
    # message) while its windows are full.
    child = os.fork()
    if child == 0:
        gone = connect(host, port, key, user)
        held = [stuck_session(gone.get_transport(), "gone-marker") for _ in range(4)]
        held += [stuck_forward(gone.get_transport()) for _ in range(4)]
        held += [stuck_forward(gone.get_transport(), 7001) for _ in range(4)]
        time.sleep(1.5)
        os._exit(0)
    os.waitpid(child, 0)

    # A client that closes channels whose windows are full, more of them
    # than one connection may hold.
    transport = client.get_transport()
    for _ in range(ROUNDS):
        channel = stuck_session(transport, "close-marker")
        time.sleep(0.05)
        channel.close()
    for port in [7000, 7001]:
        for _ in range(ROUNDS):
            channel = stuck_forward(transport, port)
            time.sleep(0.05)
            channel.close()
    assert run(client, "echo alive") == "alive\n", "no channel after closing full ones"

    deadline = time.time() + 20
    while True:
        left = run(client, "ps -o args | grep -c -e '^yes [a-z]*-marker' || true").strip()
        if left == "0":
            break
        assert time.time() < deadline, f"{left} processes of abandoned channels still run:\n" + run(client, "ps -o pid,args")
        time.sleep(0.5)
    while not vm and (threads := agent_threads(client)) > threads_before:
        assert time.time() < deadline, f"the agent holds {threads} threads, {threads_before} before the forwards"
        time.sleep(0.5)
    run(client, "killall nc sleep")
    client.close()
    print("abandoned channels freed")


main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:] == ["vm"])
