//! [`Context`]: one UCX application context (`ucp_context_h`), the parent of workers and
//! memory registrations.

use std::ffi::CString;
use std::sync::Arc;

use ucx_sys as sys;

use crate::error::{Error, Result, Status};
use crate::request;
use crate::worker::{Worker, WorkerBuilder};

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
    /// reads it until the send completes); [`Error::Config`] for a setting UCX refuses;
    /// [`Error::CreateContext`] when `ucp_init` fails.
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
            request_size: request::SLOT_SIZE,
            request_init: Some(request::slot_init),
            name: name.as_ptr(),
            mt_workers_shared: 1,
            ..Default::default()
        };
        let mut handle: sys::ucp_context_h = std::ptr::null_mut();
        // SAFETY: params and config are valid for the call; handle is a valid out-pointer.
        let st = Status(unsafe { sys::ucp_init(&params, guard.0, &mut handle) });
        st.check().map_err(Error::CreateContext)?;
        tracing::debug!(features = features.0, "UCX context created");
        Ok(Context { inner: Arc::new(ContextInner { handle, features }) })
    }
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
/// [`Worker`] created from it are gone.
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

    /// A builder for a worker on this context.
    pub fn worker(&self) -> WorkerBuilder {
        WorkerBuilder::new(self.clone())
    }

    /// Creates a worker with default settings. Must be called inside a tokio runtime.
    pub fn create_worker(&self) -> Result<Worker> {
        self.worker().build()
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
