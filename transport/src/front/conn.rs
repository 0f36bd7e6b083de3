//! One front connection: frames over a TCP stream, the opening (hellos and, with a
//! secret, the proofs), and the frame MACs that follow an authenticated opening.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::wire::{self, Msg, Reason};
use crate::auth::{self, Secret, Session, Side, MAC_LEN, NONCE_LEN};

/// Why a front connection broke, for the error the caller builds.
#[derive(Debug)]
pub(crate) enum Broken {
    /// The socket failed or closed.
    Io(std::io::Error),
    /// The other side sent something that is not the protocol (or a wrong MAC).
    Protocol(String),
    /// The other side refused.
    Refused(Reason, String),
    /// The other side gave up after the accept.
    Aborted(String),
    /// The authentication did not go through.
    Authentication(String),
    /// A step took longer than allowed.
    Timeout,
}

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Broken::Io(e) => write!(f, "{e}"),
            Broken::Protocol(s) => write!(f, "protocol error: {s}"),
            Broken::Refused(r, s) => write!(f, "refused ({r:?}): {s}"),
            Broken::Aborted(s) => write!(f, "the other side gave up: {s}"),
            Broken::Authentication(s) => write!(f, "authentication failed: {s}"),
            Broken::Timeout => write!(f, "timed out"),
        }
    }
}

impl From<std::io::Error> for Broken {
    fn from(e: std::io::Error) -> Self {
        Broken::Io(e)
    }
}

/// A front connection: the stream and, once authenticated, the frame MACs.
pub(crate) struct Conn {
    stream: TcpStream,
    session: Option<Session>,
}

impl Conn {
    pub(crate) fn new(stream: TcpStream) -> Conn {
        // Small messages, each answered: no Nagle delay.
        let _ = stream.set_nodelay(true);
        Conn { stream, session: None }
    }

    /// The local address of the connection: the address its client reached.
    pub(crate) fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.stream.local_addr()
    }

    /// Whether the opening authenticated both sides (they share the secret).
    pub(crate) fn authenticated(&self) -> bool {
        self.session.is_some()
    }

    /// Sends one message (with its MAC once authenticated).
    pub(crate) async fn send(&mut self, m: &Msg) -> Result<(), Broken> {
        let body = m.encode();
        let mut frame = Vec::with_capacity(4 + body.len() + MAC_LEN);
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(&body);
        if let Some(s) = &mut self.session {
            frame.extend_from_slice(&s.seal(&body));
        }
        self.stream.write_all(&frame).await?;
        Ok(())
    }

    /// Receives one message, checked (and its MAC, once authenticated). A reject or an
    /// abort from the other side comes back as the matching [`Broken`].
    pub(crate) async fn recv(&mut self) -> Result<Msg, Broken> {
        let mut len = [0u8; 4];
        self.stream.read_exact(&mut len).await?;
        let n = wire::body_len(len).map_err(Broken::Protocol)?;
        let mut body = vec![0u8; n];
        self.stream.read_exact(&mut body).await?;
        if let Some(s) = &mut self.session {
            let mut tag = [0u8; MAC_LEN];
            self.stream.read_exact(&mut tag).await?;
            if !s.open(&body, &tag) {
                return Err(Broken::Protocol("a frame's MAC is wrong (changed in transit?)".into()));
            }
        }
        match Msg::decode(&body).map_err(Broken::Protocol)? {
            Msg::Reject { reason, text } => Err(Broken::Refused(reason, text)),
            Msg::Abort { text } => Err(Broken::Aborted(text)),
            m => Ok(m),
        }
    }

    /// [`Conn::recv`] within `limit`.
    pub(crate) async fn recv_within(&mut self, limit: Duration) -> Result<Msg, Broken> {
        tokio::time::timeout(limit, self.recv()).await.map_err(|_| Broken::Timeout)?
    }

    /// Sends a reject (best effort: the connection ends anyway).
    pub(crate) async fn refuse(&mut self, reason: Reason, text: impl Into<String>) {
        let m = Msg::Reject { reason, text: text.into() };
        let _ = tokio::time::timeout(Duration::from_secs(1), self.send(&m)).await;
        let _ = self.stream.shutdown().await;
    }

    /// The client's opening: hellos, then the proofs when the client has a secret. A
    /// client with a secret talks only to a server that has it too.
    pub(crate) async fn open_client(
        &mut self,
        secret: Option<&Secret>,
        limit: Duration,
    ) -> Result<(), Broken> {
        let mine: [u8; NONCE_LEN] = auth::random().map_err(|e| Broken::Io(std::io::Error::other(e)))?;
        self.send(&Msg::ClientHello { nonce: mine, has_secret: secret.is_some() }).await?;
        let theirs =
            match self.recv_within(limit).await? {
                Msg::ServerHello { nonce, needs_secret } => {
                    match (secret.is_some(), needs_secret) {
                        (true, false) => return Err(Broken::Authentication(
                            "the listener has no secret, and this side talks only to peers that prove they \
                             hold its own"
                                .into(),
                        )),
                        (false, true) => {
                            return Err(Broken::Authentication(
                                "the listener requires a secret: give this side's context the same one \
                             (ContextBuilder::secret)"
                                    .into(),
                            ))
                        }
                        _ => {}
                    }
                    nonce
                }
                m => return Err(Broken::Protocol(format!("expected the server hello, got a {}", m.name()))),
            };
        let Some(secret) = secret else { return Ok(()) };
        self.send(&Msg::Proof { tag: auth::proof(secret, Side::Client, &mine, &theirs) }).await?;
        match self.recv_within(limit).await {
            Ok(Msg::Proof { tag }) if auth::check_proof(secret, Side::Server, &mine, &theirs, &tag) => {}
            Ok(Msg::Proof { .. }) => {
                return Err(Broken::Authentication("the listener does not hold the same secret".into()))
            }
            Ok(m) => {
                return Err(Broken::Protocol(format!("expected the server's proof, got a {}", m.name())))
            }
            Err(Broken::Refused(Reason::Authentication, text)) => return Err(Broken::Authentication(text)),
            Err(e) => return Err(e),
        }
        self.session = Some(Session::new(secret, Side::Client, &mine, &theirs));
        Ok(())
    }

    /// The server's opening: the mirror of [`Conn::open_client`]. A listener with a
    /// secret takes only clients that prove they hold it; one without takes only
    /// clients without one.
    pub(crate) async fn open_server(
        &mut self,
        secret: Option<&Secret>,
        limit: Duration,
    ) -> Result<(), Broken> {
        let (theirs, has_secret) = match self.recv_within(limit).await? {
            Msg::ClientHello { nonce, has_secret } => (nonce, has_secret),
            m => return Err(Broken::Protocol(format!("expected the client hello, got a {}", m.name()))),
        };
        let mine: [u8; NONCE_LEN] = auth::random().map_err(|e| Broken::Io(std::io::Error::other(e)))?;
        self.send(&Msg::ServerHello { nonce: mine, needs_secret: secret.is_some() }).await?;
        let Some(secret) = secret else {
            if has_secret {
                // The client refuses a listener without a secret; it says so itself.
                return Err(Broken::Authentication("the client has a secret, this listener none".into()));
            }
            return Ok(());
        };
        if !has_secret {
            self.refuse(Reason::Authentication, "this listener requires a secret").await;
            return Err(Broken::Authentication("the client has no secret".into()));
        }
        let good = match self.recv_within(limit).await? {
            Msg::Proof { tag } => auth::check_proof(secret, Side::Client, &theirs, &mine, &tag),
            m => return Err(Broken::Protocol(format!("expected the client's proof, got a {}", m.name()))),
        };
        if !good {
            self.refuse(Reason::Authentication, "wrong secret").await;
            return Err(Broken::Authentication("the client does not hold the listener's secret".into()));
        }
        self.send(&Msg::Proof { tag: auth::proof(secret, Side::Server, &theirs, &mine) }).await?;
        self.session = Some(Session::new(secret, Side::Server, &theirs, &mine));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair() -> (Conn, Conn) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (a, b) = tokio::join!(l.accept(), TcpStream::connect(addr));
        (Conn::new(b.unwrap()), Conn::new(a.unwrap().0))
    }

    const T: Duration = Duration::from_secs(5);

    async fn open(
        client: Option<&Secret>,
        server: Option<&Secret>,
    ) -> (Result<(), Broken>, Result<(), Broken>, Conn, Conn) {
        let (mut c, mut s) = pair().await;
        let (a, b) = tokio::join!(c.open_client(client, T), s.open_server(server, T));
        (a, b, c, s)
    }

    #[tokio::test]
    async fn openings_succeed_only_with_matching_secrets() {
        let k = Secret::new([5u8; 32]).unwrap();
        let other = Secret::new([6u8; 32]).unwrap();
        let (a, b, mut c, mut s) = open(None, None).await;
        assert!(a.is_ok() && b.is_ok());
        assert!(c.session.is_none());
        let (a, b, c2, s2) = open(Some(&k), Some(&k)).await;
        assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
        assert!(c2.session.is_some() && s2.session.is_some());
        for (cs, ss) in [(None, Some(&k)), (Some(&k), None), (Some(&other), Some(&k))] {
            let (a, b, _, _) = open(cs, ss).await;
            assert!(matches!(a, Err(Broken::Authentication(_))), "client {a:?}");
            assert!(b.is_err(), "server {b:?}");
        }
        // Messages flow after an opening without a secret, too.
        let m = Msg::Abort { text: "x".into() };
        c.send(&m).await.unwrap();
        assert!(matches!(s.recv().await, Err(Broken::Aborted(t)) if t == "x"));
    }

    #[tokio::test]
    async fn authenticated_frames_cannot_be_forged() {
        let k = Secret::new([5u8; 32]).unwrap();
        let (a, b, mut c, mut s) = open(Some(&k), Some(&k)).await;
        a.unwrap();
        b.unwrap();
        // A frame without its MAC, as a third party injecting one would send it.
        let body = Msg::Abort { text: "forged".into() }.encode();
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&body);
        frame.extend_from_slice(&[0u8; MAC_LEN]);
        c.stream.write_all(&frame).await.unwrap();
        assert!(matches!(s.recv().await, Err(Broken::Protocol(_))));
    }

    #[tokio::test]
    async fn garbage_is_a_protocol_error() {
        for bytes in [vec![0u8; 17], vec![0xff; 8], b"GET / HTTP/1.1\r\n\r\n".to_vec()] {
            let (mut c, mut s) = pair().await;
            c.stream.write_all(&bytes).await.unwrap();
            let r = s.open_server(None, Duration::from_millis(500)).await;
            assert!(matches!(r, Err(Broken::Protocol(_) | Broken::Timeout | Broken::Io(_))), "{r:?}");
        }
    }
}
