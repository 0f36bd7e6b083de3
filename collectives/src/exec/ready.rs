//! Flow control between calls. In a loop of calls whose messages go one way (a
//! broadcast's root to its leaves, a reduce's leaves to their root, a scan's chain), a
//! sender never waits for its receivers: its messages wait in their unexpected queue, and
//! it runs ahead without bound. That queue then grows for as long as the loop runs, and
//! every receive searches it: four ranks on two cores, 16 B reduce, 1.3-2.0 us a call
//! over 20,000 calls, 7.5-13 us over 200,000 (the root's `ucp_tag_recv_nbx` half of all
//! the time), where Open MPI, whose collective messages share one tag, stayed at 0.56.
//!
//! So one call in [`READY_EVERY`] on a communicator first exchanges ready messages
//! (empty, of kind [`Kind::Ready`], step 0): a rank tells each peer it receives from
//! and sends nothing to that it has come to this call, and a rank that sends to a peer
//! it receives nothing from waits for that peer's word before it starts. A sender is then
//! never more than [`READY_EVERY`] calls ahead of its receivers. Whether a pair of ranks
//! exchanges one depends on their own schedules only, which agree; a ring's ranks, whose
//! steps already bound how far they run apart, exchange one as well (one message a
//! rank every [`READY_EVERY`] calls).

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use ucxkit_transport::{tag::EXACT, TagRecv};

use super::small::{poll_sends, send, Queued};
use super::{received, Watch, Wire};
use crate::error::Result;
use crate::schedule::{Schedule, Xfer};
use crate::tag::{kind_tag, Kind};

/// One call in this many (those whose sequence number is one below a multiple of it, so
/// not a communicator's first) exchanges ready messages first. Four ranks on two cores,
/// 16 B reduce in loops of 200,000 calls: 12.9 -> 1.0-1.3 us a call. It bounds what
/// waits unreceived to this many calls' messages from each sender.
pub(crate) const READY_EVERY: u16 = 256;

/// Whether call `seq` exchanges ready messages first.
#[inline(always)]
pub(crate) fn due(seq: u16) -> bool {
    seq % READY_EVERY == READY_EVERY - 1
}

/// The peers this rank owes a ready message in a call of `sched` (it receives from them
/// and sends them nothing), and those it waits for (the other way round), in rank order.
/// Transfers left out of the call (empty ones, unless the schedule synchronises) count
/// for nothing.
pub(crate) fn one_way(sched: &Schedule) -> (Vec<usize>, Vec<usize>) {
    let (mut to, mut from) = (BTreeSet::new(), BTreeSet::new());
    for x in sched.steps.iter().flat_map(|s| &s.xfers) {
        match x {
            Xfer::Send { peer, from: r } if sched.sync || !r.is_empty() => {
                to.insert(*peer);
            }
            Xfer::Recv { peer, into } if sched.sync || !into.is_empty() => {
                from.insert(*peer);
            }
            _ => {}
        }
    }
    (from.difference(&to).copied().collect(), to.difference(&from).copied().collect())
}

/// Exchanges the ready messages of call `seq` of `sched` (see the module docs): sends
/// those this rank owes, and waits for those it waits for, failing as the communicator's
/// abort or the deadline `limit` says.
pub(crate) async fn exchange(
    w: &Wire<'_>,
    seq: u16,
    sched: &Schedule,
    limit: Option<Duration>,
) -> Result<()> {
    let (owe, wait) = one_way(sched);
    if owe.is_empty() && wait.is_empty() {
        return Ok(());
    }
    let mut queued: Queued = Vec::new();
    for &peer in &owe {
        send(w, peer, kind_tag(w.comm, seq, 0, w.rank, Kind::Ready), &[], true, &mut queued)?;
    }
    let mut words: Vec<(usize, Option<TagRecv<Vec<u8>>>)> = Vec::with_capacity(wait.len());
    for &peer in &wait {
        let t = kind_tag(w.comm, seq, 0, peer, Kind::Ready);
        words.push((peer, Some(w.ns.tag_recv_from(w.ep(peer)?, t, EXACT, Vec::new()))));
    }
    let mut watch: Option<Watch<'_>> = None;
    std::future::poll_fn(|cx| {
        let (mut pending, failed) = poll_sends(&mut queued, cx);
        if let Some(e) = failed {
            return Poll::Ready(Err(e));
        }
        for (peer, word) in words.iter_mut() {
            let Some(op) = word.as_mut() else { continue };
            match Pin::new(op).poll(cx) {
                Poll::Pending => pending = true,
                Poll::Ready((r, _)) => {
                    *word = None;
                    received(*peer, 0, r)?;
                }
            }
        }
        if !pending {
            return Poll::Ready(Ok(()));
        }
        let watch = watch.get_or_insert_with(|| Watch::new(w.abort, limit));
        let waiting = || {
            let sends = queued.iter().filter(|(_, s)| s.is_some()).map(|(p, _)| *p);
            sends.chain(words.iter().filter(|(_, r)| r.is_some()).map(|(p, _)| *p)).collect::<Vec<_>>()
        };
        watch.poll_end(cx, waiting).map(Err)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{linear, ring, tree};

    /// Who owes whom a ready message: a tree's receivers their sender, both ways alike
    /// (each pair agrees), nobody in an exchange that goes both ways.
    #[test]
    fn ready_messages_go_against_one_way_transfers_only() {
        let n = 4;
        // A one-level broadcast from 0: the root waits for every leaf, each leaf owes it.
        let bcast: Vec<Schedule> = (0..n).map(|r| tree::knomial_bcast(n, r, 0, 8, 4)).collect();
        assert_eq!(one_way(&bcast[0]), (vec![], vec![1, 2, 3]));
        for (r, s) in bcast.iter().enumerate().skip(1) {
            assert_eq!(one_way(s), (vec![0], vec![]), "leaf {r}");
        }
        // Direct all-to-all: every pair both ways.
        let blocks = crate::schedule::even_blocks(8, n);
        for r in 0..n {
            assert_eq!(one_way(&linear::direct_alltoall(n, r, &blocks, &blocks)), (vec![], vec![]));
        }
        // A ring: each rank owes its predecessor and waits for its successor, and every
        // pair agrees on it.
        let rings: Vec<Schedule> = (0..n).map(|r| ring::allgather(n, r, &blocks)).collect();
        for (r, s) in rings.iter().enumerate() {
            let (owe, wait) = one_way(s);
            for p in owe {
                assert!(one_way(&rings[p]).1.contains(&r), "{p} waits for {r}'s word");
            }
            for p in wait {
                assert!(one_way(&rings[p]).0.contains(&r), "{p} owes {r} a word");
            }
        }
    }

    /// The calls that exchange ready messages: one in [`READY_EVERY`], never the first,
    /// the same after the sequence numbers wrap.
    #[test]
    fn one_call_in_ready_every_is_due() {
        assert!(!due(0));
        let due_ones: Vec<u16> = (0..=u16::MAX).filter(|&s| due(s)).collect();
        assert_eq!(due_ones.len(), usize::from(u16::MAX / READY_EVERY) + 1);
        assert!(due_ones.windows(2).all(|w| w[1] - w[0] == READY_EVERY));
        assert_eq!(due_ones[0], READY_EVERY - 1);
    }
}
