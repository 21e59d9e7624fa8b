//! Reading inputs (files or stdin, plain or gzip) on a thread of their own,
//! in chunks that end at line boundaries, so decompression overlaps the
//! replay.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// One input: a file (gzip or plain, detected by its magic bytes) or stdin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// Standard input (`-`).
    Stdin,
    /// A file.
    File(PathBuf),
}

impl Input {
    /// `-` is stdin, anything else a file.
    pub fn from_arg(arg: &str) -> Self {
        if arg == "-" {
            Input::Stdin
        } else {
            Input::File(PathBuf::from(arg))
        }
    }

    /// The name used in reports: the path as given, or `-`.
    pub fn name(&self) -> String {
        match self {
            Input::Stdin => "-".to_owned(),
            Input::File(p) => p.display().to_string(),
        }
    }

    /// The size on disk, when known (for the progress bar).
    pub(crate) fn len(&self) -> Option<u64> {
        match self {
            Input::Stdin => None,
            Input::File(p) => std::fs::metadata(p).ok().map(|m| m.len()),
        }
    }
}

/// What the reader thread sends.
#[derive(Debug)]
pub(crate) enum Msg {
    /// Input `input` starts.
    Start { input: usize },
    /// Complete lines of the current input, `buf[..len]` (the last one may
    /// lack its newline at the end of the input). The rest of `buf` is
    /// spare: buffers go back and forth initialized, so a read never zeroes
    /// memory first.
    Chunk { buf: Vec<u8>, len: usize },
    /// A line longer than [`MAX_LINE`] was skipped (up to and including its
    /// newline): it counts as one malformed line.
    TooLong,
    /// The input could not be (fully) read; what was read before counts.
    Error { input: usize, error: String },
}

const CHUNK: usize = 1 << 20;
/// The longest line replayed: 16 MiB (no log line is anywhere near; a
/// longer one is garbage, skipped to its end without being held).
pub(crate) const MAX_LINE: usize = 16 << 20;

/// Counts bytes read from the underlying source, for the progress bar.
struct Counting<R> {
    inner: R,
    read: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Opens an input: gzip when it starts with the gzip magic bytes (`1f 8b`),
/// whatever its name; a `.gz` name without them is an error.
fn open(input: &Input, read: Arc<AtomicU64>) -> io::Result<Box<dyn Read + Send>> {
    let raw: Box<dyn Read + Send> = match input {
        Input::Stdin => Box::new(io::stdin()),
        Input::File(p) => Box::new(File::open(p)?),
    };
    let mut buf = BufReader::with_capacity(256 * 1024, Counting { inner: raw, read });
    let head = buf.fill_buf()?;
    let gzip = head.starts_with(&[0x1f, 0x8b]);
    if gzip {
        Ok(Box::new(flate2::bufread::MultiGzDecoder::new(buf)))
    } else {
        if let Input::File(p) = input {
            if has_gz_extension(p) && !head.is_empty() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "named .gz but not gzip (no 1f 8b magic bytes)",
                ));
            }
        }
        Ok(Box::new(buf))
    }
}

fn has_gz_extension(p: &Path) -> bool {
    p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gz"))
}

/// The reader thread: every input in order, as chunks of whole lines.
pub(crate) struct Reader {
    pub(crate) rx: Receiver<Msg>,
    /// Used chunks go back here to be refilled.
    pub(crate) recycle: Sender<Vec<u8>>,
    pub(crate) handle: JoinHandle<()>,
}

pub(crate) fn spawn(inputs: Vec<Input>, read: Arc<AtomicU64>) -> io::Result<Reader> {
    let (tx, rx) = mpsc::sync_channel::<Msg>(4);
    let (recycle, spare) = mpsc::channel::<Vec<u8>>();
    let handle = std::thread::Builder::new()
        .name("replay-reader".into())
        .spawn(move || {
            for (i, input) in inputs.iter().enumerate() {
                if tx.send(Msg::Start { input: i }).is_err() {
                    return;
                }
                if let Err(e) = read_one(input, &read, &tx, &spare) {
                    let msg = Msg::Error {
                        input: i,
                        error: e.to_string(),
                    };
                    if tx.send(msg).is_err() {
                        return;
                    }
                }
            }
        })?;
    Ok(Reader {
        rx,
        recycle,
        handle,
    })
}

fn read_one(
    input: &Input,
    read: &Arc<AtomicU64>,
    tx: &SyncSender<Msg>,
    spare: &Receiver<Vec<u8>>,
) -> io::Result<()> {
    let mut r = open(input, read.clone())?;
    // `buf[..filled]` holds data; the rest is initialized room to read into.
    let mut buf: Vec<u8> = spare.try_recv().unwrap_or_default();
    let mut filled = 0;
    // Inside a line over MAX_LINE: discard up to its newline.
    let mut skipping = false;
    let send = |msg: Msg| tx.send(msg).is_ok();
    loop {
        if buf.len() < filled + CHUNK {
            buf.resize((filled + CHUNK).max(CHUNK * 2), 0);
        }
        let n = match r.read(&mut buf[filled..filled + CHUNK]) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // Whole lines read before the error still count.
                if skipping {
                    send(Msg::TooLong);
                } else if let Some(p) = memchr::memrchr(b'\n', &buf[..filled]) {
                    send(Msg::Chunk { buf, len: p + 1 });
                }
                return Err(e);
            }
        };
        if skipping {
            // Only the new bytes can hold the end of the long line.
            match memchr::memchr(b'\n', &buf[filled..filled + n]) {
                Some(p) => {
                    buf.copy_within(filled + p + 1..filled + n, 0);
                    filled = n - (p + 1);
                    skipping = false;
                    if !send(Msg::TooLong) {
                        return Ok(());
                    }
                }
                None if n == 0 => {
                    send(Msg::TooLong);
                    return Ok(());
                }
                None => {}
            }
            continue;
        }
        filled += n;
        if n == 0 {
            if filled > 0 {
                send(Msg::Chunk { buf, len: filled });
            }
            return Ok(());
        }
        if filled < CHUNK {
            continue;
        }
        // Send everything up to the last newline; keep the partial line.
        if let Some(p) = memchr::memrchr(b'\n', &buf[..filled]) {
            let mut next = spare.try_recv().unwrap_or_default();
            let rest = filled - (p + 1);
            if next.len() < rest + CHUNK {
                next.resize((rest + CHUNK).max(CHUNK * 2), 0);
            }
            next[..rest].copy_from_slice(&buf[p + 1..filled]);
            if !send(Msg::Chunk { buf, len: p + 1 }) {
                return Ok(());
            }
            buf = next;
            filled = rest;
        } else if filled > MAX_LINE {
            // No newline in 16 MiB: not a log line. Drop it to its end
            // rather than hold it, or replay a piece of it as a line.
            skipping = true;
            filled = 0;
            buf.truncate(CHUNK * 2);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads `contents` through the reader thread; returns the chunks and
    /// the number of lines skipped as too long.
    fn read_all(name: &str, contents: &[u8]) -> (Vec<Vec<u8>>, usize) {
        let path = std::env::temp_dir().join(format!("trl-input-{}-{name}", std::process::id()));
        std::fs::write(&path, contents).unwrap();
        let reader = spawn(vec![Input::File(path.clone())], Arc::default()).unwrap();
        let (mut out, mut too_long) = (Vec::new(), 0);
        for msg in &reader.rx {
            match msg {
                Msg::Start { .. } => {}
                Msg::Chunk { buf, len } => {
                    out.push(buf[..len].to_vec());
                    let _ = reader.recycle.send(buf);
                }
                Msg::TooLong => too_long += 1,
                Msg::Error { error, .. } => panic!("{error}"),
            }
        }
        reader.handle.join().unwrap();
        std::fs::remove_file(&path).unwrap();
        (out, too_long)
    }

    /// Lines across many chunk boundaries come out whole, in order, byte for
    /// byte; the recycled buffers (which keep old bytes past `len`) leak
    /// nothing into the next chunk.
    #[test]
    fn chunks_end_at_line_boundaries_and_lose_nothing() {
        let mut log = Vec::new();
        let mut i = 0u64;
        while log.len() < 5 * CHUNK + 123 {
            // Lines of varying length, some long.
            let len = 20 + (i * 7919) % 3000;
            log.extend(std::iter::repeat_n(b'a' + (i % 26) as u8, len as usize));
            log.push(b'\n');
            i += 1;
        }
        log.extend_from_slice(b"last line without a newline");
        let (chunks, too_long) = read_all("boundaries", &log);
        assert_eq!(too_long, 0);
        assert!(chunks.len() >= 5, "{} chunks", chunks.len());
        for c in &chunks[..chunks.len() - 1] {
            assert_eq!(c.last(), Some(&b'\n'));
        }
        assert_eq!(chunks.concat(), log);
    }

    /// A "line" over 16 MiB is skipped to its newline without being held
    /// whole or passed on in pieces (one of which could read as a request):
    /// the lines around it are intact.
    #[test]
    fn a_line_over_the_limit_is_skipped_to_its_end() {
        let mut log = b"before\n".to_vec();
        log.extend(std::iter::repeat_n(b'x', MAX_LINE + CHUNK + 5));
        log.extend_from_slice(b"\nnext line\n");
        let (chunks, too_long) = read_all("huge", &log);
        assert_eq!(too_long, 1);
        assert_eq!(chunks.concat(), b"before\nnext line\n");
        // At the end of the input, with no newline after it.
        let mut log = b"before\n".to_vec();
        log.extend(std::iter::repeat_n(b'x', MAX_LINE + 3 * CHUNK));
        let (chunks, too_long) = read_all("huge-last", &log);
        assert_eq!((chunks.concat(), too_long), (b"before\n".to_vec(), 1));
    }
}
