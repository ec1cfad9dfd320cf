// Checks `docker-compose config` output of deploy/compose.yaml against what the profiles
// promise, which Compose itself never checks: with the default profile (deploy/.env's
// COMPOSE_PROFILES) and with `--profile cpu` (which replaces it), exactly one router,
// streamer and worker-0 answer on the network, every service:X reference and dependency is
// enabled, GPUs are reserved only by the gpu set, only the router (and loopback monitoring)
// is published, model volumes are read-only, Prometheus's targets exist in both sets, and
// every build target is a Dockerfile stage whose runtime is non-root with a healthcheck.
// Usage: node check_compose.mjs SOURCE_DIR CONFIG.yaml
import fs from "node:fs";
import path from "node:path";
import YAML from "yaml";

const [sourceDir, configFile] = process.argv.slice(2);
if (!sourceDir || !configFile) {
  console.error("usage: check_compose.mjs SOURCE_DIR CONFIG.yaml");
  process.exit(2);
}
const failures = [];
const fail = (msg) => failures.push(msg);
const config = YAML.parse(fs.readFileSync(configFile, "utf8"));
const services = config.services;

// The default profile: COMPOSE_PROFILES in deploy/.env.
const dotenv = fs.readFileSync(path.join(sourceDir, "deploy/.env"), "utf8");
const defaultProfiles = /^COMPOSE_PROFILES=(.*)$/m.exec(dotenv)?.[1]?.split(",") ?? [];
if (defaultProfiles.join() !== "gpu") fail(`deploy/.env: COMPOSE_PROFILES=${defaultProfiles} (want gpu)`);

const prometheus = YAML.parse(fs.readFileSync(path.join(sourceDir, "deploy/prometheus/prometheus.yml"), "utf8"));
const targets = prometheus.scrape_configs.flatMap((sc) => sc.static_configs.flatMap((s) => s.targets));

const flag = (svc, name, fallback) =>
  (svc.command ?? []).find((a) => String(a).startsWith(`--${name}=`))?.split("=")[1] ?? fallback;
// Ports each nq service listens on (flag defaults: README's table).
const listens = (svc) => {
  const image = path.basename(String(svc.image)).split(":")[0];
  if (image === "router") return [flag(svc, "http_port", "8000"), flag(svc, "grpc_port", "8001")];
  if (image === "worker") return [flag(svc, "grpc_port", "8100"), flag(svc, "metrics_port", "8101")];
  if (image === "streamer") return [flag(svc, "grpc_port", "8200"), flag(svc, "metrics_port", "8201")];
  return [];
};
const gpuDevices = (svc) => svc.deploy?.resources?.reservations?.devices ?? [];

for (const profiles of [defaultProfiles, ["cpu"]]) {
  const label = `profile ${profiles}`;
  const enabled = Object.fromEntries(
    Object.entries(services).filter(([, s]) => !s.profiles || s.profiles.some((p) => profiles.includes(p))));
  // Network names: the service name and its aliases; each must be unique.
  const names = {};
  for (const [name, s] of Object.entries(enabled)) {
    const aliases = Object.values(s.networks ?? {}).flatMap((n) => n?.aliases ?? []);
    for (const n of [name, ...aliases]) {
      if (names[n]) fail(`${label}: network name ${n} is both ${names[n]} and ${name}`);
      names[n] = name;
    }
  }
  for (const want of ["router", "streamer", "worker-0", "prometheus", "grafana"]) {
    if (!names[want]) fail(`${label}: nothing answers as ${want}`);
  }
  for (const [name, s] of Object.entries(enabled)) {
    for (const dep of Object.keys(s.depends_on ?? {})) {
      if (!enabled[dep]) fail(`${label}: ${name} depends on ${dep}, which is not enabled`);
    }
    for (const key of ["ipc", "pid", "network_mode"]) {
      const ref = /^service:(.*)$/.exec(s[key] ?? "")?.[1];
      if (ref && !enabled[ref]) fail(`${label}: ${name} ${key}: service:${ref} is not enabled`);
    }
    const image = path.basename(String(s.image)).split(":")[0];
    // Workers join the streamer's IPC and PID namespaces (slot arenas; dead-worker cleanup).
    if (image === "worker") {
      const streamer = names.streamer;
      if (s.ipc !== `service:${streamer}` || s.pid !== `service:${streamer}`) {
        fail(`${label}: ${name} does not share the streamer's IPC and PID namespaces`);
      }
      if (enabled[streamer]?.ipc !== "shareable") fail(`${label}: ${streamer} ipc is not shareable`);
    }
    // GPUs: only in the gpu set, and every gpu worker has one.
    if (profiles.includes("cpu") && gpuDevices(s).length) fail(`${label}: ${name} reserves GPUs`);
    if (profiles.includes("gpu") && image === "worker" &&
        !gpuDevices(s).some((d) => (d.capabilities ?? []).includes("gpu") && d.device_ids?.length)) {
      fail(`${label}: ${name} reserves no GPU of its own`);
    }
    if (image === "worker" && flag(s, "backend", "cpu") !== (profiles.includes("cpu") ? "cpu" : "cuda")) {
      fail(`${label}: ${name} --backend=${flag(s, "backend", "cpu")}`);
    }
    // Published ports: the router's API anywhere, monitoring on loopback, nothing else.
    for (const p of s.ports ?? []) {
      const spec = typeof p === "string" ? p : `${p.host_ip ? `${p.host_ip}:` : ""}${p.published}:${p.target}`;
      if (image !== "router" && !spec.startsWith("127.0.0.1:")) fail(`${label}: ${name} publishes ${spec}`);
    }
    // Model and record volumes of the serving services are read-only.
    if (["router", "worker", "streamer"].includes(image)) {
      for (const v of s.volumes ?? []) {
        const spec = typeof v === "string" ? v : `${v.source}:${v.target}:${v.read_only ? "ro" : "rw"}`;
        if (!spec.endsWith(":ro")) fail(`${label}: ${name} mounts ${spec} writable`);
      }
      if (!s.healthcheck?.test) fail(`${label}: ${name} has no healthcheck`);
      else if (!s.healthcheck.test.join(" ").includes(`:${healthPort(s)}/health`)) {
        fail(`${label}: ${name} healthcheck ${s.healthcheck.test.join(" ")} is not its /health port`);
      }
    }
  }
  // The router talks to worker-0's gRPC port, the worker to the streamer's.
  const router = enabled[names.router];
  const worker = enabled[names["worker-0"]];
  const streamer = enabled[names.streamer];
  if (router && worker && flag(router, "worker_address") !== `worker-0:${listens(worker)[0]}`) {
    fail(`${label}: router --worker_address=${flag(router, "worker_address")}`);
  }
  if (worker && streamer && flag(worker, "streamer_address") !== `streamer:${listens(streamer)[0]}`) {
    fail(`${label}: worker --streamer_address=${flag(worker, "streamer_address")}`);
  }
  // Prometheus's targets: a metrics port of a service of this set.
  for (const t of targets) {
    const [host, port] = t.split(":");
    const svc = enabled[names[host]];
    if (!svc) fail(`${label}: Prometheus target ${t}: no service answers as ${host}`);
    else if (healthPort(svc) !== port) {
      fail(`${label}: Prometheus target ${t} is not ${host}'s metrics port (${listens(svc)})`);
    }
  }
  console.log(`${label}: ${Object.keys(enabled).sort().join(", ")}`);
}

// The HTTP port with /health and /metrics: the router's API port, the others' metrics port.
function healthPort(svc) {
  return listens(svc)[path.basename(String(svc.image)).startsWith("router") ? 0 : 1];
}

// Build targets are Dockerfile stages; the runtime stage runs as a non-root user and every
// service stage has a healthcheck and its binary as entrypoint.
const dockerfile = fs.readFileSync(path.join(sourceDir, "Dockerfile"), "utf8");
const stages = {};
let current = null;
for (const line of dockerfile.split("\n")) {
  const from = /^FROM\s+(\S+)\s+AS\s+(\S+)/i.exec(line);
  if (from) {
    current = from[2];
    stages[current] = { base: from[1], lines: [] };
  } else if (current) {
    stages[current].lines.push(line);
  }
}
const inStage = (stage, re) => stages[stage]?.lines.some((l) => re.test(l));
// A stage's effective USER: its own last USER line, else its base stage's.
const userOf = (stage) => {
  const users = (stages[stage]?.lines ?? []).filter((l) => /^USER\s/.test(l));
  if (users.length) return users.at(-1).split(/\s+/)[1];
  return stages[stages[stage]?.base] ? userOf(stages[stage].base) : "root";
};
for (const [name, s] of Object.entries(services)) {
  const target = s.build?.target;
  if (!target) continue;
  if (!stages[target]) {
    fail(`service ${name}: build target ${target} is not a Dockerfile stage`);
    continue;
  }
  const user = userOf(target);
  if (user.startsWith("0") || user.startsWith("root")) fail(`Dockerfile stage ${target} runs as ${user}`);
  if (["router", "worker", "streamer"].includes(target)) {
    if (!inStage(target, /^HEALTHCHECK\s/)) fail(`Dockerfile stage ${target} has no HEALTHCHECK`);
    if (!inStage(target, new RegExp(`^ENTRYPOINT \\["/usr/local/bin/nq-${target}"\\]`))) {
      fail(`Dockerfile stage ${target}: entrypoint is not nq-${target}`);
    }
  }
}

if (failures.length) {
  console.error(failures.join("\n"));
  process.exit(1);
}
console.log("compose: profiles, networks, volumes, ports and Dockerfile targets consistent");
