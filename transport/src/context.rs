//! [`Context`]: one UCX application context (`ucp_context_h`), the parent of workers and
//! memory registrations.

use std::collections::HashSet;
use std::ffi::CString;
use std::sync::{Arc, OnceLock};

use ucx_sys as sys;

use crate::auth::Secret;
use crate::error::{Error, Result, Status};
use crate::ucx_log::printed;

/// UCX features a context enables (`UCP_FEATURE_*`). Tag matching, active messages
/// (used by the connection handshake) and wakeup are always on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features(u64);

impl Features {
    /// Tagged messaging (`UCP_FEATURE_TAG`).
    pub const TAG: Features = Features(sys::UCP_FEATURE_TAG.0 as u64);
    /// Ordered byte streams (`UCP_FEATURE_STREAM`).
    pub const STREAM: Features = Features(sys::UCP_FEATURE_STREAM.0 as u64);
    /// Active messages (`UCP_FEATURE_AM`).
    pub const AM: Features = Features(sys::UCP_FEATURE_AM.0 as u64);
    /// One-sided put/get (`UCP_FEATURE_RMA`).
    pub const RMA: Features = Features(sys::UCP_FEATURE_RMA.0 as u64);
    /// 64-bit remote atomics (`UCP_FEATURE_AMO64`).
    pub const AMO64: Features = Features(sys::UCP_FEATURE_AMO64.0 as u64);
    /// Event-fd wakeup (`UCP_FEATURE_WAKEUP`), needed by the event progress mode.
    pub const WAKEUP: Features = Features(sys::UCP_FEATURE_WAKEUP.0 as u64);
    /// What ucxkit needs for itself.
    const REQUIRED: Features = Features(Self::TAG.0 | Self::AM.0 | Self::WAKEUP.0);

    /// The raw `UCP_FEATURE_*` mask.
    pub fn bits(self) -> u64 {
        self.0
    }
}

impl Default for Features {
    /// Tag, stream, active messages, RMA, 64-bit atomics and wakeup.
    fn default() -> Self {
        Self::TAG | Self::STREAM | Self::AM | Self::RMA | Self::AMO64 | Self::WAKEUP
    }
}

impl std::ops::BitOr for Features {
    type Output = Features;
    fn bitor(self, rhs: Features) -> Features {
        Features(self.0 | rhs.0)
    }
}

/// UCX's setting for indirect wire ids (see [`ContextBuilder::build`]).
const INDIRECT_ID: &str = "PROTO_INDIRECT_ID";

/// Builds a [`Context`]. Obtained from [`Context::builder`].
#[derive(Clone, Debug, Default)]
pub struct ContextBuilder {
    features: Features,
    config: Vec<(String, String)>,
    name: Option<String>,
    secret: Option<Secret>,
}

impl ContextBuilder {
    /// UCX features to enable on top of the ones ucxkit always needs.
    pub fn features(mut self, features: Features) -> Self {
        self.features = features;
        self
    }

    /// Overrides one UCX configuration variable for this context only, without touching
    /// the process environment. `name` is given without the `UCX_` prefix, as in
    /// `ucp_config_modify`: `.config("TLS", "tcp,self")`, `.config("NET_DEVICES", "lo")`.
    /// A name UCX does not know (`ucx_info -c -f` lists them) makes
    /// [`ContextBuilder::build`] fail with [`Error::UnknownSetting`]. Transports' settings
    /// (`TCP_PORT_RANGE`, `POSIX_USE_PROC_LINK`) apply per context from UCX 1.17 on;
    /// older UCX takes them from the environment only, and `build` refuses them.
    pub fn config(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let name = name.into();
        let name = name.strip_prefix("UCX_").map(str::to_owned).unwrap_or(name);
        self.config.push((name, value.into()));
        self
    }

    /// Shorthand for `.config("TLS", transports)`: the UCX transports this context may
    /// use, for example `"posix,self"`, `"sm,self"`, `"tcp,self"` or `"all"`.
    pub fn transports(self, transports: impl Into<String>) -> Self {
        self.config("TLS", transports)
    }

    /// A secret shared with the peers this context may talk to: its workers' listeners
    /// accept only clients that prove they hold it, and connect only to listeners that
    /// do (an HMAC-SHA256 challenge-response both ways, MACs on what follows; see the
    /// threat model in [`crate::front`]). Without one (the default), listeners take any
    /// client that speaks the protocol, and a context with a secret does not talk to one
    /// without.
    pub fn secret(mut self, secret: Secret) -> Self {
        self.secret = Some(secret);
        self
    }

    /// A name UCX shows in its diagnostics.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Creates the context (`ucp_config_read`, `ucp_config_modify`, `ucp_init`).
    ///
    /// UCX's `PROTO_INDIRECT_ID` is always on (the environment's `UCX_PROTO_INDIRECT_ID`
    /// is overridden, and setting it otherwise through [`ContextBuilder::config`] is an
    /// error): by default UCX names an endpoint without peer error handling on the wire by
    /// its address, and a message naming an endpoint closed meanwhile (a rendezvous
    /// message still unmatched, or stream or active-message data in flight when the
    /// endpoint closed) then makes UCX read freed memory when it is matched or arrives;
    /// with indirect ids UCX looks the endpoint up and drops the message, and the receive
    /// that matched it ends with an error.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the UCX library loaded at run time is older than the
    /// headers ucxkit was built against (the calls made for the newer API would not be
    /// honoured: a newer UCX copies an active message's header when asked, an older one
    /// reads it until the send completes), or for a transport's setting (`TCP_SNDBUF`)
    /// with a UCX before 1.17, which applies those from the environment only;
    /// [`Error::Config`] for a setting UCX refuses; [`Error::UnknownSetting`] for a name
    /// it does not know; [`Error::CreateContext`] when `ucp_init` fails.
    pub fn build(self) -> Result<Context> {
        let (major, minor, _) = Context::ucx_version();
        if (major, minor) < (sys::API_MAJOR, sys::API_MINOR) {
            return Err(Error::Unsupported {
                what: format!(
                    "UCX {major}.{minor} loaded at run time, older than the UCX 1.{} headers ucxkit was built \
                     against: rebuild against it, or load the newer library",
                    sys::API_MINOR
                ),
            });
        }
        crate::ucx_log::install();
        let features = self.features | Features::REQUIRED;
        let mut config: *mut sys::ucp_config_t = std::ptr::null_mut();
        // SAFETY: NULL prefix and file name are allowed; `config` is a valid out-pointer.
        let st = Status(unsafe { sys::ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config) });
        st.check().map_err(|source| Error::Config { name: "(read)".into(), value: String::new(), source })?;
        let guard = ConfigGuard(config);
        // Read before any change, where needed below: the settings of UCP's own table.
        let ucp_names = if (major, minor) < (1, 17) { ucp_settings(guard.0) } else { HashSet::new() };
        for (_, v) in self.config.iter().filter(|(n, _)| n.eq_ignore_ascii_case(INDIRECT_ID)) {
            if !["on", "y", "yes", "1"].iter().any(|on| v.eq_ignore_ascii_case(on)) {
                return Err(Error::ApiMisuse(format!(
                    "UCX config {INDIRECT_ID}={v:?}: ucxkit needs it on (see ContextBuilder::build)"
                )));
            }
        }
        let defaults = [(INDIRECT_ID.to_string(), "on".to_string())];
        for (name, value) in defaults.iter().chain(&self.config) {
            let (Ok(n), Ok(v)) = (CString::new(name.as_str()), CString::new(value.as_str())) else {
                return Err(Error::ApiMisuse(format!("UCX config {name:?}={value:?} contains NUL")));
            };
            // SAFETY: config is valid (read above); n and v are NUL-terminated.
            let st = Status(unsafe { sys::ucp_config_modify(guard.0, n.as_ptr(), v.as_ptr()) });
            st.check().map_err(|source| Error::Config {
                name: name.clone(),
                value: value.clone(),
                source,
            })?;
        }
        let name = CString::new(self.name.unwrap_or_else(|| "ucxkit".into()))
            .map_err(|_| Error::ApiMisuse("context name contains NUL".into()))?;
        let params = sys::ucp_params_t {
            field_mask: (sys::UCP_PARAM_FIELD_FEATURES.0
                | sys::UCP_PARAM_FIELD_REQUEST_SIZE.0
                | sys::UCP_PARAM_FIELD_REQUEST_INIT.0
                | sys::UCP_PARAM_FIELD_NAME.0
                | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED.0) as u64,
            features: features.0,
            request_size: crate::slot::SLOT_SIZE,
            request_init: Some(crate::slot::slot_init),
            name: name.as_ptr(),
            mt_workers_shared: 1,
            ..Default::default()
        };
        let mut handle: sys::ucp_context_h = std::ptr::null_mut();
        // SAFETY: params and config are valid for the call; handle is a valid out-pointer.
        let st = Status(unsafe { sys::ucp_init(&params, guard.0, &mut handle) });
        st.check().map_err(Error::CreateContext)?;
        // Owned from here: dropped (ucp_cleanup) on any error below.
        let ctx = Context {
            inner: Arc::new(ContextInner {
                handle,
                features,
                resources: read_resources(handle),
                memory_types: read_memory_types(handle),
                secret: self.secret.clone(),
                own_key: OnceLock::new(),
            }),
        };
        // UCX takes any name (one it does not know it keeps for its transports, which
        // ignore it): a misspelt setting would silently do nothing. Checked now that UCX
        // has loaded its transport modules, whose settings count too.
        if let Some(known) = known_settings() {
            if let Some((name, _)) = self.config.iter().find(|(n, _)| !known.contains(n.as_str())) {
                return Err(Error::UnknownSetting { name: name.clone() });
            }
        }
        // Before 1.17, UCX hands a setting it does not apply itself (a transport's, such as
        // TCP_PORT_RANGE) to the transports under its full name, which they compare
        // without their prefix: it never applies. Refused rather than ignored.
        if (major, minor) < (1, 17) {
            let applied = |n: &str| ucp_names.contains(n) || is_global_setting(n);
            if let Some((name, _)) = self.config.iter().find(|(n, _)| !applied(n)) {
                return Err(Error::Unsupported {
                    what: format!(
                        "UCX {major}.{minor} takes {name} from the environment only (UCX_{name}); \
                         UCX 1.17 and later take it for one context"
                    ),
                });
            }
        }
        tracing::debug!(features = features.0, "UCX context created");
        Ok(ctx)
    }
}

/// The name of every setting UCX knows, without the `UCX_` prefix: those of the core and
/// of every transport module loaded (`ucs_config_parser_print_all_opts`, as `ucx_info -c
/// -f` prints them). Read once, after the first context is made (UCX loads all its
/// modules then, once per process); `None` when they could not be read.
fn known_settings() -> Option<&'static HashSet<String>> {
    static KNOWN: OnceLock<Option<HashSet<String>>> = OnceLock::new();
    KNOWN
        .get_or_init(|| {
            let flags = sys::ucs_config_print_flags_t(
                sys::UCS_CONFIG_PRINT_CONFIG.0 | sys::UCS_CONFIG_PRINT_HIDDEN.0,
            );
            let text = printed(|f| {
                // SAFETY: f is an open stream; the prefix is NUL-terminated; the global
                // list is UCX's, complete and no longer changing once a context exists
                // (modules load once, inside the first ucp_init); a NULL filter prints
                // everything (and releases before 1.19 ignore the argument, see ucx-sys).
                unsafe {
                    sys::ucs_config_parser_print_all_opts(
                        f.cast(),
                        c"UCX_".as_ptr(),
                        flags,
                        &raw mut sys::ucs_config_global_list,
                        std::ptr::null(),
                    )
                }
            })?;
            let names = parse_settings(&text);
            (!names.is_empty()).then_some(names)
        })
        .as_ref()
}

/// The names of the settings in UCP's own table, as `ucp_config_print` lists `config`'s
/// (empty when they cannot be read).
fn ucp_settings(config: *const sys::ucp_config_t) -> HashSet<String> {
    let flags =
        sys::ucs_config_print_flags_t(sys::UCS_CONFIG_PRINT_CONFIG.0 | sys::UCS_CONFIG_PRINT_HIDDEN.0);
    // SAFETY: config is a live configuration; f is an open stream; the title is
    // NUL-terminated.
    printed(|f| unsafe { sys::ucp_config_print(config, f.cast(), c"".as_ptr(), flags) })
        .map(|t| parse_settings(&t))
        .unwrap_or_default()
}

/// Whether `name` is one of UCS's global settings that `ucp_config_modify` applies.
fn is_global_setting(name: &str) -> bool {
    let Ok(n) = CString::new(name) else { return false };
    let mut value = [0 as libc::c_char; 256];
    // SAFETY: n is NUL-terminated; value has room for `len` bytes.
    let st = unsafe { sys::ucs_global_opts_get_value(n.as_ptr(), value.as_mut_ptr(), value.len()) };
    st == sys::UCS_OK
}

/// The memory types a live context's UCX can reach (`UCP_ATTR_FIELD_MEMORY_TYPES`: bit
/// n for `ucs_memory_type` n); host memory only if the query fails.
fn read_memory_types(handle: sys::ucp_context_h) -> u64 {
    let mut attr = sys::ucp_context_attr_t {
        field_mask: sys::UCP_ATTR_FIELD_MEMORY_TYPES.0 as u64,
        ..Default::default()
    };
    // SAFETY: the caller's context is live; attr is a valid out-parameter.
    let st = Status(unsafe { sys::ucp_context_query(handle, &mut attr) });
    if st.is_ok() {
        attr.memory_types
    } else {
        1 << sys::UCS_MEMORY_TYPE_HOST.0
    }
}

/// The `(transport, device)` pairs of a live context's resources.
fn read_resources(handle: sys::ucp_context_h) -> Vec<(String, String)> {
    // SAFETY: the caller's context is live; f is an open stream for the call.
    printed(|f| unsafe { sys::ucp_context_print_info(handle, f.cast()) })
        .map(|t| parse_resources(&t))
        .unwrap_or_default()
}

/// The `(transport, device)` pairs in `ucp_context_print_info`'s resource lines
/// (`#      resource 3  :  md 2  dev 3  flags -- posix/memory`).
fn parse_resources(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter(|l| l.trim_start_matches('#').trim_start().starts_with("resource"))
        .filter_map(|l| l.rsplit_once("-- ")?.1.trim().split_once('/'))
        .map(|(tl, dev)| (tl.to_string(), dev.to_string()))
        .collect()
}

/// Transports that carry messages between processes of one host through shared memory;
/// `cma` and `knem` only copy bulk data, and cannot carry a connection alone.
const SHARED_MEMORY_MESSAGES: [&str; 3] = ["posix", "sysv", "xpmem"];

/// The names in UCX's printed configuration: each `UCX_NAME=value` line gives `NAME`.
fn parse_settings(text: &str) -> HashSet<String> {
    text.lines().filter_map(|l| l.strip_prefix("UCX_")?.split_once('=').map(|(n, _)| n.to_string())).collect()
}

struct ConfigGuard(*mut sys::ucp_config_t);

impl Drop for ConfigGuard {
    fn drop(&mut self) {
        // SAFETY: the config came from ucp_config_read and is released once.
        unsafe { sys::ucp_config_release(self.0) }
    }
}

pub(crate) struct ContextInner {
    pub(crate) handle: sys::ucp_context_h,
    pub(crate) features: Features,
    /// `(transport, device)` of each resource UCX opened for the context.
    resources: Vec<(String, String)>,
    /// The memory types UCX can reach, as `ucp_context_query` reports them.
    memory_types: u64,
    pub(crate) secret: Option<Secret>,
    /// This context's own key for host memory (read once, see [`Context::own_key`]).
    own_key: OnceLock<std::result::Result<crate::ucx_key::OwnKey, String>>,
}

impl ContextInner {
    /// See [`Context::supports`].
    pub(crate) fn supports(&self, mem: crate::MemoryType) -> bool {
        let bit = mem.ucs().0;
        bit < 64 && self.memory_types & (1 << bit) != 0
    }
}

// SAFETY: a UCP context is created with `mt_workers_shared = 1`, which makes it safe to use
// from several threads (workers on different threads share it); ucxkit calls only
// thread-safe context-level functions (worker creation, memory mapping) without a lock.
unsafe impl Send for ContextInner {}
// SAFETY: as above.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: every worker and memory region holds an Arc to this context, so none is
        // left when this runs; the handle is released once.
        unsafe { sys::ucp_cleanup(self.handle) }
    }
}

/// A UCX application context (`ucp_context_h`).
///
/// Cheap to clone; the context is released when the last clone and the last
/// [`Worker`](crate::Worker) created from it are gone.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("features", &self.inner.features).finish()
    }
}

impl Context {
    /// A builder with the default features and UCX's configuration from the environment.
    pub fn builder() -> ContextBuilder {
        ContextBuilder::default()
    }

    /// A context with the default features and UCX's configuration from the environment.
    pub fn new() -> Result<Context> {
        Self::builder().build()
    }

    /// The features this context was created with.
    pub fn features(&self) -> Features {
        self.inner.features
    }

    /// This context's own key for host memory, walked (see [`crate::ucx_key::OwnKey`]):
    /// that of a small region it allocates, read once. Peers' keys are checked against
    /// it.
    pub(crate) fn own_key(&self) -> std::result::Result<&crate::ucx_key::OwnKey, String> {
        let r = self.inner.own_key.get_or_init(|| {
            let handle = self.inner.handle;
            // SAFETY: the context is live; f is an open stream for the call.
            let info = printed(|f| unsafe { sys::ucp_context_print_info(handle, f.cast()) })
                .ok_or("the context's memory domains cannot be read")?;
            let names = crate::ucx_key::context_domains(&info);
            let region = self.alloc(4096).map_err(|e| e.to_string())?;
            let key = region.pack_ucx_key().map_err(|e| e.to_string())?;
            let walked = crate::ucx_key::walk(&key)?;
            let mut own = crate::ucx_key::OwnKey { tail: key[walked.tail].to_vec(), ..Default::default() };
            for (md, tl) in walked.entries {
                if let Some((_, name)) = names.iter().find(|(i, _)| *i == md) {
                    own.by_component.insert(name.clone(), key[tl].to_vec());
                }
            }
            Ok(own)
        });
        r.as_ref().map_err(Clone::clone)
    }

    /// The secret set with [`ContextBuilder::secret`], if any.
    pub fn secret(&self) -> Option<&Secret> {
        self.inner.secret.as_ref()
    }

    /// The transports and devices UCX opened for this context, as `(transport, device)`
    /// pairs (`("posix", "memory")`, `("tcp", "eth0")`; `ucp_context_print_info`).
    pub fn resources(&self) -> &[(String, String)] {
        &self.inner.resources
    }

    /// Whether this context can carry messages through shared memory (posix, sysv or
    /// xpmem is among its transports): what [`crate::ErrorMode::Auto`] needs before it
    /// gives up UCX's peer error mode for a peer on this host.
    pub fn has_shared_memory(&self) -> bool {
        self.inner.resources.iter().any(|(tl, _)| SHARED_MEMORY_MESSAGES.contains(&tl.as_str()))
    }

    /// Whether this context's UCX can move memory of type `mem` (UCX's
    /// `UCP_ATTR_FIELD_MEMORY_TYPES`): always for host memory; for CUDA memory only with a
    /// UCX built with its CUDA transports, a CUDA driver and device present, and those
    /// transports enabled. An operation on a buffer it cannot reach is refused
    /// ([`crate::ErrorKind::Unsupported`]).
    pub fn supports(&self, mem: crate::MemoryType) -> bool {
        self.inner.supports(mem)
    }

    /// The raw handle: valid while this context (or a clone, or a worker of it) is
    /// alive; do not destroy it.
    pub fn as_raw(&self) -> sys::ucp_context_h {
        self.inner.handle
    }

    /// Version of the UCX library loaded at run time, as (major, minor, release).
    pub fn ucx_version() -> (u32, u32, u32) {
        let (mut a, mut b, mut c) = (0, 0, 0);
        // SAFETY: valid out-pointers.
        unsafe { sys::ucp_get_version(&mut a, &mut b, &mut c) };
        (a, b, c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_read_from_ucx_print_lines() {
        let text = "#\n# comment\nUCX_TLS=all\nUCX_TCP_SNDBUF=auto\nUCX_EMPTY=\nNOT_UCX=1\n";
        let names = parse_settings(text);
        let mut v: Vec<_> = names.iter().map(String::as_str).collect();
        v.sort();
        assert_eq!(v, ["EMPTY", "TCP_SNDBUF", "TLS"]);
    }

    #[test]
    fn resources_are_read_from_context_info() {
        let text = "#\n#            md 0  :  component 0  self \n\
                    #      resource 0  :  md 0  dev 0  flags -- self/memory0\n\
                    #      resource 2  :  md 1  dev 2  flags -- tcp/lo\n\
                    #      resource 3  :  md 2  dev 3  flags -- posix/memory\n";
        let r = parse_resources(text);
        let pairs: Vec<_> = r.iter().map(|(t, d)| (t.as_str(), d.as_str())).collect();
        assert_eq!(pairs, [("self", "memory0"), ("tcp", "lo"), ("posix", "memory")]);
    }

    #[test]
    fn shared_memory_is_seen_only_where_it_carries_messages() {
        let ctx = |tls: &str| Context::builder().transports(tls).build().unwrap();
        assert!(ctx("posix,self").has_shared_memory());
        assert!(!ctx("tcp,self").has_shared_memory());
        // cma copies bulk data only; with tcp beside it, connections run over tcp.
        assert!(!ctx("cma,tcp,self").has_shared_memory());
        assert!(ctx("posix,tcp,self").resources().iter().any(|(t, _)| t == "tcp"));
    }
}
