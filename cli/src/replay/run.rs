//! Reading inputs: [`Replayer::run`] over every input, line by line, and
//! the input errors and over-long lines it records; then the report.

use super::input::{self, Input};
use super::{EngineImpl, ReplayError, Replayer, Report};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

impl Replayer {
    /// Starts a new input: line numbers restart at 1 and, with
    /// [`LogFormat::Auto`](crate::replay::LogFormat::Auto), the format is detected again.
    pub fn start_input(&mut self, name: &str) {
        name.clone_into(&mut self.input_name);
        self.line_no = 0;
        self.input_format = None;
        self.format_confirmed = false;
    }

    /// Records that the current input could not be read past its current
    /// line.
    pub fn input_error(&mut self, error: String) {
        let (name, line) = (self.input_name.clone(), self.line_no);
        self.collector.input_error(&name, line, error);
    }

    /// Counts a line of the current input that was longer than 16 MiB (the
    /// reader skipped it) as malformed.
    fn too_long_line(&mut self) {
        self.line_no += 1;
        self.collector.input.lines += 1;
        self.collector.issue(
            &self.input_name,
            self.line_no,
            "line longer than 16 MiB (skipped)",
            true,
        );
    }
    /// Replays every input in order: read (and decompressed) on a second
    /// thread, with a progress bar on stderr when `progress` is set, stderr
    /// is a terminal and the input is large (over 32 MiB, or stdin).
    ///
    /// Inputs that cannot be opened or are cut short are recorded in the
    /// report (`input.errors`) and the run goes on with the next.
    ///
    /// # Errors
    /// The reader thread cannot start, or [`Replayer::replay_line`] fails.
    pub fn run(&mut self, inputs: &[Input], progress: bool) -> Result<(), ReplayError> {
        let read = Arc::new(AtomicU64::new(0));
        let sizes: Option<u64> = inputs.iter().map(Input::len).sum();
        let show =
            progress && std::io::stderr().is_terminal() && sizes.is_none_or(|s| s > 32 << 20);
        let bar = if show {
            let bar = match sizes {
                Some(total) => indicatif::ProgressBar::new(total).with_style(
                    indicatif::ProgressStyle::with_template(
                        "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta}) {msg}",
                    )
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                ),
                None => indicatif::ProgressBar::new_spinner().with_style(
                    indicatif::ProgressStyle::with_template(
                        "{spinner} [{elapsed_precise}] {bytes} ({bytes_per_sec}) {msg}",
                    )
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
                ),
            };
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr_with_hz(4));
            bar
        } else {
            indicatif::ProgressBar::hidden()
        };
        let reader = input::spawn(inputs.to_vec(), read.clone())?;
        let mut result = Ok(());
        for msg in &reader.rx {
            match msg {
                input::Msg::Start { input } => {
                    let name = inputs.get(input).map(Input::name).unwrap_or_default();
                    self.start_input(&name);
                }
                input::Msg::Chunk { buf, len } => {
                    let mut rest = &buf[..len];
                    while !rest.is_empty() {
                        let (line, next) = match memchr::memchr(b'\n', rest) {
                            Some(p) => (&rest[..p], &rest[p + 1..]),
                            None => (rest, &[][..]),
                        };
                        if let Err(e) = self.replay_line(line) {
                            result = Err(e);
                            break;
                        }
                        rest = next;
                    }
                    let _ = reader.recycle.send(buf);
                    if result.is_err() {
                        break;
                    }
                    bar.set_position(read.load(Ordering::Relaxed));
                    bar.set_message(format!("{} lines", self.collector.input.lines));
                }
                input::Msg::TooLong => self.too_long_line(),
                input::Msg::Error { input, error } => {
                    let name = inputs.get(input).map(Input::name).unwrap_or_default();
                    if name != self.input_name {
                        self.start_input(&name);
                    }
                    self.input_error(error);
                }
            }
        }
        drop(reader.rx);
        let _ = reader.handle.join();
        bar.finish_and_clear();
        result
    }

    /// The report of everything replayed.
    pub fn finish(self) -> Report {
        let shadow_known = matches!(self.engine, EngineImpl::Direct(_));
        let candidates = self
            .policy_summary
            .iter()
            .filter_map(|t| self.handle.candidates_total(&t.name, self.top))
            .filter(|c| !c.candidates.is_empty())
            .collect();
        let mut report = self.collector.finish(
            self.engine_name,
            self.modes_name,
            self.policy_summary,
            self.routes.patterns().to_vec(),
            self.top,
            shadow_known,
        );
        report.candidates = candidates;
        report
    }
}
