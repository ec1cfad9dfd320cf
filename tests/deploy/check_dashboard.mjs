// The Grafana dashboard's structure: unique panel ids and refIds, a data source variable
// every query uses, panels on the 24-column grid without overlaps, the panels the issue asks
// for, and metric names that exist in the services' sources (or are listed as pending).
// Usage: node check_dashboard.mjs SOURCE_DIR
import { execFileSync } from "node:child_process";
import { familyOf, kPendingMetrics, loadDashboard, loadRules, metricsOf } from "./dashboard_queries.mjs";

const sourceDir = process.argv[2];
if (!sourceDir) {
  console.error("usage: check_dashboard.mjs SOURCE_DIR");
  process.exit(2);
}
const failures = [];
const fail = (msg) => failures.push(msg);
const dash = loadDashboard(sourceDir);

if (!dash.uid || !dash.title || !(dash.schemaVersion >= 36)) fail("dashboard: uid, title or schemaVersion missing");
const dsVar = dash.templating?.list?.find((v) => v.type === "datasource" && v.query === "prometheus");
if (!dsVar) fail("dashboard: no prometheus data source variable");
const ids = new Set();
const cells = new Set();
const queries = [];
for (const p of dash.panels) {
  if (ids.has(p.id)) fail(`panel id ${p.id} repeated`);
  ids.add(p.id);
  const g = p.gridPos;
  if (!g || g.x < 0 || g.w < 1 || g.x + g.w > 24 || g.h < 1) fail(`panel ${p.title}: gridPos ${JSON.stringify(g)}`);
  for (let y = g.y; y < g.y + g.h; y++) {
    for (let x = g.x; x < g.x + g.w; x++) {
      if (cells.has(`${x},${y}`)) fail(`panel ${p.title} overlaps another at ${x},${y}`);
      cells.add(`${x},${y}`);
    }
  }
  if (p.type === "row") continue;
  if (!p.targets?.length) fail(`panel ${p.title}: no queries`);
  if (p.datasource?.uid !== `\${${dsVar?.name}}`) fail(`panel ${p.title}: data source is not the variable`);
  const refIds = new Set();
  for (const t of p.targets ?? []) {
    if (refIds.has(t.refId)) fail(`panel ${p.title}: refId ${t.refId} repeated`);
    refIds.add(t.refId);
    if (t.datasource?.uid !== p.datasource?.uid) fail(`panel ${p.title} ${t.refId}: another data source`);
    if (!t.expr) fail(`panel ${p.title} ${t.refId}: empty query`);
    queries.push(t.expr);
  }
}

// What the issue asks the dashboard to show, by the metric each needs.
const wanted = {
  "read backlog": "nq_streamer_read_backlog_bytes", "read throughput": "nq_streamer_read_bytes_total",
  "read latency": "nq_streamer_read_latency_seconds_bucket", "slot loads": "nq_streamer_slot_loads_total",
  "4-bit share": "nq_expert_calls_total", "MTP acceptance": "nq_spec_decode_num_accepted_tokens_total",
  "MTP accepted length": "nq_spec_decode_num_drafts_total", "decode tokens/s": "nq_generation_tokens_total",
  "TTFT": "nq_time_to_first_token_seconds_bucket", "inter-token latency": "nq_inter_token_latency_seconds_bucket",
  "queue depth": "nq_num_requests_waiting", "finish reasons": "nq_request_success_total",
  "GPU memory": "DCGM_FI_DEV_FB_USED",
};
const used = new Set(queries.flatMap(metricsOf));
for (const [what, metric] of Object.entries(wanted)) {
  if (!used.has(metric)) fail(`dashboard: no panel for ${what} (${metric})`);
}

// Every nq_ metric the dashboard and the rules read is registered somewhere in services/.
const registered = new Set(
  execFileSync("grep", ["-rhoE", '"nq_[a-z0-9_]+"', `${sourceDir}/services`], { encoding: "utf8" })
    .split("\n").filter(Boolean).map((s) => s.replaceAll('"', "")));
const ruleMetrics = loadRules(sourceDir).flatMap((r) => metricsOf(r.expr));
const recorded = new Set(loadRules(sourceDir).filter((r) => r.recording).map((r) => r.name));
for (const m of new Set([...used, ...ruleMetrics])) {
  if (m === "up" || recorded.has(m) || kPendingMetrics.includes(m)) continue;
  if (!registered.has(familyOf(m))) fail(`metric ${m} is registered by no service (nor listed as pending)`);
}

if (failures.length) {
  console.error(failures.join("\n"));
  process.exit(1);
}
console.log(`dashboard ok: ${ids.size} panels, ${queries.length} queries, metrics all registered or pending`);
