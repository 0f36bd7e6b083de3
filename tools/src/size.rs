//! Message sizes on the command line: plain bytes or a suffix. `K`, `KiB`, `M`, `MiB`,
//! `G`, `GiB` are powers of 1024; `KB`, `MB`, `GB` powers of 1000 (SI).

/// Parses one size such as `8`, `4K`, `64KiB`, `1M`, `1MB` or `16M`.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(format!("{s:?} is not a size (expected e.g. 8, 4K, 1M, 1MB)"));
    }
    let n: usize = num.parse().map_err(|_| format!("{s:?}: number too large"))?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        u => return Err(format!("{s:?}: unknown unit {u:?} (use K, M, G, KiB, MiB, GiB, KB, MB, GB)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("{s:?}: size too large"))
}

/// Parses a comma-separated list of sizes.
pub fn parse_sizes(s: &str) -> Result<Vec<usize>, String> {
    s.split(',').filter(|p| !p.trim().is_empty()).map(parse_size).collect()
}

/// Formats a byte count compactly (`8`, `4K`, `1M`, `1500`).
pub fn format_size(n: usize) -> String {
    for (shift, unit) in [(30, "G"), (20, "M"), (10, "K")] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{}{unit}", n >> shift);
        }
    }
    n.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_sizes("8,4K,64K,1M,16M").unwrap(), vec![8, 4096, 65536, 1 << 20, 16 << 20]);
        assert_eq!(parse_size("1MB").unwrap(), 1_000_000);
        assert_eq!(parse_size("2KiB").unwrap(), 2048);
        assert_eq!(parse_size("0").unwrap(), 0);
        assert_eq!(parse_size(" 3g ").unwrap(), 3 << 30);
        assert!(parse_size("K").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("99999999999999999999999").is_err());
        assert_eq!(format_size(16 << 20), "16M");
        assert_eq!(format_size(1500), "1500");
    }
}
