//! Property tests of the agent protocol's decoders, which read bytes a box
//! controls (the agent's answers) or that the host sends (the agent's input):
//! random and mutated frames decode, ask for more, or fail cleanly; never a
//! panic, and never a claim to have used more bytes than it was given.

#![allow(missing_docs)]

use moat_agent::protocol::{AgentMsg, ExecRequest, ExitStatus, HostMsg, PtySpec, Run, WinSize};
use proptest::prelude::*;

fn check_host(bytes: &[u8]) {
    if let Ok(Some((msg, used))) = HostMsg::decode(bytes) {
        assert!(used <= bytes.len());
        // What decodes encodes back to the same message.
        let again = HostMsg::decode(&msg.encode()).unwrap().unwrap().0;
        assert_eq!(again, msg);
    }
}

fn check_agent(bytes: &[u8]) {
    if let Ok(Some((msg, used))) = AgentMsg::decode(bytes) {
        assert!(used <= bytes.len());
        let again = AgentMsg::decode(&msg.encode()).unwrap().unwrap().0;
        assert_eq!(again, msg);
    }
}

fn samples() -> Vec<Vec<u8>> {
    vec![
        HostMsg::Exec(ExecRequest {
            run: Run::Command(b"echo hi".to_vec()),
            env: vec![("LANG".into(), "C.UTF-8".into())],
            pty: Some(PtySpec { term: "xterm".into(), size: WinSize { cols: 80, rows: 24 } }),
        })
        .encode(),
        HostMsg::Stdin(vec![1, 2, 3]).encode(),
        HostMsg::Connect { port: 8000 }.encode(),
        HostMsg::Signal(2).encode(),
        AgentMsg::Stdout(b"out".to_vec()).encode(),
        AgentMsg::Exit(ExitStatus::Signal { signo: 9, core_dumped: false }).encode(),
        AgentMsg::Error("no such program".into()).encode(),
        HostMsg::Present { paths: vec!["etc/ssh/ssh_host_rsa_key".into(), "var/lib/systemd/random-seed".into()] }
            .encode(),
        AgentMsg::Present(vec![true, false]).encode(),
        HostMsg::Service { argv: vec!["node".into(), "server.js".into()] }.encode(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        check_host(&bytes);
        check_agent(&bytes);
    }

    #[test]
    fn mutated_frames(which in 0usize..10, pos in 0usize..512, byte in any::<u8>(), op in 0u8..3) {
        let mut bytes = samples()[which].clone();
        let pos = pos % bytes.len();
        match op {
            0 => bytes[pos] = byte,
            1 => bytes.insert(pos, byte),
            _ => bytes.truncate(pos),
        }
        check_host(&bytes);
        check_agent(&bytes);
    }
}
