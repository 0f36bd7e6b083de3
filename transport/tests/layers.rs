//! The crate's shape, checked: its top-level modules depend one way (no import cycle),
//! and no source file outgrows a reader (about 800 lines).
//!
//! A module's dependencies are the `crate::NAME` paths in its code (comments and
//! `#[cfg(test)] mod tests` left out), `crate::{A, B}` groups included.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 800;

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file without comments and without its unit tests.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines().map(|l| l.find("//").map_or(l, |i| &l[..i])).collect::<Vec<_>>().join("\n")
}

/// The top-level modules named after `crate::` in `code`.
fn named(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident =
        |s: &str| s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<String>();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for part in group[..end].split(',') {
                let name = ident(part.trim());
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out
}

/// The modules on a dependency cycle, one cycle per entry (Tarjan's strongly connected
/// components of more than one module).
fn cycles(deps: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        deps: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> T<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on.insert(v);
            for w in self.deps.get(v).into_iter().flatten() {
                if !self.index.contains_key(w.as_str()) {
                    self.visit(w);
                    let l = self.low[v].min(self.low[w.as_str()]);
                    self.low.insert(v, l);
                } else if self.on.contains(w.as_str()) {
                    let l = self.low[v].min(self.index[w.as_str()]);
                    self.low.insert(v, l);
                }
            }
            if self.low[v] == self.index[v] {
                let mut c = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on.remove(w);
                    c.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if c.len() > 1 {
                    c.sort();
                    self.out.push(c);
                }
            }
        }
    }
    let mut t = T {
        deps,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in deps.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out
}

#[test]
fn modules_depend_one_way_and_files_stay_small() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut long = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        let text = std::fs::read_to_string(f).unwrap();
        if text.lines().count() > MAX_LINES {
            long.push(format!("{} ({} lines)", rel.display(), text.lines().count()));
        }
        if top == "lib" {
            continue;
        }
        let modules: BTreeSet<String> = named(&code(&text))
            .into_iter()
            .filter(|m| *m != top && (src.join(format!("{m}.rs")).exists() || src.join(m).is_dir()))
            .collect();
        deps.entry(top).or_default().extend(modules);
    }
    assert!(deps.len() > 20, "found only {} modules under {}", deps.len(), src.display());
    let found = cycles(&deps);
    assert!(found.is_empty(), "import cycles among transport's modules: {found:?}\n{deps:#?}");
    assert!(long.is_empty(), "source files over {MAX_LINES} lines: {long:?}");
}

/// The checker itself finds a cycle and reads grouped imports.
#[test]
fn the_checker_sees_cycles_and_groups() {
    let deps: BTreeMap<String, BTreeSet<String>> =
        [("a", vec!["b"]), ("b", vec!["c"]), ("c", vec!["a"]), ("d", vec!["a"])]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
            .collect();
    assert_eq!(cycles(&deps), vec![vec!["a".to_string(), "b".into(), "c".into()]]);
    let text = "use crate::{x, y::Z};\n// crate::comment\nfn f() { crate::w::g(); }\n#[cfg(test)]\nmod tests { use crate::t; }";
    assert_eq!(named(&code(text)), ["w", "x", "y"].into_iter().map(String::from).collect());
}
