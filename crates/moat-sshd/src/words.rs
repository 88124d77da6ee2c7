//! Splitting a control command line into words, as a POSIX shell would for the
//! simple cases: blanks separate (space, tab, newline: a shell's IFS, not
//! Unicode's other spaces), single and double quotes group, a backslash
//! escapes the next character.

/// What separates words (a shell's default IFS).
const BLANKS: [char; 3] = [' ', '\t', '\n'];

/// Why a line could not be split.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unterminated quote in command")]
pub struct UnterminatedQuote;

/// Splits `line` into words. What follows a bare `--` word is one word,
/// as it was written: a command line for a box's shell (`race web 2 --
/// touch "a b" && ls`), whose quotes and operators are that shell's.
pub fn split(line: &str) -> Result<Vec<String>, UnterminatedQuote> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut quoted = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            c if BLANKS.contains(&c) => {
                if let Some(w) = word.take() {
                    let separator = w == "--" && !quoted;
                    words.push(w);
                    if separator {
                        let rest = chars.as_str().trim_start_matches(BLANKS);
                        if !rest.is_empty() {
                            words.push(rest.to_string());
                        }
                        return Ok(words);
                    }
                }
                quoted = false;
            }
            '\'' => {
                quoted = true;
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => w.push(c),
                        None => return Err(UnterminatedQuote),
                    }
                }
            }
            '"' => {
                quoted = true;
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => w.push(chars.next().ok_or(UnterminatedQuote)?),
                        Some(c) => w.push(c),
                        None => return Err(UnterminatedQuote),
                    }
                }
            }
            '\\' => {
                quoted = true;
                word.get_or_insert_with(String::new).push(chars.next().ok_or(UnterminatedQuote)?);
            }
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(word);
    Ok(words)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn splits_like_a_shell() {
        assert_eq!(split("new  web --image debian").unwrap(), ["new", "web", "--image", "debian"]);
        assert_eq!(split("a 'b c' \"d e\" f\\ g ''").unwrap(), ["a", "b c", "d e", "f g", ""]);
        assert_eq!(split("").unwrap(), Vec::<String>::new());
        assert_eq!(split("'open"), Err(UnterminatedQuote));
        assert_eq!(split("trail\\"), Err(UnterminatedQuote));
        // A no-break space is part of a word, as a shell has it.
        assert_eq!(split("info\u{a0}bb\tx\ny").unwrap(), ["info\u{a0}bb", "x", "y"]);
    }

    #[test]
    fn what_follows_a_bare_separator_is_kept_as_written() {
        let line = "race web 2 --json --  cd /tmp && touch \"a b\" && printf '%s\\n' \"x   y\"";
        assert_eq!(
            split(line).unwrap(),
            ["race", "web", "2", "--json", "--", "cd /tmp && touch \"a b\" && printf '%s\\n' \"x   y\""]
        );
        assert_eq!(split("race web 2 --").unwrap(), ["race", "web", "2", "--"]);
        assert_eq!(split("a '--' b 'c d'").unwrap(), ["a", "--", "b", "c d"]);
        assert_eq!(split("a -- 'open").unwrap(), ["a", "--", "'open"]);
    }
}
