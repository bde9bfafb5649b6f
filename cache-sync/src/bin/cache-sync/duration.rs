//! Human durations on the command line: `500ms`, `2s`, `1m`, `1h`.

use std::time::Duration;

/// Parses a whole number followed by a unit (`ms`, `s`, `m` or `h`). A bare
/// number is refused: `2` could mean seconds or milliseconds, and guessing
/// wrong makes a probe wait a thousand times too long or too short.
pub(crate) fn parse(arg: &str) -> Result<Duration, String> {
    let arg = arg.trim();
    let split = arg
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{arg:?} has no unit: write e.g. 500ms, 2s, 1m or 1h"))?;
    let (digits, unit) = arg.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{arg:?} is not a duration such as 500ms, 2s, 1m or 1h"))?;
    let per_unit = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => {
            return Err(format!(
                "unknown unit {unit:?} in {arg:?}: use ms, s, m or h"
            ));
        }
    };
    n.checked_mul(per_unit)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{arg:?} is too long"))
}

/// `1.5 s`, `250 ms`: for the table and messages.
pub(crate) fn show(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1_000 {
        format!("{ms} ms")
    } else if ms < 60_000 {
        format!("{:.1} s", d.as_secs_f64())
    } else if ms < 3_600_000 {
        format!("{:.1} min", d.as_secs_f64() / 60.0)
    } else {
        format!("{:.1} h", d.as_secs_f64() / 3600.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse("2").unwrap_err().contains("no unit"));
        assert!(parse("2d").unwrap_err().contains("unknown unit"));
        assert!(parse("ms").is_err());
        assert!(parse("1.5s").is_err());
        assert!(parse("99999999999999999999h").is_err());
    }

    #[test]
    fn shown() {
        assert_eq!(show(Duration::from_millis(250)), "250 ms");
        assert_eq!(show(Duration::from_millis(1500)), "1.5 s");
        assert_eq!(show(Duration::from_secs(90)), "1.5 min");
    }
}
