// The PromQL of deploy/grafana/nestquant.json and deploy/prometheus/alerts.yml, shared by
// check_dashboard.mjs and check_live.mjs.
import fs from "node:fs";
import path from "node:path";
import YAML from "yaml";

// Metrics the dashboard and rules read that no service exports yet. A panel may show them
// (empty) until they exist; check_live.mjs fails once one appears, so the list stays true.
//   DCGM_FI_DEV_FB_USED: GPU memory, from NVIDIA's dcgm-exporter, not from our services.
export const kPendingMetrics = [
  "DCGM_FI_DEV_FB_USED",
];

export function loadDashboard(sourceDir) {
  return JSON.parse(fs.readFileSync(path.join(sourceDir, "deploy/grafana/nestquant.json"), "utf8"));
}

// Every rule of alerts.yml: {group, name, expr}.
export function loadRules(sourceDir) {
  const file = YAML.parse(fs.readFileSync(path.join(sourceDir, "deploy/prometheus/alerts.yml"), "utf8"));
  return file.groups.flatMap((g) =>
    g.rules.map((r) => ({ group: g.name, name: r.alert ?? r.record, expr: r.expr, recording: !!r.record })));
}

// Grafana's variables as a query runs them: the rate window is a plain range here.
export function substitute(expr, rateWindow) {
  return expr.replaceAll("$__rate_interval", rateWindow);
}

// Metric names an expression reads (identifiers before a selector, range or grouping, minus
// PromQL's own words); a histogram's _bucket/_sum/_count series count as its family.
const kPromqlWords = new Set([
  "sum", "min", "max", "avg", "count", "rate", "irate", "increase", "deriv", "by", "without",
  "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool",
  "histogram_quantile", "scalar", "vector", "min_over_time", "max_over_time", "avg_over_time",
  "le", "topk", "bottomk", "abs", "clamp_min", "clamp_max", "time", "label_replace", "absent",
]);
export function metricsOf(expr) {
  const noStrings = expr.replace(/"[^"]*"/g, '""');
  const noGroupings = noStrings.replace(/\b(by|without|on|ignoring)\s*\([^)]*\)/g, "");
  const noMatchers = noGroupings.replace(/\{[^}]*\}/g, "{}").replace(/\[[^\]]*\]/g, "[]");
  const names = [...noMatchers.matchAll(/(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*/g)].map((m) => m[0]);
  return [...new Set(names.filter((n) => !kPromqlWords.has(n) && !/^\d/.test(n)))];
}
export function familyOf(metric) {
  return metric.replace(/_(bucket|sum|count)$/, "");
}
