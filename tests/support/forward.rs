//! A TCP forwarder on a free loopback port, in front of a Redis node: what
//! a proxy or a DNS name that moves on failover looks like to a client.
//! Each accepted connection is joined to the node the forwarder names at
//! that moment ([`Forwarder::switch_to`] changes it for new connections;
//! the ones already open stay where they are, as with a real proxy).
//! [`Forwarder::hold_replies`] keeps the node's bytes from reaching the
//! client (the command ran; its answer is late).

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Forwarder {
    port: u16,
    target: Arc<AtomicU16>,
    hold: watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    /// Forwards to `127.0.0.1:target`. Needs a tokio runtime.
    pub async fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let target = Arc::new(AtomicU16::new(target));
        let (hold, held) = watch::channel(false);
        let to = target.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let port = to.load(Ordering::SeqCst);
                let held = held.clone();
                tokio::spawn(async move {
                    let Ok(node) = TcpStream::connect(("127.0.0.1", port)).await else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut nr, mut nw) = node.into_split();
                    let up = async move {
                        let _ = tokio::io::copy(&mut cr, &mut nw).await;
                        let _ = nw.shutdown().await;
                    };
                    let down = async move {
                        let mut held = held;
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = match nr.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            if held.wait_for(|h| !*h).await.is_err() {
                                break;
                            }
                            if cw.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                        let _ = cw.shutdown().await;
                    };
                    tokio::join!(up, down);
                });
            }
        });
        Forwarder {
            port,
            target,
            hold,
            accept,
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// New connections go to `127.0.0.1:target` from now on.
    pub fn switch_to(&self, target: u16) {
        self.target.store(target, Ordering::SeqCst);
    }

    /// While `true`, nothing the nodes send reaches the clients.
    pub fn hold_replies(&self, hold: bool) {
        self.hold.send_replace(hold);
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
