//! Prometheus metrics: a small registry of labelled counters and histograms, plus gauges
//! computed at scrape time from the process's own state, rendered in the text exposition
//! format 0.0.4 (`GET /metrics` on the health endpoint).
//!
//! - Counters and histograms are updated where the work happens ([`CounterVec::inc`],
//!   [`HistogramVec::observe`]); one mutex per family, held for a map update (the measured
//!   operations take milliseconds, so contention is not a concern).
//! - Gauges are never stored: a collector registered with [`Registry::collector`] reads the
//!   state when scraped and writes it through an [`Encoder`], so a gauge cannot drift from
//!   what it describes.
//!
//! Format (<https://prometheus.io/docs/instrumenting/exposition_formats/>): one `# HELP` and
//! one `# TYPE` line per family, then its samples; label values escape `\`, `"` and line
//! feeds, help text escapes `\` and line feeds; histogram buckets are cumulative, each
//! labelled `le`, ending with `le="+Inf"` (equal to `_count`), followed by `_sum` and `_count`.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

/// The `Content-Type` of the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Histogram buckets (seconds) for operations that take from about a millisecond to ten
/// seconds (CNI commands, volume operations).
pub const LATENCY_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Histogram buckets (seconds) for the steps inside one request (tens of microseconds to
/// tens of milliseconds).
pub const STEP_BUCKETS: &[f64] =
    &[0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1];

/// Times the steps of one request into a histogram labelled `(command, step)`: each
/// [`Steps::mark`] observes the time since the previous mark (or the start).
pub struct Steps<'a> {
    h: &'a HistogramVec,
    command: &'a str,
    last: std::time::Instant,
}

impl<'a> Steps<'a> {
    pub fn start(h: &'a HistogramVec, command: &'a str) -> Self {
        Steps { h, command, last: std::time::Instant::now() }
    }

    /// Like [`Steps::start`], from an earlier instant (time spent before the work began).
    pub fn since(h: &'a HistogramVec, command: &'a str, at: std::time::Instant) -> Self {
        Steps { h, command, last: at }
    }

    pub fn mark(&mut self, step: &str) {
        let now = std::time::Instant::now();
        self.h.observe(&[self.command, step], (now - self.last).as_secs_f64());
        self.last = now;
    }
}

/// `[a-zA-Z_:][a-zA-Z0-9_:]*`
pub fn valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `[a-zA-Z_][a-zA-Z0-9_]*`, not starting with `__` (reserved).
pub fn valid_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    !name.starts_with("__")
        && chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn check_names(name: &str, labels: &[&str]) {
    assert!(valid_metric_name(name), "invalid metric name {name:?}");
    for l in labels {
        assert!(valid_label_name(l), "invalid label name {l:?} on {name}");
    }
    let distinct: HashSet<&&str> = labels.iter().collect();
    assert_eq!(distinct.len(), labels.len(), "duplicate label name on {name}");
}

/// A label value in the text format: `\` → `\\`, `"` → `\"`, line feed → `\n`.
pub fn escape_label_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Help text in the text format: `\` → `\\`, line feed → `\n`.
pub fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A sample value: `+Inf`, `-Inf`, `NaN`; integers below 10^15 without a fraction; other
/// values of 10^15 and more in exponent form (they are floats: an IPv6 block's size is not
/// exact, and a plain integer would claim it is); else the shortest decimal that reads back
/// as the same `f64`.
pub fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf".into() } else { "-Inf".into() }
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else if v.abs() >= 1e15 {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// The gRPC status code's canonical name, as other Prometheus exporters label it
/// (`OK`, `NotFound`, `InvalidArgument`, …).
pub fn grpc_code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "Canceled",
        Unknown => "Unknown",
        InvalidArgument => "InvalidArgument",
        DeadlineExceeded => "DeadlineExceeded",
        NotFound => "NotFound",
        AlreadyExists => "AlreadyExists",
        PermissionDenied => "PermissionDenied",
        ResourceExhausted => "ResourceExhausted",
        FailedPrecondition => "FailedPrecondition",
        Aborted => "Aborted",
        OutOfRange => "OutOfRange",
        Unimplemented => "Unimplemented",
        Internal => "Internal",
        Unavailable => "Unavailable",
        DataLoss => "DataLoss",
        Unauthenticated => "Unauthenticated",
    }
}

/// Seconds since the Unix epoch (for `…_timestamp_seconds` gauges).
pub fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Name, help and label names of a family.
#[derive(Debug, Clone)]
struct Desc {
    name: String,
    help: String,
    labels: Vec<String>,
}

impl Desc {
    fn new(name: &str, help: &str, labels: &[&str]) -> Self {
        check_names(name, labels);
        Desc { name: name.into(), help: help.into(), labels: labels.iter().map(|s| s.to_string()).collect() }
    }

    /// The label values of one child. A wrong number of values is a programming error:
    /// missing ones are empty, extra ones ignored (and debug builds panic).
    fn key(&self, values: &[&str]) -> Vec<String> {
        debug_assert_eq!(values.len(), self.labels.len(), "label values for {}", self.name);
        (0..self.labels.len()).map(|i| values.get(i).map(|v| v.to_string()).unwrap_or_default()).collect()
    }
}

/// A counter family with labels (monotonic; starts at 0 for each label set on first use).
#[derive(Debug)]
pub struct CounterVec {
    desc: Desc,
    values: Mutex<BTreeMap<Vec<String>, u64>>,
}

impl CounterVec {
    /// Panics on an invalid metric or label name (names are constants in the code).
    pub fn new(name: &str, help: &str, labels: &[&str]) -> Arc<Self> {
        Arc::new(CounterVec { desc: Desc::new(name, help, labels), values: Mutex::new(BTreeMap::new()) })
    }

    pub fn inc(&self, labels: &[&str]) {
        self.inc_by(labels, 1);
    }

    pub fn inc_by(&self, labels: &[&str], n: u64) {
        let key = self.desc.key(labels);
        let mut v = self.values.lock().unwrap();
        let c = v.entry(key).or_insert(0);
        *c = c.saturating_add(n);
    }

    /// The current value for a label set (0 when never incremented).
    pub fn get(&self, labels: &[&str]) -> u64 {
        self.values.lock().unwrap().get(&self.desc.key(labels)).copied().unwrap_or(0)
    }

    fn encode(&self, enc: &mut Encoder) {
        let rows: Vec<(Vec<String>, u64)> = self.values.lock().unwrap().iter().map(|(k, v)| (k.clone(), *v)).collect();
        if !enc.header(&self.desc.name, &self.desc.help, "counter") {
            return;
        }
        for (values, v) in rows {
            enc.sample(&self.desc.name, &self.desc.labels, &values, None, &v.to_string());
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct HistogramState {
    /// Observations per bucket (not cumulative): `counts[i]` holds those in
    /// `(bounds[i-1], bounds[i]]`; larger ones are only in `count`.
    counts: Vec<u64>,
    count: u64,
    sum: f64,
}

/// One label set's histogram: cumulative bucket counts (one per bound, `+Inf` excluded),
/// the observation count and their sum.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    pub cumulative: Vec<u64>,
    pub count: u64,
    pub sum: f64,
}

/// A histogram family with labels and fixed bucket upper bounds.
#[derive(Debug)]
pub struct HistogramVec {
    desc: Desc,
    bounds: Vec<f64>,
    values: Mutex<BTreeMap<Vec<String>, HistogramState>>,
}

impl HistogramVec {
    /// `bounds`: finite, strictly increasing upper bounds (`+Inf` is implied). Panics on
    /// bad bounds or names, and on a label called `le` (reserved for the buckets).
    pub fn new(name: &str, help: &str, labels: &[&str], bounds: &[f64]) -> Arc<Self> {
        assert!(!labels.contains(&"le"), "{name}: `le` is reserved for histogram buckets");
        assert!(!bounds.is_empty(), "{name}: no buckets");
        assert!(bounds.iter().all(|b| b.is_finite()), "{name}: bucket bounds must be finite");
        assert!(bounds.windows(2).all(|w| w[0] < w[1]), "{name}: bucket bounds must increase");
        Arc::new(HistogramVec {
            desc: Desc::new(name, help, labels),
            bounds: bounds.to_vec(),
            values: Mutex::new(BTreeMap::new()),
        })
    }

    /// Record one observation. NaN counts (in `+Inf` only) and makes the sum NaN, as in
    /// the reference client libraries.
    pub fn observe(&self, labels: &[&str], v: f64) {
        let key = self.desc.key(labels);
        let mut map = self.values.lock().unwrap();
        let st =
            map.entry(key).or_insert_with(|| HistogramState { counts: vec![0; self.bounds.len()], count: 0, sum: 0.0 });
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            st.counts[i] += 1;
        }
        st.count += 1;
        st.sum += v;
    }

    pub fn snapshot(&self, labels: &[&str]) -> Option<HistogramSnapshot> {
        self.values.lock().unwrap().get(&self.desc.key(labels)).map(Self::cumulate)
    }

    fn cumulate(st: &HistogramState) -> HistogramSnapshot {
        let mut acc = 0;
        let cumulative = st
            .counts
            .iter()
            .map(|c| {
                acc += c;
                acc
            })
            .collect();
        HistogramSnapshot { cumulative, count: st.count, sum: st.sum }
    }

    fn encode(&self, enc: &mut Encoder) {
        let rows: Vec<(Vec<String>, HistogramSnapshot)> =
            self.values.lock().unwrap().iter().map(|(k, st)| (k.clone(), Self::cumulate(st))).collect();
        let name = &self.desc.name;
        if !enc.header(name, &self.desc.help, "histogram") {
            return;
        }
        let bucket = format!("{name}_bucket");
        for (values, h) in rows {
            for (bound, c) in self.bounds.iter().zip(&h.cumulative) {
                enc.sample(&bucket, &self.desc.labels, &values, Some(&format_value(*bound)), &c.to_string());
            }
            enc.sample(&bucket, &self.desc.labels, &values, Some("+Inf"), &h.count.to_string());
            enc.sample(&format!("{name}_sum"), &self.desc.labels, &values, None, &format_value(h.sum));
            enc.sample(&format!("{name}_count"), &self.desc.labels, &values, None, &h.count.to_string());
        }
    }
}

/// Writes families in the text format; collectors write their scrape-time gauges with it.
/// A family name written twice keeps its first occurrence (the second is dropped and
/// logged: the format forbids repeating a family).
#[derive(Default)]
pub struct Encoder {
    out: String,
    seen: HashSet<String>,
}

impl Encoder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn finish(self) -> String {
        self.out
    }

    /// `# HELP` and `# TYPE`; false (nothing written) for a repeated family.
    fn header(&mut self, name: &str, help: &str, kind: &str) -> bool {
        debug_assert!(valid_metric_name(name), "invalid metric name {name:?}");
        if !self.seen.insert(name.to_string()) {
            tracing::error!(metric = name, "metric family written twice; dropping the repeat");
            return false;
        }
        let _ = writeln!(self.out, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
        true
    }

    fn sample(&mut self, name: &str, labels: &[String], values: &[String], le: Option<&str>, value: &str) {
        self.out.push_str(name);
        if !labels.is_empty() || le.is_some() {
            self.out.push('{');
            let mut first = true;
            for (l, v) in labels.iter().zip(values) {
                if !first {
                    self.out.push(',');
                }
                first = false;
                let _ = write!(self.out, "{l}=\"{}\"", escape_label_value(v));
            }
            if let Some(le) = le {
                if !first {
                    self.out.push(',');
                }
                let _ = write!(self.out, "le=\"{le}\"");
            }
            self.out.push('}');
        }
        self.out.push(' ');
        self.out.push_str(value);
        self.out.push('\n');
    }

    /// A gauge family without labels.
    pub fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.gauge_vec(name, help, &[], [(Vec::<String>::new(), value)]);
    }

    /// A gauge family: one sample per row of label values (in `labels` order). An empty
    /// `rows` writes the family with no samples (a gauge with nothing to report now).
    pub fn gauge_vec<I>(&mut self, name: &str, help: &str, labels: &[&str], rows: I)
    where
        I: IntoIterator<Item = (Vec<String>, f64)>,
    {
        debug_assert!(labels.iter().all(|l| valid_label_name(l)), "invalid label name on {name}");
        if !self.header(name, help, "gauge") {
            return;
        }
        let labels: Vec<String> = labels.iter().map(|s| s.to_string()).collect();
        for (values, v) in rows {
            debug_assert_eq!(values.len(), labels.len(), "label values for {name}");
            self.sample(name, &labels, &values, None, &format_value(v));
        }
    }
}

/// Something that writes families at scrape time.
pub type Collector = Box<dyn Fn(&mut Encoder) + Send + Sync>;

enum Item {
    Counter(Arc<CounterVec>),
    Histogram(Arc<HistogramVec>),
    Collector(Collector),
}

/// The families a process exposes, rendered in registration order.
#[derive(Default)]
pub struct Registry {
    items: Mutex<Vec<Item>>,
}

impl Registry {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Create and register a counter family.
    pub fn counter(&self, name: &str, help: &str, labels: &[&str]) -> Arc<CounterVec> {
        let c = CounterVec::new(name, help, labels);
        self.register_counter(c.clone());
        c
    }

    /// Create and register a histogram family.
    pub fn histogram(&self, name: &str, help: &str, labels: &[&str], bounds: &[f64]) -> Arc<HistogramVec> {
        let h = HistogramVec::new(name, help, labels, bounds);
        self.register_histogram(h.clone());
        h
    }

    /// Expose a counter family made elsewhere (a part that counts whether or not it is scraped).
    pub fn register_counter(&self, c: Arc<CounterVec>) {
        self.items.lock().unwrap().push(Item::Counter(c));
    }

    pub fn register_histogram(&self, h: Arc<HistogramVec>) {
        self.items.lock().unwrap().push(Item::Histogram(h));
    }

    /// Run `f` at every scrape (it should be quick: it holds the registry meanwhile).
    pub fn collector(&self, f: impl Fn(&mut Encoder) + Send + Sync + 'static) {
        self.items.lock().unwrap().push(Item::Collector(Box::new(f)));
    }

    /// Everything, in the text format.
    pub fn render(&self) -> String {
        let mut enc = Encoder::new();
        for item in self.items.lock().unwrap().iter() {
            match item {
                Item::Counter(c) => c.encode(&mut enc),
                Item::Histogram(h) => h.encode(&mut enc),
                Item::Collector(f) => f(&mut enc),
            }
        }
        enc.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["a", "_a", "a:b", "nodeplane_cni_operations_total", "A1_"] {
            assert!(valid_metric_name(ok), "{ok}");
        }
        for bad in ["", "1a", "a-b", "a b", "é", "a.b"] {
            assert!(!valid_metric_name(bad), "{bad}");
        }
        for ok in ["a", "_a", "le", "block1"] {
            assert!(valid_label_name(ok), "{ok}");
        }
        for bad in ["", "1a", "a:b", "__name__", "__x", "a-b"] {
            assert!(!valid_label_name(bad), "{bad}");
        }
    }

    #[test]
    #[should_panic(expected = "invalid metric name")]
    fn bad_metric_name_panics() {
        CounterVec::new("bad-name", "h", &[]);
    }

    #[test]
    #[should_panic(expected = "reserved")]
    fn le_label_is_reserved() {
        HistogramVec::new("h", "h", &["le"], &[1.0]);
    }

    #[test]
    #[should_panic(expected = "increase")]
    fn unsorted_buckets_panic() {
        HistogramVec::new("h", "h", &[], &[1.0, 0.5]);
    }

    #[test]
    fn escaping() {
        assert_eq!(escape_label_value(r#"a"b\c"#), r#"a\"b\\c"#);
        assert_eq!(escape_label_value("line1\nline2"), r"line1\nline2");
        assert_eq!(escape_label_value("plain /x:y{}=,"), "plain /x:y{}=,");
        assert_eq!(escape_help("a\\b\nc \"q\""), "a\\\\b\\nc \"q\"");
    }

    #[test]
    fn values() {
        assert_eq!(format_value(0.0), "0");
        assert_eq!(format_value(3.0), "3");
        assert_eq!(format_value(-2.0), "-2");
        assert_eq!(format_value(0.25), "0.25");
        assert_eq!(format_value(0.001), "0.001");
        assert_eq!(format_value(f64::INFINITY), "+Inf");
        assert_eq!(format_value(f64::NEG_INFINITY), "-Inf");
        assert_eq!(format_value(f64::NAN), "NaN");
        // Huge values (an IPv6 /64 block's size) are written as the floats they are.
        let big = 18446744073709551614u128 as f64;
        assert_eq!(format_value(big), "1.8446744073709552e19");
        assert_eq!(format_value(big).parse::<f64>().unwrap(), big);
        assert_eq!(format_value(-1e300), "-1e300");
        assert_eq!(format_value(999_999_999_999_999.0), "999999999999999");
        assert_eq!(format_value(1e15), "1e15");
    }

    #[test]
    fn counter_format() {
        let r = Registry::new();
        let c = r.counter("x_total", "Things done.\nSecond line with \\.", &["command", "result"]);
        assert_eq!(r.render(), "# HELP x_total Things done.\\nSecond line with \\\\.\n# TYPE x_total counter\n");
        c.inc(&["ADD", "ok"]);
        c.inc(&["ADD", "ok"]);
        c.inc_by(&["DEL", "4"], 3);
        c.inc(&["ADD", "say \"hi\"\n"]);
        assert_eq!(c.get(&["ADD", "ok"]), 2);
        assert_eq!(c.get(&["CHECK", "ok"]), 0);
        assert_eq!(
            r.render(),
            concat!(
                "# HELP x_total Things done.\\nSecond line with \\\\.\n",
                "# TYPE x_total counter\n",
                "x_total{command=\"ADD\",result=\"ok\"} 2\n",
                "x_total{command=\"ADD\",result=\"say \\\"hi\\\"\\n\"} 1\n",
                "x_total{command=\"DEL\",result=\"4\"} 3\n",
            )
        );
    }

    #[test]
    fn histogram_bucket_math() {
        let h = HistogramVec::new("op_seconds", "Latency.", &["command"], &[0.01, 0.1, 1.0]);
        for v in [0.005, 0.01, 0.05, 0.1000001, 0.7, 3.0, 100.0] {
            h.observe(&["ADD"], v);
        }
        let s = h.snapshot(&["ADD"]).unwrap();
        // A value equal to a bound falls in that bound's bucket (le = "less or equal").
        assert_eq!(s.cumulative, vec![2, 3, 5]);
        assert_eq!(s.count, 7);
        assert!((s.sum - 103.8650001).abs() < 1e-9, "{}", s.sum);
        assert!(h.snapshot(&["DEL"]).is_none());
        h.observe(&["DEL"], f64::NAN);
        let d = h.snapshot(&["DEL"]).unwrap();
        assert_eq!((d.cumulative.clone(), d.count), (vec![0, 0, 0], 1));
        assert!(d.sum.is_nan());
    }

    #[test]
    fn histogram_format() {
        let r = Registry::new();
        let h = r.histogram("lat_seconds", "Latency.", &["command", "result"], &[0.005, 0.5, 2.0]);
        h.observe(&["ADD", "ok"], 0.00390625);
        h.observe(&["ADD", "ok"], 0.25);
        h.observe(&["ADD", "ok"], 7.0);
        let unlabelled = r.histogram("plain_seconds", "No labels.", &[], &[1.0]);
        unlabelled.observe(&[], 0.5);
        assert_eq!(
            r.render(),
            concat!(
                "# HELP lat_seconds Latency.\n",
                "# TYPE lat_seconds histogram\n",
                "lat_seconds_bucket{command=\"ADD\",result=\"ok\",le=\"0.005\"} 1\n",
                "lat_seconds_bucket{command=\"ADD\",result=\"ok\",le=\"0.5\"} 2\n",
                "lat_seconds_bucket{command=\"ADD\",result=\"ok\",le=\"2\"} 2\n",
                "lat_seconds_bucket{command=\"ADD\",result=\"ok\",le=\"+Inf\"} 3\n",
                "lat_seconds_sum{command=\"ADD\",result=\"ok\"} 7.25390625\n",
                "lat_seconds_count{command=\"ADD\",result=\"ok\"} 3\n",
                "# HELP plain_seconds No labels.\n",
                "# TYPE plain_seconds histogram\n",
                "plain_seconds_bucket{le=\"1\"} 1\n",
                "plain_seconds_bucket{le=\"+Inf\"} 1\n",
                "plain_seconds_sum 0.5\n",
                "plain_seconds_count 1\n",
            )
        );
    }

    #[test]
    fn gauges_from_collectors_and_duplicates() {
        let r = Registry::new();
        let state = Arc::new(Mutex::new(vec![("10.0.0.0/24".to_string(), 3.0)]));
        let s = state.clone();
        r.collector(move |enc| {
            enc.gauge("up", "Always one.", 1.0);
            let rows: Vec<(Vec<String>, f64)> = s.lock().unwrap().iter().map(|(b, v)| (vec![b.clone()], *v)).collect();
            enc.gauge_vec("blocks", "Per block.", &["block"], rows);
            enc.gauge_vec("empty", "Nothing now.", &["x"], []);
            // A repeat is dropped, not written twice.
            enc.gauge("up", "Again.", 2.0);
        });
        let first = r.render();
        assert_eq!(
            first,
            concat!(
                "# HELP up Always one.\n# TYPE up gauge\nup 1\n",
                "# HELP blocks Per block.\n# TYPE blocks gauge\nblocks{block=\"10.0.0.0/24\"} 3\n",
                "# HELP empty Nothing now.\n# TYPE empty gauge\n",
            )
        );
        // Computed at scrape time: the next scrape sees the new state.
        state.lock().unwrap().push(("fd00::/64".into(), 0.5));
        assert!(r.render().contains("blocks{block=\"fd00::/64\"} 0.5\n"));
    }

    #[test]
    fn concurrent_updates_are_not_lost() {
        let c = CounterVec::new("c_total", "h", &["k"]);
        let h = HistogramVec::new("h_seconds", "h", &["k"], LATENCY_BUCKETS);
        std::thread::scope(|s| {
            for t in 0..8 {
                let (c, h) = (&c, &h);
                s.spawn(move || {
                    for i in 0..1000 {
                        c.inc(&[if t % 2 == 0 { "even" } else { "odd" }]);
                        h.observe(&["x"], i as f64 / 1000.0);
                    }
                });
            }
        });
        assert_eq!(c.get(&["even"]) + c.get(&["odd"]), 8000);
        let s = h.snapshot(&["x"]).unwrap();
        assert_eq!(s.count, 8000);
        assert_eq!(*s.cumulative.last().unwrap(), 8000, "every value is ≤ 10 s");
        // 0.000 and 0.001 are ≤ 1 ms: 2 per thread.
        assert_eq!(s.cumulative[0], 16);
    }

    #[test]
    fn grpc_code_names() {
        assert_eq!(grpc_code_name(tonic::Code::Ok), "OK");
        assert_eq!(grpc_code_name(tonic::Code::Cancelled), "Canceled");
        assert_eq!(grpc_code_name(tonic::Code::PermissionDenied), "PermissionDenied");
    }
}
