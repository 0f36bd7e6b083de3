//! The faults a rig sets on a host, as words (`loss 5%`, `delay 20ms jitter 5ms`) and as
//! the commands that set them. A fault stays until the host's faults are cleared; a
//! later fault of the same kind replaces it.

use std::fmt;
use std::time::Duration;

pub use super::nfqueue::DelaySpec;

/// Which processes of a host a signal goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Every process in the host (the rig's own delay programs excepted).
    All,
    /// One process, which must run in the host.
    Pid(u32),
}

/// A fault on one host or its link.
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// The host's cable pulled: its switch port goes down, and its device loses carrier.
    LinkDown,
    /// The cable back in.
    LinkUp,
    /// This percentage of packets dropped at random, each way (nftables `numgen random`).
    Loss(f64),
    /// The link limited to a rate each way (`tc tbf`; tc's units: `100mbit`, `1gbit`).
    Rate(String),
    /// What the host sends held back, and reordered (an NFQUEUE program of the rig's).
    Delay(DelaySpec),
    /// Processes stopped (SIGSTOP: a frozen host).
    Freeze(Target),
    /// Stopped processes continued (SIGCONT).
    Thaw(Target),
    /// Processes killed (SIGKILL).
    Kill(Target),
    /// Every fault of the host removed: link up, no loss, no delay, the rig's rate,
    /// processes continued.
    Clear,
}

/// The usage line of the fault words.
pub const WORDS: &str = "link-down | link-up | loss PCT% | rate RATE | delay TIME [jitter TIME] \
[reorder PCT%] | freeze [PID] | thaw [PID] | kill [PID] | clear";

/// `20ms`, `1.5s`, `300us`, as a duration.
pub fn parse_time(s: &str) -> Result<Duration, String> {
    let at = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (n, unit) = s.split_at(at);
    let n: f64 = n.parse().map_err(|_| format!("{s:?}: a time is a number and a unit (us, ms, s)"))?;
    let scale = match unit {
        "us" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        _ => return Err(format!("{s:?}: a time's unit is us, ms or s")),
    };
    let secs = n * scale;
    if !(0.0..=3600.0).contains(&secs) {
        return Err(format!("{s:?}: at most an hour"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A duration in the words [`parse_time`] reads: `30ms`, `250us`.
fn time(d: Duration) -> String {
    let us = d.as_micros();
    if us % 1000 == 0 {
        format!("{}ms", us / 1000)
    } else {
        format!("{us}us")
    }
}

/// `5%` or `5`, a percentage from 0 to 100.
fn parse_percent(s: &str) -> Result<f64, String> {
    let p: f64 =
        s.strip_suffix('%').unwrap_or(s).parse().map_err(|_| format!("{s:?} is not a percentage"))?;
    if (0.0..=100.0).contains(&p) {
        Ok(p)
    } else {
        Err(format!("{s:?}: a percentage is from 0 to 100"))
    }
}

fn parse_target(rest: &[&str]) -> Result<Target, String> {
    match rest {
        [] => Ok(Target::All),
        [pid] => pid.parse().map(Target::Pid).map_err(|_| format!("{pid:?} is not a process id")),
        _ => Err(format!("one process id at most, got {rest:?}")),
    }
}

impl Fault {
    /// The fault's first word: its kind.
    pub fn name(&self) -> &'static str {
        match self {
            Fault::LinkDown => "link-down",
            Fault::LinkUp => "link-up",
            Fault::Loss(_) => "loss",
            Fault::Rate(_) => "rate",
            Fault::Delay(_) => "delay",
            Fault::Freeze(_) => "freeze",
            Fault::Thaw(_) => "thaw",
            Fault::Kill(_) => "kill",
            Fault::Clear => "clear",
        }
    }

    /// A fault from its words (see [`WORDS`]).
    pub fn parse(words: &[&str]) -> Result<Fault, String> {
        let bad = || format!("{:?}: a fault is one of: {WORDS}", words.join(" "));
        let (first, rest) = words.split_first().ok_or_else(bad)?;
        match (*first, rest) {
            ("link-down", []) | ("link", ["down"]) => Ok(Fault::LinkDown),
            ("link-up", []) | ("link", ["up"]) => Ok(Fault::LinkUp),
            ("loss", [p]) => parse_percent(p).map(Fault::Loss),
            ("rate", [r]) if r.starts_with(|c: char| c.is_ascii_digit()) => Ok(Fault::Rate(r.to_string())),
            ("delay", [t, opts @ ..]) => {
                let mut spec = DelaySpec { delay: parse_time(t)?, jitter: Duration::ZERO, reorder: 0.0 };
                for pair in opts.chunks(2) {
                    match pair {
                        ["jitter", j] => spec.jitter = parse_time(j)?,
                        ["reorder", p] => spec.reorder = parse_percent(p)?,
                        _ => return Err(bad()),
                    }
                }
                Ok(Fault::Delay(spec))
            }
            ("freeze", rest) => parse_target(rest).map(Fault::Freeze),
            ("thaw", rest) => parse_target(rest).map(Fault::Thaw),
            ("kill", rest) => parse_target(rest).map(Fault::Kill),
            ("clear", []) => Ok(Fault::Clear),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.name();
        let target = |t: &Target| match t {
            Target::All => String::new(),
            Target::Pid(p) => format!(" {p}"),
        };
        match self {
            Fault::LinkDown | Fault::LinkUp | Fault::Clear => write!(f, "{name}"),
            Fault::Loss(p) => write!(f, "{name} {p}%"),
            Fault::Rate(r) => write!(f, "{name} {r}"),
            Fault::Delay(d) => {
                write!(f, "{name} {}", time(d.delay))?;
                if !d.jitter.is_zero() {
                    write!(f, " jitter {}", time(d.jitter))?;
                }
                if d.reorder > 0.0 {
                    write!(f, " reorder {}%", d.reorder)?;
                }
                Ok(())
            }
            Fault::Freeze(t) | Fault::Thaw(t) | Fault::Kill(t) => write!(f, "{name}{}", target(t)),
        }
    }
}

/// Where a host's faults are set: its namespace and device, and its switch port.
pub(crate) struct Place<'a> {
    pub(crate) ns: &'a str,
    pub(crate) dev: &'a str,
    pub(crate) switch: &'a str,
    pub(crate) port: &'a str,
}

/// A command to run, and whether its failure is expected (removing what may not be
/// there).
pub(crate) type Cmd = (Vec<String>, bool);

/// The prefix of the nftables tables of the rig's loss rules, one per host (`ucxkit_h0`,
/// ...), in the switch: packets are lost in the network, not refused by the sending
/// host's stack (which a local rule would make an error of the sender's call).
const TABLE: &str = "ucxkit_";
/// The NFQUEUE queue of a host's delay program.
pub(crate) const QUEUE: u16 = 0;

fn cmd(words: &[&str], may_fail: bool) -> Cmd {
    (words.iter().map(|w| w.to_string()).collect(), may_fail)
}

/// `tc tbf` on one end of a link: what leaves it goes at most at `rate`.
fn tbf(ns: &str, dev: &str, rate: &str) -> Cmd {
    cmd(
        &[
            "tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "512kb",
            "latency", "50ms",
        ],
        false,
    )
}

/// The commands that set `fault` at `p` (`base_rate`: the rate the rig's links were
/// made with, which clearing restores). Signals and the delay program are not commands:
/// the rig sends and starts those itself.
pub(crate) fn commands(fault: &Fault, p: &Place<'_>, base_rate: Option<&str>) -> Vec<Cmd> {
    let table = format!("{TABLE}{}", p.port);
    let drop_loss = cmd(&["ip", "netns", "exec", p.switch, "nft", "delete", "table", "bridge", &table], true);
    let drop_queue = cmd(&["ip", "netns", "exec", p.ns, "iptables", "-F", "OUTPUT"], true);
    match fault {
        Fault::LinkDown => vec![cmd(&["ip", "-n", p.switch, "link", "set", p.port, "down"], false)],
        Fault::LinkUp => vec![cmd(&["ip", "-n", p.switch, "link", "set", p.port, "up"], false)],
        Fault::Loss(pct) => {
            // In ten-thousandths, so that fractions of a percent count; each way.
            let n = (pct * 100.0).round() as u32;
            let lose = |dir: &str| format!("{dir} \"{}\" numgen random mod 10000 < {n} drop", p.port);
            let rules = format!(
                "table bridge {table} {{ chain forward {{ type filter hook forward priority 0; {}; {}; }}; }}",
                lose("iifname"),
                lose("oifname")
            );
            vec![drop_loss, cmd(&["ip", "netns", "exec", p.switch, "nft", &rules], false)]
        }
        Fault::Rate(r) => vec![tbf(p.ns, p.dev, r), tbf(p.switch, p.port, r)],
        Fault::Delay(_) => {
            let q = QUEUE.to_string();
            let rule = ["-A", "OUTPUT", "-o", p.dev, "-j", "NFQUEUE", "--queue-num", &q, "--queue-bypass"];
            let mut add = vec!["ip", "netns", "exec", p.ns, "iptables"];
            add.extend(rule);
            vec![drop_queue, cmd(&add, false)]
        }
        Fault::Freeze(_) | Fault::Thaw(_) | Fault::Kill(_) => Vec::new(),
        Fault::Clear => {
            let mut all = vec![drop_loss, drop_queue];
            match base_rate {
                Some(r) => all.extend([tbf(p.ns, p.dev, r), tbf(p.switch, p.port, r)]),
                None => all.extend([
                    cmd(&["tc", "-n", p.ns, "qdisc", "del", "dev", p.dev, "root"], true),
                    cmd(&["tc", "-n", p.switch, "qdisc", "del", "dev", p.port, "root"], true),
                ]),
            }
            all.push(cmd(&["ip", "-n", p.switch, "link", "set", p.port, "up"], false));
            all
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_from_words_and_print_back() {
        let ms = Duration::from_millis;
        let table: &[(&str, Option<Fault>)] = &[
            ("link-down", Some(Fault::LinkDown)),
            ("link down", Some(Fault::LinkDown)),
            ("link up", Some(Fault::LinkUp)),
            ("loss 5%", Some(Fault::Loss(5.0))),
            ("loss 0.5", Some(Fault::Loss(0.5))),
            ("rate 100mbit", Some(Fault::Rate("100mbit".into()))),
            ("delay 20ms", Some(Fault::Delay(DelaySpec { delay: ms(20), jitter: ms(0), reorder: 0.0 }))),
            (
                "delay 1s jitter 5ms reorder 10%",
                Some(Fault::Delay(DelaySpec { delay: ms(1000), jitter: ms(5), reorder: 10.0 })),
            ),
            ("freeze", Some(Fault::Freeze(Target::All))),
            ("thaw 42", Some(Fault::Thaw(Target::Pid(42)))),
            ("kill 7", Some(Fault::Kill(Target::Pid(7)))),
            ("clear", Some(Fault::Clear)),
            ("", None),
            ("loss 101%", None),
            ("loss -1", None),
            ("rate fast", None),
            ("delay", None),
            ("delay 20", None),
            ("delay 20ms jitter", None),
            ("delay 20ms wobble 5ms", None),
            ("delay 2h", None),
            ("kill 1 2", None),
            ("kill me", None),
            ("clear now", None),
        ];
        for (words, want) in table {
            let w: Vec<&str> = words.split_whitespace().collect();
            let got = Fault::parse(&w);
            assert_eq!(got.as_ref().ok(), want.as_ref(), "{words:?}: {got:?}");
            if let Some(f) = want {
                let again: Vec<String> = f.to_string().split_whitespace().map(str::to_string).collect();
                let again: Vec<&str> = again.iter().map(String::as_str).collect();
                assert_eq!(Fault::parse(&again).as_ref(), Ok(f), "{f}");
            }
        }
    }

    #[test]
    fn each_fault_has_its_commands() {
        let p = Place { ns: "h", dev: "eth0", switch: "sw", port: "h1" };
        let words = |f: &Fault, base| -> Vec<String> {
            commands(f, &p, base).iter().map(|(c, _)| c.join(" ")).collect()
        };
        assert_eq!(words(&Fault::LinkDown, None), ["ip -n sw link set h1 down"]);
        let loss = words(&Fault::Loss(2.5), None);
        assert!(loss[0].ends_with("sw nft delete table bridge ucxkit_h1"), "{loss:?}");
        assert!(loss[1].contains("oifname \"h1\" numgen random mod 10000 < 250 drop"), "{loss:?}");
        assert!(loss[1].contains("iifname \"h1\" numgen random mod 10000 < 250 drop"), "{loss:?}");
        let rate = words(&Fault::Rate("10mbit".into()), None);
        assert!(rate[0].starts_with("tc -n h qdisc replace dev eth0 root tbf rate 10mbit"));
        assert!(rate[1].starts_with("tc -n sw qdisc replace dev h1 root tbf rate 10mbit"));
        let delay = words(&delay_1ms(), None);
        assert!(delay[1].ends_with("iptables -A OUTPUT -o eth0 -j NFQUEUE --queue-num 0 --queue-bypass"));
        assert!(words(&Fault::Kill(Target::All), None).is_empty());
        let clear = words(&Fault::Clear, None);
        assert!(
            clear.iter().any(|c| c.contains("qdisc del dev eth0"))
                && clear.last().unwrap().ends_with("h1 up")
        );
        let clear = words(&Fault::Clear, Some("1gbit"));
        assert!(clear.iter().any(|c| c.contains("replace dev h1 root tbf rate 1gbit")), "{clear:?}");
        // Only removals may fail.
        for f in [Fault::Clear, Fault::Loss(1.0), delay_1ms()] {
            for (c, may_fail) in commands(&f, &p, None) {
                let removal = c.iter().any(|w| w == "delete" || w == "del" || w == "-F");
                assert_eq!(may_fail, removal, "{c:?}");
            }
        }
    }

    fn delay_1ms() -> Fault {
        Fault::Delay(DelaySpec { delay: Duration::from_millis(1), jitter: Duration::ZERO, reorder: 0.0 })
    }
}
