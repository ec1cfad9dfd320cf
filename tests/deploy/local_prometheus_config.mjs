// Prints deploy/prometheus/prometheus.yml with each job's targets replaced (JOB=HOST:PORT)
// and 1 s scrape and evaluation intervals; everything else, rule files included, as shipped.
// Usage: node local_prometheus_config.mjs prometheus.yml JOB=HOST:PORT...
import fs from "node:fs";
import YAML from "yaml";

const [file, ...pairs] = process.argv.slice(2);
const config = YAML.parse(fs.readFileSync(file, "utf8"));
const targets = Object.fromEntries(pairs.map((p) => p.split("=")));
config.global = { ...config.global, scrape_interval: "1s", scrape_timeout: "1s", evaluation_interval: "1s" };
const jobs = config.scrape_configs.map((sc) => sc.job_name);
for (const job of Object.keys(targets)) {
  if (!jobs.includes(job)) throw new Error(`${file} has no job ${job} (jobs: ${jobs})`);
}
for (const sc of config.scrape_configs) {
  if (!targets[sc.job_name]) throw new Error(`no local target given for job ${sc.job_name}`);
  sc.static_configs = [{ targets: [targets[sc.job_name]] }];
}
process.stdout.write(YAML.stringify(config));
