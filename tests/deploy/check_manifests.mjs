// Validates the objects `helm template` rendered: each against its Kubernetes API schema
// (kubernetes-models) or prometheus-operator's (ServiceMonitor, PrometheusRule), then the
// references between them that no schema sees (Service and NetworkPolicy ports to container
// ports, ServiceMonitor endpoints to Service ports, probes, GPUs, users, the dashboard and
// rules the chart carries against deploy/).
// Usage: node check_manifests.mjs SOURCE_DIR RENDERED.yaml TP_SIZE KIND=COUNT...
import fs from "node:fs";
import path from "node:path";
import YAML from "yaml";

const [sourceDir, renderedFile, tpArg, ...expectArgs] = process.argv.slice(2);
if (!sourceDir || !renderedFile || !tpArg) {
  console.error("usage: check_manifests.mjs SOURCE_DIR RENDERED.yaml TP_SIZE KIND=COUNT...");
  process.exit(2);
}
const tp = Number(tpArg);
const failures = [];
const fail = (msg) => failures.push(msg);

const objects = YAML.parseAllDocuments(fs.readFileSync(renderedFile, "utf8"))
  .map((doc) => {
    if (doc.errors.length) throw new Error(`${renderedFile}: ${doc.errors[0].message}`);
    return doc.toJS();
  })
  .filter((o) => o);

// apiVersion + kind -> the model module that validates it.
async function modelFor(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  if (group === "monitoring.coreos.com") {
    return (await import(`@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`))[kind];
  }
  const prefix = group === "" ? version : `${group}/${version}`;
  return (await import(`kubernetes-models/${prefix}/${kind}`))[kind];
}

for (const obj of objects) {
  const id = `${obj.kind}/${obj.metadata?.name}`;
  let Model;
  try {
    Model = await modelFor(obj.apiVersion, obj.kind);
  } catch (e) {
    fail(`${id}: no schema for ${obj.apiVersion} ${obj.kind} (${e.code ?? e.message})`);
    continue;
  }
  try {
    new Model(obj).validate();
    console.log(`schema ok: ${obj.apiVersion} ${id}`);
  } catch (e) {
    fail(`${id}: ${e.message}`);
  }
}

// Expected kinds and counts.
const counts = {};
for (const o of objects) counts[o.kind] = (counts[o.kind] ?? 0) + 1;
for (const arg of expectArgs) {
  const [kind, n] = arg.split("=");
  if ((counts[kind] ?? 0) !== Number(n)) fail(`expected ${n} ${kind}, rendered ${counts[kind] ?? 0}`);
}
const expectedKinds = new Set(expectArgs.map((a) => a.split("=")[0]));
for (const kind of Object.keys(counts)) {
  if (!expectedKinds.has(kind)) fail(`unexpected kind ${kind} rendered`);
}

// JSON with object keys sorted (helm's toYaml sorts them), to compare content.
const canonical = (v) =>
  JSON.stringify(v, (_, x) =>
    x && typeof x === "object" && !Array.isArray(x)
      ? Object.fromEntries(Object.keys(x).sort().map((k) => [k, x[k]]))
      : x);
const byKind = (kind) => objects.filter((o) => o.kind === kind);
const matches = (selector, labels) =>
  Object.entries(selector ?? {}).every(([k, v]) => labels?.[k] === v);
// Workloads with a pod template: Deployments, and the engine's StatefulSet (engine.nodes > 1).
const workloads = () => [...byKind("Deployment"), ...byKind("StatefulSet")];
const podsOf = (selector) => workloads().filter((d) => matches(selector, d.spec.template.metadata.labels));
const containerPorts = (deployment) =>
  deployment.spec.template.spec.containers.flatMap((c) => c.ports ?? []);

// Container rules: non-root, read-only root, health probes on a declared port: gRPC health, or
// HTTP /health (which mirrors it) where the gRPC port is loopback-only or needs a client
// certificate kubelet cannot present.
for (const d of workloads()) {
  const pod = d.spec.template.spec;
  if (pod.securityContext?.runAsNonRoot !== true) fail(`${d.metadata.name}: pod may run as root`);
  if (pod.automountServiceAccountToken !== false) fail(`${d.metadata.name}: mounts a service account token`);
  const declared = new Set(containerPorts(d).flatMap((p) => [p.containerPort, p.name].filter((v) => v !== undefined)));
  for (const c of pod.containers) {
    const where = `${d.metadata.name}/${c.name}`;
    if (c.securityContext?.readOnlyRootFilesystem !== true) fail(`${where}: writable root filesystem`);
    if (c.securityContext?.allowPrivilegeEscalation !== false) fail(`${where}: privilege escalation allowed`);
    for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
      const grpcPort = c[probe]?.grpc?.port;
      const http = c[probe]?.httpGet;
      if (grpcPort === undefined && http === undefined) fail(`${where}: no gRPC or HTTP /health ${probe}`);
      else if (http !== undefined && http.path !== "/health") fail(`${where}: ${probe} on ${http.path}, not /health`);
      const port = grpcPort ?? http.port;
      if (port !== undefined && !declared.has(port)) fail(`${where}: ${probe} on undeclared port ${port}`);
    }
    for (const p of c.ports ?? []) {
      if (p.name && p.name.length > 15) fail(`${where}: port name ${p.name} longer than 15 characters`);
    }
    const names = (c.args ?? []).map((a) => a.split("=")[0]);
    const dup = names.find((n, i) => names.indexOf(n) !== i);
    if (dup) fail(`${where}: flag ${dup} given twice`);
  }
}

// The engine: the streamer and one worker per rank, each rank with its GPU (cuda backend). With
// several nodes, a StatefulSet of one pod per node holding tp / nodes ranks each, found through
// a headless Service; pod 0 holds rank 0 and the deciding streamer.
const engine = workloads().find((d) => d.metadata.labels["app.kubernetes.io/component"] === "engine");
const nodes = engine?.kind === "StatefulSet" ? engine.spec.replicas : 1;
const perNode = tp / nodes;
const argOf = (c, flag) => c.args?.find((a) => a.startsWith(`--${flag}=`))?.slice(flag.length + 3);
const nodeRankEnv = (c) =>
  c.env?.some((e) => e.name === "NQ_NODE_RANK" &&
    e.valueFrom?.fieldRef?.fieldPath === "metadata.labels['apps.kubernetes.io/pod-index']");
if (!engine) {
  fail("no engine Deployment or StatefulSet");
} else {
  const pod = engine.spec.template.spec;
  const workers = pod.containers.filter((c) => c.name.startsWith("worker-"));
  if (!Number.isInteger(perNode)) fail(`engine: ${nodes} nodes do not divide tensorParallelSize ${tp}`);
  if (workers.length !== perNode) fail(`engine: ${workers.length} workers a node for ${tp} ranks over ${nodes} nodes`);
  const streamer = pod.containers.find((c) => c.name === "streamer");
  if (!streamer) fail("engine: no streamer container");
  if (pod.shareProcessNamespace !== true) fail("engine: PID namespace not shared");
  if (nodes > 1) {
    const peers = byKind("Service").find((s) => s.metadata.name === engine.spec.serviceName);
    if (!peers || peers.spec.clusterIP !== "None" || peers.spec.publishNotReadyAddresses !== true) {
      fail(`engine: serviceName ${engine.spec.serviceName} is not a headless Service publishing unready pods`);
    }
    const leaderHost = `${engine.metadata.name}-0.${engine.spec.serviceName}.`;
    const decider = argOf(streamer, "decider_address") ?? "";
    if (!decider.startsWith(leaderHost) || !decider.endsWith(":8200") || argOf(streamer, "node_rank") !== "$(NQ_NODE_RANK)" ||
        !nodeRankEnv(streamer)) {
      fail(`engine/streamer: --decider_address=${decider} --node_rank=${argOf(streamer, "node_rank")}: not pod 0's streamer and this pod's index`);
    }
    const spread = pod.affinity?.podAntiAffinity?.requiredDuringSchedulingIgnoredDuringExecution?.[0];
    if (spread?.topologyKey !== "kubernetes.io/hostname") fail("engine: pods are not spread one a node");
    for (const c of workers) {
      const leader = argOf(c, "leader_address") ?? "";
      if (argOf(c, "node_rank") !== "$(NQ_NODE_RANK)" || argOf(c, "ranks_per_node") !== String(perNode) ||
          !nodeRankEnv(c) || !leader.startsWith(leaderHost) || !leader.endsWith(":8100") ||
          argOf(c, "tp_control") !== "tcp" ||
          !workers[0].ports.some((p) => p.containerPort === Number(argOf(c, "tp_control_port")))) {
        fail(`engine/${c.name}: --node_rank=${argOf(c, "node_rank")} --ranks_per_node=${argOf(c, "ranks_per_node")} --leader_address=${leader}`);
      }
    }
  }
  workers.forEach((c, rank) => {
    const arg = (flag) => argOf(c, flag);
    if (arg("rank") !== String(rank) || arg("world_size") !== String(tp)) {
      fail(`engine/${c.name}: --rank=${arg("rank")} --world_size=${arg("world_size")}`);
    }
    if (arg("backend") === "cuda") {
      for (const side of ["requests", "limits"]) {
        if (!(Number(c.resources?.[side]?.["nvidia.com/gpu"]) >= 1)) fail(`engine/${c.name}: no nvidia.com/gpu ${side}`);
      }
    }
    if (!c.volumeMounts.some((m) => m.mountPath === "/dev/shm")) fail(`engine/${c.name}: no shared /dev/shm`);
  });
}

// Services: every targetPort names a container port of the pods they select.
for (const s of byKind("Service")) {
  const pods = podsOf(s.spec.selector);
  if (pods.length !== 1) fail(`Service ${s.metadata.name}: selects ${pods.length} workloads`);
  const ports = pods.flatMap(containerPorts);
  for (const p of s.spec.ports) {
    if (!ports.some((cp) => cp.name === p.targetPort || cp.containerPort === p.targetPort)) {
      fail(`Service ${s.metadata.name}: port ${p.name} targets ${p.targetPort}, which no selected container declares`);
    }
  }
}
// The router's --worker_address names the engine Service's gRPC port; with several nodes, pod 0's
// name under the headless Service (the engine Service spreads over every node's pod).
const router = byKind("Deployment").find((d) => d.metadata.labels["app.kubernetes.io/component"] === "router");
if (router) {
  const address = router.spec.template.spec.containers[0].args.find((a) => a.startsWith("--worker_address="));
  const [host, port] = (address ?? "").split("=")[1]?.split(":") ?? [];
  const svcName = nodes > 1 && host?.startsWith(`${engine.metadata.name}-0.`) ? host.split(".")[1] : host;
  const svc = byKind("Service").find((s) => s.metadata.name === svcName);
  if (!svc || !svc.spec.ports.some((p) => String(p.port) === port && p.targetPort === "worker-0-grpc") ||
      (nodes > 1 && svc.spec.clusterIP !== "None")) {
    fail(`router ${address}: not the engine's worker-0 gRPC port${nodes > 1 ? " on pod 0" : ""}`);
  }
}

// NetworkPolicy ports exist on the pods it selects.
for (const np of byKind("NetworkPolicy")) {
  const ports = podsOf(np.spec.podSelector.matchLabels).flatMap(containerPorts);
  for (const rule of np.spec.ingress ?? []) {
    for (const p of rule.ports ?? []) {
      if (!ports.some((cp) => cp.name === p.port || cp.containerPort === p.port)) {
        fail(`NetworkPolicy ${np.metadata.name}: port ${p.port} is not a container port`);
      }
    }
  }
}

// ServiceMonitor: each endpoint's port is a Service port it selects; job names match deploy/.
for (const sm of byKind("ServiceMonitor")) {
  const services = byKind("Service").filter((s) => matches(sm.spec.selector.matchLabels, s.metadata.labels));
  const jobs = new Set();
  for (const ep of sm.spec.endpoints) {
    if (!services.some((s) => s.spec.ports.some((p) => p.name === ep.port))) {
      fail(`ServiceMonitor: endpoint port ${ep.port} is on no selected Service`);
    }
    jobs.add(ep.relabelings?.find((r) => r.targetLabel === "job")?.replacement);
  }
  const want = ["nq-router", "nq-streamer", "nq-worker"];
  if (want.some((j) => !jobs.has(j))) fail(`ServiceMonitor: jobs ${[...jobs]} lack one of ${want}`);
  const workerEndpoints = sm.spec.endpoints.filter((ep) => ep.port.startsWith("worker-")).length;
  if (workerEndpoints !== perNode) fail(`ServiceMonitor: ${workerEndpoints} worker endpoints for ${perNode} ranks a pod`);
}

// The chart's copies of deploy/ (through files/ links) are the same content.
for (const cm of byKind("ConfigMap")) {
  const want = JSON.parse(fs.readFileSync(path.join(sourceDir, "deploy/grafana/nestquant.json"), "utf8"));
  const got = JSON.parse(cm.data["nestquant.json"]);
  if (canonical(got) !== canonical(want)) fail("dashboard ConfigMap differs from deploy/grafana/nestquant.json");
  if (cm.metadata.labels?.grafana_dashboard !== "1") fail("dashboard ConfigMap lacks the grafana_dashboard label");
}
for (const rule of byKind("PrometheusRule")) {
  const want = YAML.parse(fs.readFileSync(path.join(sourceDir, "deploy/prometheus/alerts.yml"), "utf8"));
  if (canonical(rule.spec.groups) !== canonical(want.groups)) {
    fail("PrometheusRule differs from deploy/prometheus/alerts.yml");
  }
}

if (failures.length) {
  console.error(`${renderedFile}:\n  ${failures.join("\n  ")}`);
  process.exit(1);
}
console.log(`${renderedFile}: ${objects.length} objects valid`);
