//! Secrets at the gateway, the request side. A box granted a secret holds
//! only its placeholder; on a request to the secret's one host (always looked
//! inside), the gateway writes the real value into the secret's one header,
//! replacing whatever the box put there: its placeholder, or a key of its
//! own (so nothing the box sends there goes to another account). Another
//! box's placeholder is refused. Nothing else in the request is touched: a
//! placeholder in the body, the target or another header stays a
//! placeholder. The value is counted against the secret's limits first, and a
//! killed secret is refused outright.

use moat_core::secrets::{same_header, PLACEHOLDER_PREFIX};
use moat_core::BoxId;

use crate::http;
use crate::refusal::Refusal;
use crate::secrets::meter::Armed;

/// Request headers dropped on the way to a host a secret is bound to.
const UNCHECKABLE: [&str; 4] = ["accept-encoding", "te", "range", "if-range"];

/// A request head with the secrets for its host written in.
#[derive(Debug)]
pub struct Rewritten {
    /// The head to send.
    pub head: Vec<u8>,
    /// The secrets written into it (indexes into the slice given).
    pub injected: Vec<usize>,
}

/// Writes `armed` (the box's secrets bound to the request's host) into a
/// request head, for box `box_id`. Also asks for an unencoded response, so
/// that the gateway can check it for the values.
pub fn rewrite(head: &[u8], armed: &[Armed], box_id: &BoxId) -> Result<Rewritten, Refusal> {
    let mut lines = http::request::head_lines(head).ok_or(Refusal::NotText)?;
    let name_of = |line: &str| line.split_once(':').map(|(n, _)| n.to_string());
    // Where each secret goes, every refusal decided before any is counted.
    let mut found = Vec::new();
    for (i, a) in armed.iter().enumerate() {
        let s = &a.secret;
        let at: Vec<(usize, &String)> = (lines.iter().enumerate().skip(1))
            .filter(|(_, line)| name_of(line).is_some_and(|n| same_header(&n, &s.header)))
            .collect();
        let (j, line) = match at[..] {
            [] => continue,
            [one] => one,
            _ => return Err(Refusal::TwoHeaders(s.header.clone())),
        };
        let value = line.split_once(':').map_or("", |(_, v)| v);
        if !value.contains(&s.placeholder) && value.contains(PLACEHOLDER_PREFIX) {
            return Err(Refusal::OthersPlaceholder(s.header.clone()));
        }
        if s.killed {
            return Err(Refusal::SecretKilled(s.name.clone()));
        }
        found.push((i, a, j));
    }
    let mut injected: Vec<usize> = Vec::new();
    for (i, a, j) in found {
        let s = &a.secret;
        if let Err(refusal) = a.meter.admit(box_id, s) {
            for admitted in injected.iter().filter_map(|&k| armed.get(k)) {
                admitted.meter.release(box_id);
            }
            return Err(refusal);
        }
        if let Some(line) = lines.get_mut(j) {
            *line = format!("{}: {}", s.header, s.format.replacen("{}", s.value.expose(), 1));
        }
        injected.push(i);
    }
    // Whatever would make the response harder to check for the values
    // goes: a compressed or transfer-coded body, and a byte range (a value
    // echoed back in slices would pass the scrubber piece by piece).
    lines.retain(|l| !name_of(l).is_some_and(|n| UNCHECKABLE.iter().any(|u| n.eq_ignore_ascii_case(u))));
    lines.push("Accept-Encoding: identity".into());
    Ok(Rewritten { head: http::request::join_head(&lines), injected })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use crate::secrets::meter::tests::{armed, id, MINE};
    use moat_core::secrets::{Limit, LimitKind};

    const THEIRS: &str = "moat-placeholder-00000000000000000000000000000000000000bb";

    fn head(lines: &[&str]) -> Vec<u8> {
        let mut h = lines.join("\r\n");
        h.push_str("\r\n\r\n");
        h.into_bytes()
    }

    fn text(r: &Rewritten) -> String {
        String::from_utf8(r.head.clone()).unwrap()
    }

    #[test]
    fn the_value_goes_into_the_one_header_only() {
        let a = [armed(Vec::new(), false)];
        let req = head(&[
            "POST /v1?key=moat-placeholder-00000000000000000000000000000000000000aa HTTP/1.1",
            "Host: api.example",
            &format!("authorization: Bearer {MINE}"),
            &format!("X-Other: {MINE}"),
            "Accept-Encoding: gzip, br",
        ]);
        let r = rewrite(&req, &a, &id("b1")).unwrap();
        let t = text(&r);
        assert_eq!(r.injected, [0]);
        assert!(t.contains("\r\nAuthorization: Bearer sk-REAL-0123456789\r\n"), "{t}");
        assert_eq!(t.matches("sk-REAL").count(), 1, "{t}");
        assert!(t.contains(&format!("X-Other: {MINE}")) && t.starts_with("POST /v1?key=moat-placeholder-"));
        assert!(t.ends_with("Accept-Encoding: identity\r\n\r\n") && !t.contains("gzip"), "{t}");
    }

    #[test]
    fn own_keys_are_overwritten_and_absent_headers_stay_absent() {
        let a = [armed(Vec::new(), false)];
        let r = rewrite(
            &head(&["GET / HTTP/1.1", "Host: api.example", "Authorization: Bearer sk-ATTACKER"]),
            &a,
            &id("b1"),
        );
        let t = text(&r.unwrap());
        assert!(t.contains("Authorization: Bearer sk-REAL") && !t.contains("ATTACKER"), "{t}");
        let r = rewrite(&head(&["GET / HTTP/1.1", "Host: api.example"]), &a, &id("b1")).unwrap();
        assert!(r.injected.is_empty() && !text(&r).contains("sk-REAL"));
    }

    #[test]
    fn smuggling_and_stolen_placeholders_are_refused() {
        let a = [armed(Vec::new(), false)];
        let twice =
            head(&["GET / HTTP/1.1", "Host: api.example", &format!("Authorization: {MINE}"), "authorization: x"]);
        assert_eq!(rewrite(&twice, &a, &id("b1")).unwrap_err().status(), 400);
        let spelled =
            head(&["GET / HTTP/1.1", "Host: api.example", &format!("Authorization: {MINE}"), "AUTHORIZATION: x"]);
        assert_eq!(rewrite(&spelled, &a, &id("b1")).unwrap_err().status(), 400);
        let stolen = head(&["GET / HTTP/1.1", "Host: api.example", &format!("Authorization: Bearer {THEIRS}")]);
        assert_eq!(rewrite(&stolen, &a, &id("b1")).unwrap_err().status(), 403);
        let killed = [armed(Vec::new(), true)];
        let mine = head(&["GET / HTTP/1.1", "Host: api.example", &format!("Authorization: Bearer {MINE}")]);
        assert_eq!(rewrite(&mine, &killed, &id("b1")).unwrap_err(), Refusal::SecretKilled("llm".into()));
    }

    #[test]
    fn limits_refuse_with_429_and_windows_reset() {
        let a = [armed(vec![Limit::new(LimitKind::Requests, 2, Some(3600)).unwrap()], false)];
        let mine = head(&["GET / HTTP/1.1", "Host: api.example", &format!("Authorization: Bearer {MINE}")]);
        for _ in 0..2 {
            rewrite(&mine, &a, &id("b1")).unwrap();
        }
        let refused = rewrite(&mine, &a, &id("b1")).unwrap_err();
        assert_eq!(refused.status(), 429);
        assert!(refused.to_string().contains("2 requests per 3600 s"), "{refused}");
        // Another box's own limit is its own.
        assert!(rewrite(&mine, &a, &id("b2")).is_ok());
        // Once its window is over, a box may use the secret again.
        let short = [armed(vec![Limit::new(LimitKind::Requests, 1, Some(1)).unwrap()], false)];
        rewrite(&mine, &short, &id("b1")).unwrap();
        assert_eq!(rewrite(&mine, &short, &id("b1")).unwrap_err().status(), 429);
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert!(rewrite(&mine, &short, &id("b1")).is_ok(), "the window did not reset");
    }

    #[test]
    fn header_names_match_as_servers_read_them() {
        assert!(same_header("X_Api_Key", "x-api-key") && same_header("AUTHORIZATION", "Authorization"));
        assert!(!same_header("X-Api-Keys", "x-api-key") && !same_header("X.Api.Key", "x-api-key"));
    }
}
