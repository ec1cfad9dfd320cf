// Every flag that the chart or the compose file passes to a service exists in that service's
// binary (`--helpfull`), so a renamed or misspelt flag fails here, not at a user's start.
// Usage: node check_flags.mjs NQ_ROUTER NQ_STREAMER NQ_WORKER FILE.yaml...
// FILE.yaml: `helm template` output (containers of every pod template) or `docker-compose
// config` output (services' commands); the service is the image's last path segment.
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import YAML from "yaml";

const [routerBin, streamerBin, workerBin, ...files] = process.argv.slice(2);
if (!workerBin || files.length === 0) {
  console.error("usage: check_flags.mjs NQ_ROUTER NQ_STREAMER NQ_WORKER FILE.yaml...");
  process.exit(2);
}
const binaries = { router: routerBin, streamer: streamerBin, worker: workerBin };
const known = {};
for (const [service, bin] of Object.entries(binaries)) {
  let help;
  try {
    help = execFileSync(bin, ["--helpfull"], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
  } catch (e) {
    help = `${e.stdout ?? ""}${e.stderr ?? ""}`; // absl exits 1 after printing help
  }
  known[service] = new Set([...help.matchAll(/^\s*--([A-Za-z0-9_]+)[ =(]/gm)].map((m) => m[1]));
  if (!known[service].has("host")) {
    console.error(`${bin} --helpfull lists no --host flag; cannot read its flags`);
    process.exit(1);
  }
}

const failures = [];
let checked = 0;
function check(where, image, args) {
  const service = path.basename(String(image ?? "")).split(":")[0];
  if (!binaries[service]) return;
  for (const arg of args ?? []) {
    const m = /^--(no)?([A-Za-z0-9_]+)(=|$)/.exec(String(arg));
    if (!m) {
      failures.push(`${where}: ${arg} is not a --flag=value argument`);
      continue;
    }
    const name = known[service].has(m[2]) ? m[2] : `${m[1] ?? ""}${m[2]}`;
    if (!known[service].has(name)) failures.push(`${where}: nq-${service} has no flag --${m[2]}`);
    checked++;
  }
}

for (const file of files) {
  for (const doc of YAML.parseAllDocuments(fs.readFileSync(file, "utf8"))) {
    const obj = doc.toJS();
    if (!obj) continue;
    if (obj.services) {
      for (const [name, svc] of Object.entries(obj.services)) {
        if (svc.entrypoint) continue; // not the service binary (the embedded-model job)
        check(`${file}: service ${name}`, svc.image, svc.command);
      }
    } else {
      const pod = obj.spec?.template?.spec;
      for (const c of pod?.containers ?? []) {
        check(`${file}: ${obj.kind}/${obj.metadata.name}/${c.name}`, c.image, c.args);
      }
    }
  }
}
if (failures.length) {
  console.error(failures.join("\n"));
  process.exit(1);
}
console.log(`flags ok: ${checked} arguments in ${files.length} file(s)`);
