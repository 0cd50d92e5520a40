//! Prometheus metrics over the `prometheus-client` crate, served in the text exposition format
//! 0.0.4 (`GET /metrics` on the health endpoint).
//!
//! - Counters and histograms are the crate's [`Family`] of [`Counter`] or [`Histogram`] over a
//!   typed label set (`#[derive(EncodeLabelSet)]`), updated where the work happens and
//!   exposed with [`Registry::register`].
//! - Gauges are never stored: a [`Collector`] registered with [`Registry::register_collector`]
//!   reads the state when scraped and writes it with [`gauge`] and [`gauges`], so a gauge
//!   cannot drift from what it describes.
//!
//! The crate writes the format (escaping, cumulative buckets ending in `le="+Inf"`, `_sum`
//! and `_count`) with its `prometheus_text` encoder. Its default encoder writes OpenMetrics,
//! which is not valid as text 0.0.4 (a counter's TYPE line names `x` above samples named
//! `x_total`, and the body ends in `# EOF`); the 0.0.4 encoder names counters `x_total`
//! throughout, so the exposition keeps its content type and every name scrapers and
//! dashboards read. A counter is registered without the `_total` the encoder adds.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, prometheus_text};
use prometheus_client::metrics::MetricType;
pub use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::{counter::Counter, family::Family};

/// The `Content-Type` of the text format 0.0.4.
pub use prometheus_text::CONTENT_TYPE;

/// Histogram buckets (seconds) for operations that take from about a millisecond to ten
/// seconds (CNI commands, volume operations).
pub const LATENCY_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Histogram buckets (seconds) for the steps inside one request (tens of microseconds to
/// tens of milliseconds).
pub const STEP_BUCKETS: &[f64] =
    &[0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1];

/// A counter per label set.
pub type Counters<L> = Family<L, Counter>;

/// A histogram per label set, each made by a constructor such as [`latency_histogram`].
pub type Histograms<L> = Family<L, Histogram>;

/// A histogram over [`LATENCY_BUCKETS`] (a [`Family`]'s constructor).
pub fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS.iter().copied())
}

/// A histogram over [`STEP_BUCKETS`].
pub fn step_histogram() -> Histogram {
    Histogram::new(STEP_BUCKETS.iter().copied())
}

/// The labels of a step of one request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabels {
    pub command: &'static str,
    pub step: &'static str,
}

/// Times the steps of one request into histograms by command and step: each [`Steps::mark`]
/// observes the time since the previous mark (or the start).
pub struct Steps<'a> {
    h: &'a Histograms<StepLabels>,
    command: &'static str,
    last: Instant,
}

impl<'a> Steps<'a> {
    pub fn start(h: &'a Histograms<StepLabels>, command: &'static str) -> Self {
        Steps { h, command, last: Instant::now() }
    }

    pub fn mark(&mut self, step: &'static str) {
        let now = Instant::now();
        self.h.get_or_create(&StepLabels { command: self.command, step }).observe((now - self.last).as_secs_f64());
        self.last = now;
    }
}

/// The labels of an answered gRPC call: the method and the status code's name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcLabels {
    pub method: &'static str,
    pub code: &'static str,
}

impl GrpcLabels {
    pub fn new(method: &'static str, code: tonic::Code) -> Self {
        GrpcLabels { method, code: grpc_code_name(code) }
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

/// A gauge family without labels, written by a [`Collector`].
pub fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, value: impl EncodeGaugeValue) -> fmt::Result {
    enc.encode_descriptor(name, help, None, MetricType::Gauge)?.encode_gauge(&value)
}

/// A gauge family written by a [`Collector`]: one sample per label set (none: the family
/// without samples, a gauge with nothing to report now).
pub fn gauges<L: EncodeLabelSet, V: EncodeGaugeValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (L, V)>,
) -> fmt::Result {
    let mut family = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in rows {
        family.encode_family(&labels)?.encode_gauge(&value)?;
    }
    Ok(())
}

/// The families a process exposes. Registration takes `&self`: parts made later (the
/// controller's policy book) join a registry the health endpoint already renders.
#[derive(Default)]
pub struct Registry(Mutex<prometheus_client::registry::Registry>);

impl Registry {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Expose `metric` (a [`Family`], a [`Histogram`], …) as `name`. `help` is a sentence: the
    /// crate ends it with a full stop, so one given here is not doubled. A family without
    /// children is left out of the exposition until its first update.
    pub fn register(&self, name: &str, help: &str, metric: impl prometheus_client::registry::Metric) {
        self.0.lock().unwrap().register(name, help.strip_suffix('.').unwrap_or(help), metric);
    }

    /// Run `collector` at every scrape (it should be quick: it holds the registry meanwhile).
    pub fn register_collector(&self, collector: impl Collector) {
        self.0.lock().unwrap().register_collector(Box::new(collector));
    }

    /// Everything, in the text format: the registered metrics, then the collectors'.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String fails only when a collector fails; the health endpoint
        // answers 500 for the panic.
        prometheus_text::encode(&mut out, &self.0.lock().unwrap()).expect("encoding the metrics");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Sample = (String, Vec<(String, String)>, f64);

    /// A strict reader of the text format 0.0.4: every family is `# HELP`, `# TYPE`, then
    /// its samples, each named as the family (a histogram's `_bucket`, `_sum` or `_count`),
    /// with well-formed, unescaped labels and a number.
    fn parse(text: &str) -> Vec<Sample> {
        assert!(text.is_empty() || text.ends_with('\n'), "ends with a line feed");
        let (mut samples, mut families) = (Vec::new(), std::collections::HashSet::new());
        let mut family: Option<(&str, &str)> = None;
        let mut lines = text.lines();
        while let Some(line) = lines.next() {
            if let Some(help) = line.strip_prefix("# HELP ") {
                let name = help.split(' ').next().unwrap();
                assert!(families.insert(name), "{name} twice");
                let ty = lines.next().and_then(|l| l.strip_prefix("# TYPE ")).expect("TYPE after HELP");
                let (typed, kind) = ty.split_once(' ').unwrap();
                assert!(typed == name && ["counter", "gauge", "histogram"].contains(&kind), "{ty}");
                family = Some((name, kind));
                continue;
            }
            let (fam, kind) = family.expect("a sample after a TYPE line");
            let end = line.find(['{', ' ']).unwrap();
            let name = &line[..end];
            let suffixes: &[&str] = if kind == "histogram" { &["_bucket", "_sum", "_count"] } else { &[""] };
            assert!(suffixes.iter().any(|s| name == format!("{fam}{s}")), "{name} under TYPE {fam}");
            let (mut labels, mut rest) = (Vec::new(), &line[end..]);
            if let Some(mut r) = rest.strip_prefix('{') {
                while let Some((key, after)) = r.split_once("=\"") {
                    assert!(!key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'), "{line}");
                    let (mut value, mut chars) = (String::new(), after.char_indices());
                    let close = loop {
                        match chars.next().expect("a closed label value") {
                            (_, '\\') => value.push(match chars.next().unwrap().1 {
                                'n' => '\n',
                                c @ ('\\' | '"') => c,
                                c => panic!("escape \\{c} in {line}"),
                            }),
                            (i, '"') => break i,
                            (_, c) => value.push(c),
                        }
                    };
                    labels.push((key.to_string(), value));
                    r = after[close + 1..].strip_prefix(',').unwrap_or(&after[close + 1..]);
                }
                rest = r.strip_prefix('}').expect("labels closed");
            }
            let value = rest.strip_prefix(' ').and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{line}"));
            samples.push((name.to_string(), labels, value));
        }
        samples
    }

    fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn a_counter_is_exposed_with_total_throughout() {
        let r = Registry::new();
        let requests = Counters::<GrpcLabels>::default();
        r.register("x_requests", "Calls answered.\nBy method and \\code.", requests.clone());
        assert_eq!(r.render(), "", "a family without children is left out");
        requests.get_or_create(&GrpcLabels::new("Register", tonic::Code::Ok)).inc_by(3);
        let text = r.render();
        assert_eq!(
            text,
            concat!(
                "# HELP x_requests_total Calls answered.\\nBy method and \\\\code.\n",
                "# TYPE x_requests_total counter\n",
                "x_requests_total{method=\"Register\",code=\"OK\"} 3\n",
            )
        );
        assert_eq!(parse(&text), [("x_requests_total".into(), labels(&[("method", "Register"), ("code", "OK")]), 3.0)]);
        assert_eq!(requests.get(&GrpcLabels::new("Register", tonic::Code::Cancelled)).map(|c| c.get()), None);
        assert_eq!(grpc_code_name(tonic::Code::Cancelled), "Canceled");
    }

    #[test]
    fn a_labelled_histogram_and_step_timing() {
        let r = Registry::new();
        let steps = Histograms::<StepLabels>::new_with_constructor(step_histogram);
        r.register("op_step_seconds", "Step times.", steps.clone());
        let mut s = Steps::start(&steps, "ADD");
        s.mark("prepare");
        let plain = Histogram::new([0.5, 2.0]);
        r.register("plain_seconds", "No labels.", plain.clone());
        plain.observe(0.25);
        plain.observe(7.0);
        let text = r.render();
        let samples = parse(&text);
        // One quick step: in every bucket (it takes well under 25 µs).
        let add = labels(&[("command", "ADD"), ("step", "prepare")]);
        let buckets: Vec<(String, f64)> = samples
            .iter()
            .filter(|(n, l, _)| n == "op_step_seconds_bucket" && l[..2] == add[..])
            .map(|(_, l, v)| (l[2].1.clone(), *v))
            .collect();
        let le: Vec<&str> = buckets.iter().map(|(le, _)| le.as_str()).collect();
        // Bounds as Go's client writes them (and Prometheus 3 normalizes `le` to).
        assert_eq!(
            le,
            [
                "2.5e-05", "5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.1",
                "+Inf"
            ]
        );
        assert!(buckets.iter().all(|(_, v)| *v == 1.0), "{text}");
        assert!(text.contains("op_step_seconds_count{command=\"ADD\",step=\"prepare\"} 1\n"), "{text}");
        assert!(
            text.ends_with(concat!(
                "# HELP plain_seconds No labels.\n",
                "# TYPE plain_seconds histogram\n",
                "plain_seconds_bucket{le=\"0.5\"} 1\n",
                "plain_seconds_bucket{le=\"2\"} 1\n",
                "plain_seconds_bucket{le=\"+Inf\"} 2\n",
                "plain_seconds_sum 7.25\n",
                "plain_seconds_count 2\n",
            )),
            "{text}"
        );
    }

    #[derive(Debug)]
    struct Blocks(Arc<Mutex<Vec<(String, u64)>>>);

    impl Collector for Blocks {
        fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
            gauge(&mut enc, "up", "Always one.", 1)?;
            let rows = self.0.lock().unwrap().clone();
            gauges(&mut enc, "blocks", "Per block.", rows.into_iter().map(|(b, n)| ([("block", b)], n)))?;
            gauges(&mut enc, "big", "A float.", [([("block", "fd00::/48")], 2f64.powi(80))])?;
            gauges::<[(&str, &str); 1], u64>(&mut enc, "empty", "Nothing now.", [])
        }
    }

    #[test]
    fn gauges_are_read_at_scrape_time() {
        let r = Registry::new();
        let state = Arc::new(Mutex::new(vec![("10.0.0.0/24".to_string(), 3)]));
        r.register_collector(Blocks(state.clone()));
        let text = r.render();
        assert_eq!(
            text,
            concat!(
                "# HELP up Always one.\n# TYPE up gauge\nup 1\n",
                "# HELP blocks Per block.\n# TYPE blocks gauge\nblocks{block=\"10.0.0.0/24\"} 3\n",
                "# HELP big A float.\n# TYPE big gauge\nbig{block=\"fd00::/48\"} 1.2089258196146293e24\n",
                "# HELP empty Nothing now.\n# TYPE empty gauge\n",
            )
        );
        assert_eq!(parse(&text)[2].2, 2f64.powi(80));
        // The next scrape sees the new state, escaped.
        state.lock().unwrap().push(("say \"hi\"\n\\".into(), 0));
        let text = r.render();
        assert!(text.contains("blocks{block=\"say \\\"hi\\\"\\n\\\\\"} 0\n"), "{text}");
        assert_eq!(parse(&text)[2].1, labels(&[("block", "say \"hi\"\n\\")]));
    }
}
