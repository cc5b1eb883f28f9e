//! The classic Prometheus text format (0.0.4) made from the OpenMetrics text the registry
//! encodes, for agents that read no OpenMetrics.

/// Rewrites OpenMetrics text as the classic format: a counter's family is named with its
/// `_total` suffix in `# HELP` and `# TYPE` (the classic format names families by their
/// samples), `unknown` becomes `untyped`, `info` a gauge, and `# UNIT` and `# EOF` go.
pub(super) fn from_openmetrics(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut help: Option<&str> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest);
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name, kind) = match kind {
                "counter" if !name.ends_with("_total") => (format!("{name}_total"), "counter"),
                "unknown" => (name.to_owned(), "untyped"),
                "info" => (format!("{name}_info"), "gauge"),
                other => (name.to_owned(), other),
            };
            if let Some(help) = help.take() {
                let text = help.split_once(' ').map_or("", |(_, t)| t);
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
            continue;
        }
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classic_text_names_counters_by_their_samples() {
        let om = "# HELP egress_x Things done.\n# TYPE egress_x counter\negress_x_total{a=\"b\"} 3\n\
                  # HELP egress_g Open now.\n# TYPE egress_g gauge\n# UNIT egress_g bytes\negress_g 2\n# EOF\n";
        assert_eq!(
            from_openmetrics(om),
            "# HELP egress_x_total Things done.\n# TYPE egress_x_total counter\negress_x_total{a=\"b\"} 3\n\
             # HELP egress_g Open now.\n# TYPE egress_g gauge\negress_g 2\n"
        );
        let real = super::super::Metrics::new();
        real.upstream("u").request(200);
        let classic = real.render_classic();
        assert!(
            classic.contains("# TYPE egress_upstream_requests_total counter"),
            "{classic}"
        );
        assert!(!classic.contains("# EOF"));
    }
}
