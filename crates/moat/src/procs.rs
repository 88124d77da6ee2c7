//! What a box is running, seen from the host: the processes below its PID 1,
//! newest first, for the questions of ask mode.

use std::collections::VecDeque;

/// Most processes looked at.
const MAX_WALK: usize = 4096;
/// Command lines returned, at most.
const SHOWN: usize = 3;
/// Longest command line shown.
const MAX_LINE: usize = 200;

/// The command lines of the newest (highest-numbered) processes below `pid`
/// (not `pid` itself: a box's PID 1 is its agent), oldest of them first.
pub fn newest_descendants(pid: u32) -> Vec<String> {
    let mut found = Vec::new();
    let mut queue = VecDeque::from([pid]);
    while let Some(p) = queue.pop_front() {
        if found.len() >= MAX_WALK {
            break;
        }
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else { continue };
        for task in tasks.flatten() {
            let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for child in children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()) {
                found.push(child);
                queue.push_back(child);
            }
        }
    }
    found.sort_unstable();
    let newest = &found[found.len().saturating_sub(SHOWN)..];
    newest.iter().filter_map(|p| command_line(*p)).collect()
}

fn command_line(pid: u32) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let text: String = String::from_utf8_lossy(&raw)
        .trim_end_matches('\0')
        .chars()
        .map(|c| if c == '\0' || c.is_control() { ' ' } else { c })
        .take(MAX_LINE)
        .collect();
    (!text.is_empty()).then_some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_of_this_process_are_found() {
        let mut child = std::process::Command::new("sleep").arg("5").spawn().expect("sleep");
        // Until the child has exec'd, its command line is ours.
        let mut seen = Vec::new();
        for _ in 0..100 {
            seen = newest_descendants(std::process::id());
            if seen.iter().any(|c| c == "sleep 5") {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(seen.iter().any(|c| c == "sleep 5"), "{seen:?}");
    }
}
