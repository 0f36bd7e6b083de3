//! Finds UCX (pkg-config `ucx` >= 1.13, or `UCX_DIR`, or `UCX_INCLUDE_DIR` + `UCX_LIB_DIR`),
//! generates bindings for `<ucp/api/ucp.h>` and emits `ucx_ge_1_MINOR` cfgs for APIs that
//! newer UCX releases add.

use std::env;
use std::path::{Path, PathBuf};

const MIN_MINOR: u32 = 13;
/// Highest minor version that gets its own `ucx_ge_1_N` cfg name.
const MAX_KNOWN_MINOR: u32 = 30;

const HELP: &str = "UCX development files were not found.\n\
    Install them (Debian/Ubuntu: `apt-get install libucx-dev`), or point the build at a UCX \
    installation with UCX_DIR=/path/to/ucx (containing include/ucp/api/ucp.h and lib/libucp.so), \
    or with UCX_INCLUDE_DIR and UCX_LIB_DIR.";

struct Ucx {
    include_dirs: Vec<PathBuf>,
    lib_dirs: Vec<PathBuf>,
}

fn main() {
    for var in ["UCX_DIR", "UCX_INCLUDE_DIR", "UCX_LIB_DIR", "PKG_CONFIG_PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=wrapper.h");
    for minor in MIN_MINOR..=MAX_KNOWN_MINOR {
        println!("cargo:rustc-check-cfg=cfg(ucx_ge_1_{minor})");
    }

    let ucx = find_ucx().unwrap_or_else(|why| {
        eprintln!("error: {HELP}\n({why})");
        panic!("{HELP} ({why})");
    });

    let version_header = ucx
        .include_dirs
        .iter()
        .map(|d| d.join("ucp/api/ucp_version.h"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{HELP} (ucp/api/ucp_version.h is missing)"));
    let (major, minor) = read_api_version(&version_header);
    if major != 1 || minor < MIN_MINOR {
        panic!(
            "UCX {major}.{minor} found in {}, but ucxkit needs UCX 1.{MIN_MINOR} or newer. {HELP}",
            version_header.display()
        );
    }
    for m in MIN_MINOR..=minor.min(MAX_KNOWN_MINOR) {
        println!("cargo:rustc-cfg=ucx_ge_1_{m}");
    }
    println!("cargo:version_minor={minor}");

    for dir in &ucx.lib_dirs {
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:lib_dir={}", dir.display());
    }
    for lib in ["ucp", "uct", "ucs"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    if let Some(inc) = ucx.include_dirs.first() {
        println!("cargo:include={}", inc.display());
    }
    // For `ucx_sys::INCLUDE_DIRS` and `ucx_sys::LIB_DIRS`.
    for (var, dirs) in [("UCX_SYS_INCLUDE_DIRS", &ucx.include_dirs), ("UCX_SYS_LIB_DIRS", &ucx.lib_dirs)] {
        let joined = env::join_paths(dirs).unwrap_or_else(|e| panic!("UCX directories {dirs:?}: {e}"));
        let joined = joined.into_string().unwrap_or_else(|d| panic!("UCX directory list {d:?} is not UTF-8"));
        println!("cargo:rustc-env={var}={joined}");
    }

    let builder = bindgen::Builder::default()
        .header("wrapper.h")
        .clang_args(ucx.include_dirs.iter().map(|d| format!("-I{}", d.display())))
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .allowlist_function("ucp_.*|ucs_status_string|ucs_cpu_.*|ucs_log_push_handler")
        .allowlist_type("ucp_.*|ucs_.*")
        .allowlist_var("UCP_.*|UCS_.*")
        .derive_default(true)
        .derive_debug(true)
        .prepend_enum_name(false)
        .default_enum_style(bindgen::EnumVariation::NewType { is_bitfield: false, is_global: true })
        .generate_comments(true);
    let bindings =
        builder.generate().unwrap_or_else(|e| panic!("bindgen failed on <ucp/api/ucp.h>: {e}. {HELP}"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings.write_to_file(out.join("bindings.rs")).expect("writing bindings.rs into OUT_DIR");
}

fn find_ucx() -> Result<Ucx, String> {
    if let Ok(dir) = env::var("UCX_DIR") {
        let dir = PathBuf::from(dir);
        let lib = ["lib", "lib64"]
            .iter()
            .map(|l| dir.join(l))
            .find(|l| l.join("libucp.so").exists() || l.join("libucp.so.0").exists())
            .ok_or_else(|| format!("UCX_DIR={} has no lib/libucp.so", dir.display()))?;
        return from_dirs(dir.join("include"), lib);
    }
    if let (Ok(inc), Ok(lib)) = (env::var("UCX_INCLUDE_DIR"), env::var("UCX_LIB_DIR")) {
        return from_dirs(PathBuf::from(inc), PathBuf::from(lib));
    }
    let lib = pkg_config::Config::new()
        .atleast_version(&format!("1.{MIN_MINOR}"))
        .cargo_metadata(false)
        .probe("ucx")
        .map_err(|e| format!("pkg-config: {e}"))?;
    let mut include_dirs = lib.include_paths;
    if include_dirs.is_empty() {
        include_dirs.push(PathBuf::from("/usr/include"));
    }
    Ok(Ucx { include_dirs, lib_dirs: lib.link_paths })
}

fn from_dirs(include: PathBuf, lib: PathBuf) -> Result<Ucx, String> {
    if !include.join("ucp/api/ucp.h").exists() {
        return Err(format!("{} has no ucp/api/ucp.h", include.display()));
    }
    Ok(Ucx { include_dirs: vec![include], lib_dirs: vec![lib] })
}

fn read_api_version(header: &Path) -> (u32, u32) {
    let text =
        std::fs::read_to_string(header).unwrap_or_else(|e| panic!("reading {}: {e}", header.display()));
    let field = |name: &str| -> u32 {
        text.lines()
            .filter_map(|l| l.strip_prefix("#define"))
            .map(str::trim)
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{} does not define {name}", header.display()))
    };
    (field("UCP_API_MAJOR"), field("UCP_API_MINOR"))
}
