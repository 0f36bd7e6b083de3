//! Emits `ucx_ge_1_N` cfgs for the UCX version ucx-sys was built against (passed along by
//! its build script as `DEP_UCP_VERSION_MINOR`), so that APIs newer than UCX 1.13 are used
//! where the headers have them.

const MIN_MINOR: u32 = 13;
const MAX_KNOWN_MINOR: u32 = 30;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_UCP_VERSION_MINOR");
    for minor in MIN_MINOR..=MAX_KNOWN_MINOR {
        println!("cargo:rustc-check-cfg=cfg(ucx_ge_1_{minor})");
    }
    let minor: u32 =
        std::env::var("DEP_UCP_VERSION_MINOR").ok().and_then(|v| v.parse().ok()).unwrap_or(MIN_MINOR);
    for m in MIN_MINOR..=minor.min(MAX_KNOWN_MINOR) {
        println!("cargo:rustc-cfg=ucx_ge_1_{m}");
    }
}
