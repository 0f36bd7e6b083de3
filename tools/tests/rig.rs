//! `ucxkit-rig` as a user runs it: a rig made, used and faulted from separate commands
//! (the delay served by a detached program of its own), then removed with nothing left;
//! a rig whose owner ended removed by the next `up`; `--rxe` on a kernel without
//! soft-RoCE answered in one line with exit code 3; a short soak through faults.

use std::process::{Command, Output};

use ucxkit_testkit::rig::{self, leftovers};

fn rig(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ucxkit-rig")).args(args).output().expect("running ucxkit-rig")
}

/// Runs `ucxkit-rig` with `args`, which must succeed; its stdout.
fn ok(args: &[&str]) -> String {
    let out = rig(args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "ucxkit-rig {args:?}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

/// Removes rig `name` when dropped, so that a failing test leaves nothing.
struct Down(String);

impl Drop for Down {
    fn drop(&mut self) {
        let _ = rig(&["down", "--name", &self.0]);
    }
}

/// Round trips from h0 to 10.214.0.2 with `n` pings: (received, average ms).
fn ping(name: &str, n: &str) -> (u32, f64) {
    let out = rig(&[
        "exec",
        "h0",
        "--name",
        name,
        "--",
        "ping",
        "-c",
        n,
        "-i",
        "0.02",
        "-W",
        "1",
        "-q",
        "10.214.0.2",
    ]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let received = text
        .split(", ")
        .find_map(|p| p.strip_suffix(" received"))
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no ping summary in {text}"));
    let avg = text
        .split(" = ")
        .nth(1)
        .and_then(|r| r.split('/').nth(1))
        .and_then(|a| a.parse().ok())
        .unwrap_or(0.0);
    (received, avg)
}

#[test]
fn a_rig_is_made_faulted_and_removed_by_commands() {
    if let Err(e) = ucxkit_testkit::netns::available() {
        eprintln!("ucxkit-rig: skipped, network namespaces are not available here ({e})");
        return;
    }
    let name = format!("c{}", std::process::id());
    let _down = Down(name.clone());
    let up = ok(&["up", "2", "--name", &name, "--keep", "--json"]);
    let hosts: serde_json::Value = serde_json::from_str(up.trim()).expect("JSON");
    assert_eq!(hosts["hosts"][1]["address"], "10.214.0.2", "{hosts}");
    assert_eq!(ping(&name, "3").0, 3);
    // The delay outlives the command that set it: a program of its own serves it.
    ok(&["fault", "h0", "delay", "25ms", "--name", &name]);
    let (got, avg) = ping(&name, "3");
    assert!(got == 3 && avg >= 25.0, "{got} replies, {avg} ms on average");
    assert!(ok(&["list", "--json"]).lines().any(|l| l.contains(&name) && l.contains("\"delays\":[\"h0\"]")));
    ok(&["fault", "1", "link-down", "--name", &name]);
    assert_eq!(ping(&name, "2").0, 0);
    ok(&["fault", "h1", "clear", "--name", &name]);
    ok(&["fault", "h0", "clear", "--name", &name]);
    let (got, avg) = ping(&name, "3");
    assert!(got == 3 && avg < 10.0, "{got} replies, {avg} ms on average after clearing");
    // Bad words and hosts are refused with the reason, changing nothing.
    for bad in
        [&["fault", "h0", "loss", "200%"][..], &["fault", "h7", "clear"], &["exec", "h0", "--", "true"]]
    {
        let mut args = bad.to_vec();
        args.extend(["--name", "nosuchrig"]);
        let out = rig(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(!out.stderr.is_empty());
    }
    ok(&["fault", "h0", "delay", "5ms", "--name", &name]);
    let down = ok(&["down", "--name", &name]);
    assert!(down.contains("removed"), "{down}");
    assert_eq!(leftovers(&name), Vec::<String>::new());
}

#[test]
fn a_rig_whose_caller_ended_is_removed_by_the_next_up() {
    if ucxkit_testkit::netns::available().is_err() {
        return;
    }
    let name = format!("d{}", std::process::id());
    let _down = Down(name.clone());
    // Made from a shell that then ends: the shell owns it.
    let status = Command::new("sh")
        .args(["-c", &format!("{} up 1 --name {name} >/dev/null", env!("CARGO_BIN_EXE_ucxkit-rig"))])
        .status()
        .unwrap();
    assert!(status.success());
    let next = format!("e{}", std::process::id());
    let _next = Down(next.clone());
    ok(&["up", "1", "--name", &next]);
    assert_eq!(leftovers(&name), Vec::<String>::new(), "the ended shell's rig is gone");
}

#[test]
fn soft_roce_is_run_or_refused_with_its_code() {
    if ucxkit_testkit::netns::available().is_err() {
        return;
    }
    let name = format!("r{}", std::process::id());
    let _down = Down(name.clone());
    match rig::rxe_available() {
        Err(why) => {
            let out = rig(&["up", "2", "--rxe", "--name", &name]);
            let text = String::from_utf8_lossy(&out.stdout);
            assert_eq!(out.status.code(), Some(3), "{text}");
            assert_eq!(text.lines().count(), 1, "{text}");
            assert!(leftovers(&name).is_empty(), "nothing is made");
            eprintln!("soft-RoCE run skipped: {why}");
        }
        Ok(()) => {
            let text = ok(&["up", "2", "--rxe", "--name", &name]);
            assert!(text.contains("tag_lat"), "{text}");
        }
    }
}

/// A short soak: every layer moves data, faults are injected, no byte is corrupt, and
/// the rig goes with the run.
#[test]
fn a_short_soak_moves_checked_data_through_faults() {
    if ucxkit_testkit::netns::available().is_err() {
        return;
    }
    let out = rig(&["soak", "--duration", "12s", "--fault-every", "2s", "--seed", "7", "--json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(text.trim()).expect("one JSON object");
    assert_eq!(r["corrupt_bytes"], 0, "{r}");
    assert_eq!(r["hosts_reported"], 3, "{r}");
    assert!(r["faults_injected"].as_u64().unwrap() >= 3, "{r}");
    for layer in ["p2p", "collectives", "objects"] {
        assert!(r["layers"][layer]["ok"].as_u64().unwrap() > 0, "{layer} moved nothing: {r}");
    }
    // The soak's rig went with it: every rig left has a living owner (or none).
    for name in rig::Rig::names() {
        let Ok(r) = rig::Rig::open(&name) else { continue };
        assert!(!matches!(r.record().owner, Some(o) if !o.alive()), "rig {name} outlived its owner");
    }
}
