//! The worker's side of ucxkit's handshake (whose messages are in [`crate::handshake`]):
//! the active-message handler that takes hellos, replies and close notices under the
//! worker's lock and dispatches them to the connects, accepts and endpoints waiting.

use super::*;

/// The handshake's active-message handler.
pub(super) unsafe extern "C" fn handshake_am_cb(
    arg: *mut c_void,
    _header: *const c_void,
    _header_len: usize,
    data: *mut c_void,
    len: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: called by UCX inside progress under the worker lock; arg is the State; param
    // is valid for the call.
    let (st, param) = unsafe { (&mut *arg.cast::<State>(), &*param) };
    let reply_ep = param.reply_ep;
    if param.recv_attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV.0 as u64 != 0 || data.is_null() {
        st.bad_handshakes += 1;
        tracing::warn!(len, "oversized handshake message dropped");
        return sys::UCS_OK;
    }
    // SAFETY: eager data is readable for `len` bytes during the callback.
    let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) };
    let me = ProcessIdentity::current();
    match Message::decode(bytes) {
        Err(reason) => {
            st.bad_handshakes += 1;
            tracing::warn!(%reason, "malformed handshake message");
            // Fail the handshake waiting on this connection, if any.
            let key = reply_ep as usize;
            let ep_id = st.by_handle.get(&key).copied();
            let waiting = st
                .accepts
                .get_mut(&key)
                .or_else(|| st.connects.values_mut().find(|w| Some(w.ep) == ep_id && w.result.is_none()));
            if let Some(w) = waiting {
                w.result = Some(Err(format!("the peer sent a malformed handshake: {reason}")));
                if let Some(k) = w.waker.take() {
                    st.after.wake(k);
                }
            }
            if !reply_ep.is_null() {
                let nack = Message {
                    kind: Kind::Nack(NackReason::Malformed),
                    peer_mode: false,
                    nonce: 0,
                    identity: me,
                    lane: None,
                };
                st.reply(reply_ep, nack);
            }
        }
        Ok(m) => match m.kind {
            Kind::FrontHello => {
                if reply_ep.is_null() {
                    st.bad_handshakes += 1;
                    return sys::UCS_OK;
                }
                match st.front_accepts.get_mut(&m.nonce) {
                    // More hellos than a client's collisions can explain are dropped:
                    // the queue is bounded whatever a client sends.
                    Some(w) if w.hellos.len() > handshake::MAX_COLLISIONS as usize => {
                        st.bad_handshakes += 1;
                    }
                    Some(w) => {
                        // Answered once the accept took the endpoint over (see `pairing`).
                        w.hellos.push_back((reply_ep, m.peer_mode, m.lane));
                        if let Some(k) = w.waker.take() {
                            st.after.wake(k);
                        }
                    }
                    None => {
                        // No accept waits for this connection (it gave up, or never was).
                        st.bad_handshakes += 1;
                        let nack = Message {
                            kind: Kind::Nack(NackReason::Malformed),
                            peer_mode: m.peer_mode,
                            nonce: m.nonce,
                            identity: me,
                            lane: None,
                        };
                        st.reply(reply_ep, nack);
                    }
                }
            }
            Kind::Hello => {
                if reply_ep.is_null() {
                    st.bad_handshakes += 1;
                    return sys::UCS_OK;
                }
                let mut kind = Kind::Ack;
                if let Some(w) = st.accepts.get_mut(&(reply_ep as usize)) {
                    if w.expect.is_some_and(|n| n != m.nonce) {
                        kind = Kind::Nack(NackReason::Malformed);
                        w.result = Some(Err("a hello for another connection".into()));
                    } else if w.peer_mode != m.peer_mode {
                        kind = Kind::Nack(NackReason::ErrorModeMismatch);
                        w.result = Some(Err(format!(
                            "error mode mismatch: the client uses {}, this side {}",
                            mode_name(m.peer_mode),
                            mode_name(w.peer_mode)
                        )));
                    } else {
                        w.result = Some(Ok((m.identity, m.lane)));
                    }
                    if let Some(k) = w.waker.take() {
                        st.after.wake(k);
                    }
                }
                let peer_mode = m.peer_mode;
                // A hello without a lane may come from an older ucxkit, which reads
                // version 1 only: the answer carries no lane then.
                let lane = m.lane.and(st.lane);
                st.reply(reply_ep, Message { kind, peer_mode, nonce: m.nonce, identity: me, lane });
            }
            Kind::StreamEnd => {
                let id = st.by_handle.get(&(reply_ep as usize)).copied();
                match id.and_then(|id| st.eps.get_mut(&id)) {
                    Some(e) => {
                        e.stream_end = Some(m.nonce);
                        st.after.wake_waiters(&mut e.stream_waiters);
                    }
                    None => tracing::debug!("stream end notice for no known endpoint"),
                }
            }
            Kind::CloseFirst => match st.by_handle.get(&(reply_ep as usize)).copied() {
                Some(id) => {
                    // Closed after the progress call: not from inside a UCX callback.
                    st.close_first.push(id);
                    st.chores = true;
                }
                None => tracing::debug!("close-first notice for no known endpoint"),
            },
            Kind::Closing => match st.by_handle.get(&(reply_ep as usize)).copied() {
                Some(id) => {
                    // Answered after the progress call: not from inside a UCX callback.
                    st.peer_closing.push(id);
                    st.chores = true;
                }
                None => tracing::debug!("closing notice for no known endpoint"),
            },
            Kind::Closed => match st.by_handle.get(&(reply_ep as usize)).copied() {
                Some(id) => {
                    // The peer closed its end, as asked: this end is done, as if UCX had
                    // reported the peer's disconnect (handled after the progress call).
                    st.peer_closed.push(id);
                    st.chores = true;
                }
                None => tracing::debug!("closed notice for no known endpoint"),
            },
            Kind::Ack | Kind::Nack(_) => {
                if let Some(w) = st.connects.get_mut(&m.nonce) {
                    w.result = Some(match m.kind {
                        Kind::Nack(r) => Err(r.describe().to_string()),
                        _ if m.peer_mode != w.peer_mode => Err(format!(
                            "error mode mismatch: the peer uses {}, this side {}",
                            mode_name(m.peer_mode),
                            mode_name(w.peer_mode)
                        )),
                        _ => Ok((m.identity, m.lane)),
                    });
                    if let Some(k) = w.waker.take() {
                        st.after.wake(k);
                    }
                } else if let Some(w) = (m.kind == Kind::Nack(NackReason::Malformed) && m.nonce == 0)
                    .then(|| st.by_handle.get(&(reply_ep as usize)).copied())
                    .flatten()
                    .and_then(|id| st.connects.values_mut().find(|w| w.ep == id && w.result.is_none()))
                {
                    // A peer that could not read our hello at all answers without its
                    // nonce: one that reads only version 1, an older ucxkit.
                    w.result = Some(Err(
                        "the peer could not read our hello (handshake version 2, with a \
                                         keepalive lane): it may run an older ucxkit; turn the keepalive \
                                         off on this side (WorkerBuilder::keepalive(None)) to connect to it"
                            .into(),
                    ));
                    if let Some(k) = w.waker.take() {
                        st.after.wake(k);
                    }
                } else if let (Kind::Nack(_), Some(id)) =
                    (m.kind, st.by_handle.get(&(reply_ep as usize)).copied())
                {
                    // A peer that does not know the close notice (an older ucxkit)
                    // refused it: this side closes now instead of waiting for it.
                    st.parting_refused(id);
                } else {
                    tracing::debug!(nonce = m.nonce, "handshake reply for no pending connect");
                }
            }
        },
    }
    sys::UCS_OK
}

pub(super) fn mode_name(peer: bool) -> &'static str {
    if peer {
        "ErrorMode::Peer"
    } else {
        "ErrorMode::None"
    }
}
