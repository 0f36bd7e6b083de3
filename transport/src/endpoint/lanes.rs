//! Which transports and devices UCX chose for an endpoint: its lanes.

use ucx_sys as sys;

use super::Endpoint;
use crate::error::{Error, Result};

impl Endpoint {
    /// Prints which transports and devices UCX chose for this endpoint
    /// (`ucp_ep_print_info`).
    pub fn transport_info(&self) -> Result<String> {
        self.with_handle("transport_info", |_, h| {
            // SAFETY: h is live under the lock; f is an open stream for the call.
            crate::ucx_log::printed(|f| unsafe { sys::ucp_ep_print_info(h, f.cast()) })
                .ok_or_else(|| Error::Io { op: "open_memstream", source: std::io::Error::last_os_error() })
        })
    }

    /// The transport and device of each of this endpoint's lanes (deduplicated; the
    /// connection-manager lane left out): from `ucp_ep_query` on UCX 1.14 and newer, from
    /// [`Endpoint::transport_info`] on older UCX. Lanes can change until the connection is
    /// fully wired up, which `connect` and `accept` wait for when the handshake is on.
    pub fn lanes(&self) -> Result<Vec<Lane>> {
        #[cfg(ucx_ge_1_14)]
        {
            if let Some(l) = self.query_lanes()? {
                return Ok(l);
            }
        }
        Ok(parse_lanes(&self.transport_info()?))
    }

    #[cfg(ucx_ge_1_14)]
    fn query_lanes(&self) -> Result<Option<Vec<Lane>>> {
        self.with_handle("ucp_ep_query", |_, h| {
            let mut entries = vec![
                sys::ucp_transport_entry_t {
                    transport_name: std::ptr::null(),
                    device_name: std::ptr::null()
                };
                32
            ];
            let mut attr = sys::ucp_ep_attr_t {
                field_mask: sys::UCP_EP_ATTR_FIELD_TRANSPORTS.0 as u64,
                ..Default::default()
            };
            attr.transports.entries = entries.as_mut_ptr();
            attr.transports.num_entries = entries.len() as _;
            attr.transports.entry_size = std::mem::size_of::<sys::ucp_transport_entry_t>() as _;
            // SAFETY: h is live under the lock; the entry array is valid for the count and
            // entry size given.
            if !crate::Status(unsafe { sys::ucp_ep_query(h, &mut attr) }).is_ok() {
                return Ok(None);
            }
            let n = (attr.transports.num_entries as usize).min(entries.len());
            let mut out: Vec<Lane> = Vec::new();
            for e in &entries[..n] {
                if e.transport_name.is_null() {
                    continue;
                }
                // SAFETY: UCX fills NUL-terminated names valid until the endpoint closes;
                // they are copied here, under the lock.
                let (t, d) = unsafe {
                    (
                        std::ffi::CStr::from_ptr(e.transport_name).to_string_lossy().into_owned(),
                        if e.device_name.is_null() {
                            String::new()
                        } else {
                            std::ffi::CStr::from_ptr(e.device_name).to_string_lossy().into_owned()
                        },
                    )
                };
                // The connection-manager lane (UCX reports it by its component, "tcp",
                // with no device) carries no data: leave it out, as print_info's "cm".
                let lane = Lane { transport: t, device: d };
                if !lane.device.is_empty() && lane.transport != "cm" && !out.contains(&lane) {
                    out.push(lane);
                }
            }
            Ok(Some(out))
        })
    }

    /// The UCX transports this endpoint's lanes use (for example `["posix", "cma"]` or
    /// `["tcp"]`), from [`Endpoint::lanes`].
    pub fn transports(&self) -> Result<Vec<String>> {
        let mut out: Vec<String> = Vec::new();
        for l in self.lanes()? {
            if !out.contains(&l.transport) {
                out.push(l.transport);
            }
        }
        Ok(out)
    }

    /// Fails (and closes the endpoint) when a required transport is not in use.
    pub(crate) fn check_required(&self, required: &[String]) -> Result<()> {
        if required.is_empty() {
            return Ok(());
        }
        let selected = self.transports()?;
        if let Some(missing) = required.iter().find(|r| !selected.contains(r)) {
            let id = self.inner.id;
            self.worker_inner().locked(|st| {
                st.close_unwaited(id);
            });
            return Err(Error::MissingTransport {
                peer: self.inner.peer.clone(),
                required: missing.clone(),
                selected,
            });
        }
        Ok(())
    }
}

/// One lane of an endpoint: a UCX transport on a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lane {
    /// Transport name (`posix`, `cma`, `tcp`, `rc_mlx5`, …).
    pub transport: String,
    /// Device name (`memory`, `lo`, `mlx5_0:1`, …).
    pub device: String,
}

/// Lanes from `ucp_ep_print_info` output: lines like
/// `#                 lane[0]:  8:posix/memory.0 md[4]  ...`.
pub(crate) fn parse_lanes(info: &str) -> Vec<Lane> {
    let mut out: Vec<Lane> = Vec::new();
    for line in info.lines() {
        let Some(rest) = line.split("lane[").nth(1) else {
            continue;
        };
        let Some(after) = rest.split_once(':').map(|x| x.1) else {
            continue;
        };
        let Some(tl) = after.split_whitespace().next() else {
            continue;
        };
        let tl = tl.split_once(':').map_or(tl, |x| x.1);
        let (transport, device) = tl.split_once('/').unwrap_or((tl, ""));
        // "memory.0": the trailing ".N" is the path index, not part of the device.
        let device = match device.rsplit_once('.') {
            Some((d, idx)) if idx.chars().all(|c| c.is_ascii_digit()) => d,
            _ => device,
        };
        let lane = Lane { transport: transport.to_string(), device: device.to_string() };
        if !lane.transport.is_empty() && lane.transport != "cm" && !out.contains(&lane) {
            out.push(lane);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lanes() {
        let info = "#\n# UCP endpoint\n#\n#               peer: <no debug data>\n#                 lane[0]:  8:posix/memory.0 md[4]      -> md[4]/posix/sysdev[255] rma_bw#0 am am_bw#0\n#                 lane[1]:  3:cma/memory.0 md[1]        -> md[1]/cma/sysdev[255] rma_bw#1\n#                 lane[2]:  1:tcp/lo.0 md[0]  -> am\n";
        let lanes = parse_lanes(info);
        let t: Vec<&str> = lanes.iter().map(|l| l.transport.as_str()).collect();
        assert_eq!(t, vec!["posix", "cma", "tcp"]);
        assert_eq!(lanes[0].device, "memory");
        assert_eq!(lanes[2].device, "lo");
        assert!(parse_lanes("nothing here").is_empty());
    }
}
