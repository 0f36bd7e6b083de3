//! Which sends go by UCX's eager protocol (`tag_send_eager`: copied through UCX's
//! buffers) rather than by rendezvous (the receiver fetching the sender's memory): those
//! of mid-size messages to ranks reached through shared memory, by how crowded the host
//! is and how its worker waits. (Values the call itself wrote go eagerly up to 256 KiB
//! wherever they go: see `exchange`.)

/// Sends of up to this many bytes to a rank reached through shared memory
/// (`super::lane::mapped`) go by UCX's eager protocol (`tag_send_eager`), in a step that sends
/// at most [`EAGER_STEP`] bytes in all, unless the host is crowded and the worker
/// sleeps between events (event mode). UCX
/// 1.13 sends a message of 8 KiB or more by rendezvous otherwise, and a rendezvous
/// costs a round trip more: 2 ranks on 2 cores, alternated runs, medians of 7, eager up
/// to 64 KiB against none: broadcast 16 KiB 5.8 -> 1.0 us, 64 KiB 9.5 -> 2.3, reduce
/// 64 KiB 10.6 -> 3.4, allgather 64 KiB 7.5 -> 3.2, all-to-all 64 KiB 7.9 -> 3.6,
/// reduce-scatter 64 KiB 8.6 -> 4.6 (Open MPI's blocking sends go eagerly too). Longer
/// messages gain in some placements of the two processors and lose as much in others
/// (128 KiB broadcast: 0.33x to 1.5x). On a crowded host, four ranks on two cores:
/// allgather 35 -> 27 us, all-to-all 35 -> 30, reduce-scatter 40 -> 30, broadcast
/// 25 -> 16; 256 KiB allgather (three 64 KiB sends a step) 60 -> 91 eagerly, hence the
/// step's limit; but in event mode, whose receivers sleep there, eager sends took 64 KiB
/// broadcast from 0.23 to 0.55-0.75 ms. In event mode on 2 ranks and 2 cores: broadcast
/// 16 KiB 5.2 -> 1.6 us, 64 KiB 8.9 -> 4.3, allgather and all-to-all 64 KiB 0.72x and
/// 0.81x. Over TCP, 16-128 KiB calls took 1.0-2.1x as long eagerly.
pub(super) const EAGER: usize = 64 << 10;
/// See [`EAGER`].
const EAGER_STEP: usize = 128 << 10;

/// Which mid-size sends to ranks reached through shared memory go by UCX's eager
/// protocol, by how crowded the host is and how its worker waits (see [`EAGER`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Eager {
    /// None: a crowded host whose worker sleeps between events.
    Off,
    /// Up to [`EAGER`] bytes, in steps that send at most [`EAGER_STEP`]: a crowded host
    /// whose worker busy-polls.
    Crowded,
    /// As `Crowded`, and in a step that only sends, messages up to [`EAGER_STEP`] bytes
    /// (an uncrowded host). 2 ranks, alternated runs, medians: broadcast of 96 and 128
    /// KiB 0.26-0.29x, reduce 0.42x, gather and scatter of 256 KiB (128 KiB messages)
    /// 0.46-0.50x; on a crowded host (four ranks, two cores) 128 KiB reduce took 1.65x
    /// and 256 KiB scatter 1.28x.
    Roomy,
}

impl Eager {
    /// The mode of a host that is `crowded` or not, whose worker busy-polls or not.
    pub(crate) fn of(crowded: bool, busy: bool) -> Eager {
        match (crowded, busy) {
            (false, _) => Eager::Roomy,
            (true, true) => Eager::Crowded,
            (true, false) => Eager::Off,
        }
    }

    /// The mode stored as `u8` (`as u8`), back.
    pub(crate) fn from_u8(v: u8) -> Eager {
        match v {
            2 => Eager::Roomy,
            1 => Eager::Crowded,
            _ => Eager::Off,
        }
    }

    /// The longest eager send in a step that sends `sent` bytes, and receives too or not
    /// (`one_way`).
    pub(super) fn max_send(self, sent: usize, one_way: bool) -> usize {
        match self {
            _ if sent > EAGER_STEP => 0,
            Eager::Off => 0,
            Eager::Crowded => EAGER,
            Eager::Roomy if one_way => EAGER_STEP,
            Eager::Roomy => EAGER,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eager_sends_follow_the_host_and_the_step() {
        let k = 1024;
        assert_eq!(Eager::of(false, false), Eager::Roomy);
        assert_eq!(Eager::of(false, true), Eager::Roomy);
        assert_eq!(Eager::of(true, true), Eager::Crowded);
        assert_eq!(Eager::of(true, false), Eager::Off);
        for e in [Eager::Off, Eager::Crowded, Eager::Roomy] {
            assert_eq!(Eager::from_u8(e as u8), e);
        }
        // (mode, bytes the step sends, one way, longest eager send)
        let table = [
            (Eager::Off, 8 * k, true, 0),
            (Eager::Crowded, 64 * k, false, EAGER),
            (Eager::Crowded, 128 * k, true, EAGER),
            (Eager::Crowded, 192 * k, false, 0),
            (Eager::Roomy, 128 * k, false, EAGER),
            (Eager::Roomy, 128 * k, true, EAGER_STEP),
            (Eager::Roomy, 256 * k, true, 0),
        ];
        for (mode, sent, one_way, want) in table {
            assert_eq!(mode.max_send(sent, one_way), want, "{mode:?} {sent} {one_way}");
        }
    }
}
