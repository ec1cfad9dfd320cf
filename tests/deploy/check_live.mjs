// Against a Prometheus that scrapes a live cluster with deploy/prometheus's config: every job
// up, every rule loaded and healthy and none firing, and every expression of the dashboard
// and the rules evaluated without error; each query that reads only exported metrics returns
// data, each panel has data unless all it shows is pending (dashboard_queries.mjs), and a
// pending metric that appears fails the check so the list is kept true.
// Usage: node check_live.mjs wait|check SOURCE_DIR PROMETHEUS_URL
//   wait: until every job's target is up; check: all of the above (targets first).
import {
  familyOf, kPendingMetrics, loadDashboard, loadRules, metricsOf, substitute,
} from "./dashboard_queries.mjs";

const [mode, sourceDir, prom] = process.argv.slice(2);
if (!["wait", "check"].includes(mode) || !sourceDir || !prom) {
  console.error("usage: check_live.mjs wait|check SOURCE_DIR PROMETHEUS_URL");
  process.exit(2);
}
const kJobs = ["nq-router", "nq-streamer", "nq-worker"];
// Wide enough to hold the whole run, so counters that moved at start-up still show a rate.
const kRateWindow = "5m";
const failures = [];
const fail = (msg) => failures.push(msg);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function api(pathAndQuery) {
  const res = await fetch(`${prom}${pathAndQuery}`);
  const body = await res.json();
  if (body.status !== "success") throw new Error(`${pathAndQuery}: ${body.errorType}: ${body.error}`);
  return body.data;
}
const query = (expr) => api(`/api/v1/query?query=${encodeURIComponent(expr)}`);

// Until every job's target is up and has been scraped after the requests (a few scrapes).
const deadline = Date.now() + 60_000;
let health = {};
for (;;) {
  try {
    const { activeTargets } = await api("/api/v1/targets?state=active");
    health = Object.fromEntries(kJobs.map((j) => [j, activeTargets.filter((t) => t.labels.job === j)]));
    if (kJobs.every((j) => health[j].length === 1 && health[j][0].health === "up")) break;
  } catch {
    // Prometheus still starting.
  }
  if (Date.now() > deadline) {
    for (const j of kJobs) {
      fail(`job ${j}: ${JSON.stringify(health[j]?.map((t) => [t.scrapeUrl, t.health, t.lastError]))}`);
    }
    console.error(failures.join("\n"));
    process.exit(1);
  }
  await sleep(500);
}
console.log(`targets up: ${kJobs.map((j) => health[j][0].scrapeUrl).join(" ")}`);
if (mode === "wait") process.exit(0);
// Requests finished before this step started; three more scrapes and rule evaluations.
await sleep(3500);

const names = new Set(await api("/api/v1/label/__name__/values"));
for (const m of kPendingMetrics) {
  if ([...names].some((n) => familyOf(n) === m)) fail(`${m} is exported now: remove it from kPendingMetrics`);
}
const isPending = (expr) => metricsOf(expr).some((m) => kPendingMetrics.includes(m));

// Rules: loaded as in the file, evaluated without error, none firing on a healthy cluster.
const rules = loadRules(sourceDir);
const { groups } = await api("/api/v1/rules");
const loaded = groups.flatMap((g) => g.rules.map((r) => ({ ...r, group: g.name })));
for (const r of rules) {
  const l = loaded.find((x) => x.name === r.name && x.group === r.group);
  if (!l) fail(`rule ${r.name}: not loaded`);
  else if (l.health !== "ok") fail(`rule ${r.name}: health ${l.health} ${l.lastError ?? ""}`);
  else if (l.state === "firing") fail(`rule ${r.name}: firing on a healthy cluster`);
}
for (const r of rules) {
  try {
    await query(r.expr);
  } catch (e) {
    fail(`rule ${r.name}: ${e.message}`);
  }
}

// Dashboard: each target evaluates; exported-only targets have data; each panel has data.
let withData = 0;
let pendingQueries = 0;
const dash = loadDashboard(sourceDir);
for (const p of dash.panels.filter((x) => x.type !== "row")) {
  let panelData = false;
  const allPending = p.targets.every((t) => isPending(t.expr));
  for (const t of p.targets) {
    const expr = substitute(t.expr, kRateWindow);
    let result;
    try {
      result = (await query(expr)).result;
    } catch (e) {
      fail(`panel "${p.title}" ${t.refId}: ${e.message}`);
      continue;
    }
    // A sample that is NaN (e.g. a quantile of a histogram that saw nothing) shows nothing.
    const hasData = result.some((r) => !Number.isNaN(Number(r.value[1])));
    if (isPending(t.expr)) {
      pendingQueries++;
    } else if (!hasData) {
      fail(`panel "${p.title}" ${t.refId}: no data for ${expr}`);
    } else {
      withData++;
    }
    panelData ||= hasData;
  }
  if (!panelData && !allPending) fail(`panel "${p.title}": no data`);
}

if (failures.length) {
  console.error(failures.join("\n"));
  process.exit(1);
}
console.log(`prometheus live: ${rules.length} rules healthy, ${withData} dashboard queries with data, ` +
            `${pendingQueries} on pending metrics (${kPendingMetrics.join(", ")}) evaluated empty`);
